"""``CUDAGraphAccelerator`` against plain ``accelerate.Accelerator`` (torch DDP) on the same script, seed and data.

The script is ``examples/train_accelerate.py`` with the tiny GPT of the other parity tests; two processes
get torchrun's environment (forked by :func:`tests.launchers.run_ranks`) and join over gloo as Accelerate's
MULTI_CPU. The eager graph backend replays the
same kernels, so fp32 results agree to rounding (measured: identical).
"""

from __future__ import annotations

import os

import pytest
import torch

from cg_lightning.examples.configs import path as shipped_config
from tests.helpers import PARITY_MODEL, ROOT, WARMUP, max_rel_diff, state_rel_diff
from tests.launchers import run_ranks

SCRIPT = os.path.join(ROOT, "examples", "train_accelerate.py")
TINY = [
    "--config", shipped_config("gpt_tiny"),
    *(f"--model.init_args.{key}={PARITY_MODEL[key]}" for key in ("n_layer", "d_model", "n_head", "block_size")),
    "--data.init_args.batch_size=4", "--data.init_args.max_bytes=300000",
    f"--trainer.strategy.init_args.graphs.warmup_steps={WARMUP}", "--log-every", "1000",
]
N_LAYER = PARITY_MODEL["n_layer"]


def _train_pair(tmp_path, *args: str, timeout: float = 150):
    """The script twice at once, 2 processes each (torchrun's environment, :func:`tests.launchers.run_ranks`): the
    cg engine and eager Accelerate. Returns both outputs."""
    jobs = [([*TINY, *args, *(["--eager"] if mode == "eager" else []), "--out", str(tmp_path / f"{mode}.pt")], 2)
            for mode in ("cg", "eager")]
    run_ranks(SCRIPT, jobs, str(tmp_path), timeout=timeout)
    results = [torch.load(str(tmp_path / f"{mode}.pt")) for mode in ("cg", "eager")]
    cg, eager = results
    for r in results:
        assert r["run"]["distributed_type"] == "MULTI_CPU" and r["run"]["num_processes"] == 2, r["run"]
    assert eager["run"]["eager"] and eager["stats"] is None and not cg["run"]["eager"]
    return cg, eager


def _assert_parity(cg, eager, tol: float) -> None:
    assert len(cg["losses"]) == len(eager["losses"]) and len(cg["losses"][0]) == 2
    loss_diff = max_rel_diff(cg["losses"], eager["losses"])
    weight_diff = state_rel_diff(cg["state"], eager["state"])
    print(f"max relative difference: losses {loss_diff:.3g}, final weights {weight_diff:.3g}")
    assert loss_diff < tol
    assert weight_diff < tol


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_two_process_parity_with_clipping(tmp_path):
    """12 steps, 2 processes, clip_grad_norm_(max_norm=0.05) on every step (the norms are ~2-4, so every
    step is clipped): losses per step and rank, pre-clip norms and final weights equal eager Accelerate
    within 1e-5; graphs replayed every step after warmup."""
    steps = 12
    cg, eager = _train_pair(tmp_path, "--max-steps", str(steps), "--trainer.gradient_clip_val=0.05")
    _assert_parity(cg, eager, 1e-5)
    assert len(cg["grad_norms"]) == steps and min(eager["grad_norms"]) > 0.05  # clipping was active
    assert max_rel_diff(cg["grad_norms"], eager["grad_norms"]) < 1e-5
    stats = cg["stats"]
    assert stats["captured_runners"] == N_LAYER
    assert stats["forward_replays"] == N_LAYER * (steps - WARMUP)
    assert stats["fallback_calls"] == 0


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_two_process_gradient_accumulation_parity(tmp_path):
    """accelerator.accumulate with 4 micro-batches per step (engine.no_sync on the first three), clipping on:
    equal to eager Accelerate within 1e-5; every micro-batch after warmup replays the graphs."""
    steps, accumulation = 6, 4
    cg, eager = _train_pair(tmp_path, "--max-steps", str(steps), "--gradient-accumulation-steps", str(accumulation),
                            "--trainer.gradient_clip_val=0.05")
    assert len(cg["losses"]) == steps * accumulation
    _assert_parity(cg, eager, 1e-5)
    assert len(cg["grad_norms"]) == steps
    assert max_rel_diff(cg["grad_norms"], eager["grad_norms"]) < 1e-5
    assert cg["stats"]["captured_runners"] == N_LAYER
    assert cg["stats"]["forward_replays"] == N_LAYER * accumulation * (steps - WARMUP)


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_two_process_bf16_parity(tmp_path):
    """mixed_precision="bf16" (Accelerate's autocast around the model's forward) on CPU: equal to eager
    Accelerate in bf16 within 1e-2."""
    from accelerate.utils import is_bf16_available

    if not is_bf16_available(True):
        pytest.skip("Accelerate reports no bf16 support on this machine")
    steps = 10
    cg, eager = _train_pair(tmp_path, "--max-steps", str(steps), "--mixed-precision", "bf16")
    assert cg["run"]["mixed_precision"] == eager["run"]["mixed_precision"] == "bf16"
    _assert_parity(cg, eager, 1e-2)
    assert cg["stats"]["forward_replays"] == N_LAYER * (steps - WARMUP)


# ---------------------------------------------------------------------------------- one process, in-process


def _run_script_in_process(tmp_path, name: str, *args: str) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    from examples.train_accelerate import main

    out = str(tmp_path / f"{name}.pt")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    main([*TINY, "--cpu", *args, "--out", out])
    return torch.load(out)


@pytest.mark.timeout(120)
def test_single_process_accumulation_parity(tmp_path, fresh_accelerate_state, capsys):
    """One process: Accelerate's own no_sync does nothing there, the engine's must still keep the first
    micro-batches from finishing the sync (else the gradients would be added twice). The capture line says how
    many segments the blocks were chained into, as the Lightning strategy's does."""
    args = ["--max-steps", "5", "--gradient-accumulation-steps", "2", "--trainer.gradient_clip_val=0.05"]
    cg = _run_script_in_process(tmp_path, "cg", *args)
    assert "chained into 1 segment(s)" in capsys.readouterr().out
    assert cg["stats"]["segments"] == 1
    eager = _run_script_in_process(tmp_path, "eager", *args, "--eager")
    assert cg["run"]["distributed_type"] == "NO" and len(cg["losses"][0]) == 1
    assert max_rel_diff(cg["losses"], eager["losses"]) < 1e-5
    assert max_rel_diff(cg["grad_norms"], eager["grad_norms"]) < 1e-5
    assert state_rel_diff(cg["state"], eager["state"]) < 1e-5
    assert cg["stats"]["forward_replays"] == N_LAYER * 2 * (5 - WARMUP)


@pytest.mark.timeout(120)
def test_single_process_distributed_optimizer_parity(tmp_path, fresh_accelerate_state, monkeypatch):
    """``ddp.distributed_optimizer`` through the Accelerate integration, one process (its shard is everything; the
    collectives are covered by tests/test_distributed_optimizer.py): 2 micro-batches per step and
    ``accelerator.clip_grad_norm_`` (the norm over the shards) equal eager Accelerate within 1e-5, every optimizer
    step taken by the sharded step."""
    from cg_lightning.optim.sharded_optimizer import ShardedOptimizer

    steps = []
    step = ShardedOptimizer.step
    monkeypatch.setattr(ShardedOptimizer, "step", lambda self, closure=None: steps.append(1) or step(self, closure))
    args = ["--max-steps", "5", "--gradient-accumulation-steps", "2", "--trainer.gradient_clip_val=0.05"]
    cg = _run_script_in_process(tmp_path, "cg", *args, "--trainer.strategy.init_args.ddp.distributed_optimizer=true")
    eager = _run_script_in_process(tmp_path, "eager", *args, "--eager")
    assert len(steps) == 5
    assert max_rel_diff(cg["losses"], eager["losses"]) < 1e-5
    assert max_rel_diff(cg["grad_norms"], eager["grad_norms"]) < 1e-5
    assert state_rel_diff(cg["state"], eager["state"]) < 1e-5


@pytest.mark.timeout(120)
def test_single_process_direct_grad_ready_parity(tmp_path, fresh_accelerate_state):
    """graphs.direct_grad_ready through the Accelerate integration (accelerator.backward hands the loss to
    the graph manager), 2 micro-batches per step: every block parameter is reported by its replay after the
    first replayed step, and results equal eager Accelerate within 1e-5."""
    args = ["--max-steps", "5", "--gradient-accumulation-steps", "2", "--trainer.strategy.init_args.graphs.direct_grad_ready=true"]
    cg = _run_script_in_process(tmp_path, "cg", *args)
    eager = _run_script_in_process(tmp_path, "eager", *args, "--eager")
    assert cg["stats"]["direct_ready_params"] == 24  # all 12 parameters of each of the 2 blocks
    assert cg["stats"]["forward_replays"] == N_LAYER * 2 * (5 - WARMUP)
    assert max_rel_diff(cg["losses"], eager["losses"]) < 1e-5
    assert state_rel_diff(cg["state"], eager["state"]) < 1e-5


def _tiny_setup(accelerator):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return (model, *accelerator.prepare(model, optimizer))


def test_prepare_wraps_in_engine_and_unwraps(fresh_accelerate_state):
    from cg_lightning.accelerate import CUDAGraphAccelerator, GradBufferOptimizer, GraphedDataParallel

    accelerator = CUDAGraphAccelerator(cpu=True, graphs={"enabled": False})
    raw, model, optimizer = _tiny_setup(accelerator)
    assert isinstance(model, GraphedDataParallel) and isinstance(optimizer, GradBufferOptimizer)
    assert accelerator.unwrap_model(model) is raw
    assert accelerator.get_state_dict(model).keys() == raw.state_dict().keys()
    x = torch.randn(3, 4)
    accelerator.backward(model(x).sum())
    assert all(p.grad is p.main_grad for p in raw.parameters())  # exposed for clipping and the optimizer
    before = [p.detach().clone() for p in raw.parameters()]
    optimizer.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, raw.parameters()))
    optimizer.zero_grad()
    assert all(p.grad is None and not p.main_grad.any() for p in raw.parameters())
    accelerator.backward(model(x).sum())
    model.zero_grad()  # nn.Module.zero_grad on the prepared model also reaches main_grad
    assert all(p.grad is None and not p.main_grad.any() for p in raw.parameters())


def test_capture_optimizer_is_lightning_only_and_says_so(fresh_accelerate_state):
    """graphs.capture_optimizer is accepted (one YAML serves both entry points) but does nothing under
    Accelerate: a warning says so instead of silently ignoring it."""
    from cg_lightning.accelerate import CUDAGraphAccelerator

    with pytest.warns(UserWarning, match="capture_optimizer applies to the Lightning strategy only"):
        CUDAGraphAccelerator(cpu=True, graphs={"enabled": False, "capture_optimizer": True})


def test_loss_backward_instead_of_accelerator_backward_is_an_error(fresh_accelerate_state):
    from cg_lightning.accelerate import CUDAGraphAccelerator

    accelerator = CUDAGraphAccelerator(cpu=True, graphs={"enabled": False})
    _, model, optimizer = _tiny_setup(accelerator)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="accelerator.backward"):
        optimizer.step()


def test_forward_of_the_unwrapped_model_is_an_error(fresh_accelerate_state):
    """A forward through ``accelerator.unwrap_model(model)`` bypasses the engine: its hooks put the gradients
    into main_grad, but nothing finishes the sync or exposes ``param.grad``, so ``optimizer.step()`` would change
    nothing (the weights would end 0.16 off Accelerate's, silently). ``accelerator.backward`` says so."""
    from cg_lightning.accelerate import CUDAGraphAccelerator

    accelerator = CUDAGraphAccelerator(cpu=True, graphs={"enabled": False})
    raw, model, optimizer = _tiny_setup(accelerator)
    with pytest.raises(RuntimeError, match=r"without a forward of the prepared model.*unwrap_model"):
        accelerator.backward(accelerator.unwrap_model(model)(torch.randn(3, 4)).sum())


def test_torch_ddp_kwargs_refused(fresh_accelerate_state):
    from accelerate.utils import DistributedDataParallelKwargs

    from cg_lightning.accelerate import CUDAGraphAccelerator

    with pytest.raises(ValueError, match="DistributedDataParallelKwargs"):
        CUDAGraphAccelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=5)])


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2)]
        )
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _train_with_raw_optimizer(accelerator, steps: int):
    torch.manual_seed(0)
    model = _Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared = accelerator.prepare(model)  # the optimizer is not prepared: its zero_grad only drops param.grad
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = prepared(torch.randn(5, 4, generator=g)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, prepared


def test_unprepared_optimizer_matches_eager(fresh_accelerate_state):
    """A raw optimizer's zero_grad (param.grad = None) still zeroes main_grad before the next backward, and
    the graph schedule counts steps without the optimizer: graphs replay from step 2 on, results equal."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from cg_lightning.accelerate import CUDAGraphAccelerator

    steps = 6
    cg_losses, cg_state, engine = _train_with_raw_optimizer(
        CUDAGraphAccelerator(cpu=True, graphs={"warmup_steps": 2}), steps)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    ref_losses, ref_state, _ = _train_with_raw_optimizer(Accelerator(cpu=True), steps)
    assert engine.graph_stats.captured_runners == 2
    assert engine.graph_stats.forward_replays == 2 * (steps - 2)
    assert max_rel_diff(cg_losses, ref_losses) < 1e-6
    assert state_rel_diff(cg_state, ref_state) < 1e-6


def test_eval_graphs_in_an_accelerate_script(fresh_accelerate_state):
    """graphs.capture_eval in an Accelerate script: after training, ``model.eval()`` and calls under
    ``torch.no_grad`` replay forward-only graphs of the blocks (first call per shape eager), with outputs
    equal to the same model's eager forward; training graphs untouched."""
    from cg_lightning.accelerate import CUDAGraphAccelerator

    accelerator = CUDAGraphAccelerator(cpu=True, graphs={"warmup_steps": 2, "capture_eval": True})
    _, _, engine = _train_with_raw_optimizer(accelerator, 4)
    module = accelerator.unwrap_model(engine)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    engine.eval()
    with torch.no_grad():
        outs = [engine(x) for _ in range(3)]
    stats = engine.graph_stats
    engine.graph_manager.remove()  # the blocks' own forwards back: the eager reference
    with torch.no_grad():
        want = module(x)
    for o in outs:
        assert torch.equal(o, want)
    assert stats.eval_graphs == 2 and stats.eval_replays == 2 * 2
    assert stats.captured_runners == 2 and stats.forward_replays == 2 * (4 - 2)


def test_torch_compile_refused_at_prepare(fresh_accelerate_state):
    from cg_lightning.accelerate import CUDAGraphAccelerator

    accelerator = CUDAGraphAccelerator(cpu=True, dynamo_backend="inductor")
    with pytest.raises(ValueError, match="dynamo"):
        accelerator.prepare(torch.nn.Linear(2, 2))


def test_help_names_the_file_out_writes(capsys):
    from examples.train_accelerate import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--out FILE rank 0 saves losses, final weights and graph counters to this file (torch.save)" in text


@pytest.mark.parametrize("overrides, expected", [
    (["--trainer.max_step=5"], "error: command line: trainer.max_step: unknown key (did you mean 'max_steps'?)"),
    (["--model.init_args.n_layr=2"], "error: command line: model.init_args.n_layr: unknown key (did you mean "
                                     "'n_layer'?)"),
    (["--data.init_args.block_size=256"], "error: command line: data.init_args.block_size: 256 is longer than the "
                                          "model's context"),
])
def test_config_errors_are_error_lines_and_exit_2(overrides, expected, capsys):
    """A bad key stops the Accelerate example as it stops `python -m cg_lightning`: one `error:` line per
    problem on stderr and exit status 2, no traceback (config errors raise before any Accelerate state)."""
    from examples.train_accelerate import main

    with pytest.raises(SystemExit) as exc:
        main(["--config", shipped_config("gpt_tiny"), "--cpu", *overrides])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert [line for line in err.strip().splitlines() if line.startswith("error: ")] == [err.strip().splitlines()[-1]]


# --------------------------------------------------------------- loops plain Accelerate runs (accelerate_cases)

_CASE_DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")]


def _cases():
    import importlib.util

    spec = importlib.util.spec_from_file_location("accelerate_cases", os.path.join(ROOT, "tests", "scripts",
                                                                                   "accelerate_cases.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_same_training(cg, eager, tol):
    print(f"max rel loss diff {max_rel_diff(cg['losses'], eager['losses']):.1e}, "
          f"seen {max_rel_diff(cg['seen'], eager['seen']) if cg['seen'] else 0:.1e}, "
          f"weights {state_rel_diff(cg['state'], eager['state']):.1e}")
    assert max_rel_diff(cg["losses"], eager["losses"]) <= tol
    assert len(cg["seen"]) == len(eager["seen"])
    if cg["seen"]:
        assert max_rel_diff(cg["seen"], eager["seen"]) <= tol
    assert state_rel_diff(cg["state"], eager["state"]) <= tol


@pytest.mark.parametrize("device", _CASE_DEVICES)
def test_two_optimizers_stepped_and_zeroed_in_turn(device, fresh_accelerate_state):
    """o1.step(); o1.zero_grad(); o2.step(): o1's zero_grad must leave o2's gradients alone (it zeroed the
    whole main_grad buffer, so o2 stepped on nothing and the blocks never trained). Same losses and weights as
    plain Accelerate, bit for bit on CPU (1e-6 on the GPU)."""
    cases = _cases()
    cg, eager = cases.run("cg", "two_optimizers", device), cases.run("eager", "two_optimizers", device)
    assert cg["replays"] == N_LAYER * (6 - WARMUP)
    _assert_same_training(cg, eager, 0.0 if device == "cpu" else 1e-6)


@pytest.mark.parametrize("device", _CASE_DEVICES)
def test_gradients_between_accumulation_micro_batches(device, fresh_accelerate_state):
    """Accumulation 2: after every accelerator.backward the loop reads p.grad's norm, clips and halves it. Plain
    PyTorch holds the sum so far in p.grad then; the engine had p.grad None on the first micro-batch (the norm
    missing, clipping and scaling silently skipped). Same norms, losses and weights as plain Accelerate."""
    cases = _cases()
    cg, eager = cases.run("cg", "microbatch_grads", device), cases.run("eager", "microbatch_grads", device)
    assert all(n == n for n in cg["seen"]), cg["seen"]  # no micro-batch without gradients (nan)
    _assert_same_training(cg, eager, 0.0 if device == "cpu" else 1e-6)


@pytest.mark.parametrize("device", _CASE_DEVICES)
def test_non_contiguous_block_inputs_are_bit_exact(device, fresh_accelerate_state):
    """The blocks take and return (B, T, D) tensors with the strides of a (B, D, T) one (a BatchNorm on the
    transposed activations in front). Eager backward hands their outputs contiguous gradients; the backward
    graphs read theirs from buffers that had the outputs' layout, so replays summed in another order (1.2e-7
    relative off in the weights). The buffers now take the layout eager backward handed over in the recorded
    step: bit-identical on CPU, 1e-6 on the GPU."""
    cases = _cases()
    cg, eager = cases.run("cg", "bn", device), cases.run("eager", "bn", device)
    assert cg["replays"] == N_LAYER * (6 - WARMUP)
    _assert_same_training(cg, eager, 0.0 if device == "cpu" else 1e-6)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_process_buffers_broadcast(tmp_path):
    """2 processes, each its own data shard, BatchNorm running statistics, an eval loss after every step: with
    ddp.broadcast_buffers (default on) rank 0's buffers reach rank 1 before every training forward, as under
    torch DDP (the Accelerate engine's forward skipped that broadcast: rank 1's running_var was 0.29 off and the
    ranks reported different eval losses). Every rank equals plain Accelerate's same rank."""
    script = os.path.join(ROOT, "tests", "scripts", "accelerate_cases.py")
    out = {}
    run_ranks(script, [([kind, "bn", str(tmp_path / kind)], 2) for kind in ("cg", "eager")], str(tmp_path),
              timeout=240)
    for kind in ("cg", "eager"):
        out[kind] = [torch.load(str(tmp_path / f"{kind}.rank{r}")) for r in (0, 1)]
    for rank in (0, 1):
        _assert_same_training(out["cg"][rank], out["eager"][rank], 0.0)
    assert out["cg"][0]["seen"] == out["cg"][1]["seen"]


def _phase(cases, acc, raw, steps=4, seed=0, before_step=None):
    """Prepare ``raw`` with SGD and train ``steps`` steps; ``before_step(step, model, optimizer)`` runs first in
    every step. Returns the prepared model, the prepared optimizer and the losses."""
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(cases._data(4 * steps, seed=seed), batch_size=4)
    model, optimizer, loader = acc.prepare(raw, optimizer, loader)
    losses = []
    for step, (x, y) in enumerate(loader):
        if before_step is not None:
            before_step(step, model, optimizer)
        loss = cases._loss(model(x), y)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return model, optimizer, losses


@pytest.mark.parametrize("then", ["nothing", "free_memory", "end_training"])
def test_plain_backward_after_training_fills_param_grad(then, fresh_accelerate_state):
    """After training, a plain loss.backward() through accelerator.unwrap_model(model) (saliency, a plain
    fine-tuning loop) fills every p.grad as without the engine; the engine's hooks took those gradients into
    main_grad and left p.grad None (a plain optimizer step then changed nothing). Equal to plain Accelerate's."""
    cases = _cases()
    grads = {}
    for kind in ("cg", "eager"):
        acc = cases._accelerator(kind, "cpu")
        torch.manual_seed(0)
        model, optimizer, _ = _phase(cases, acc, cases.Net())
        user = acc.unwrap_model(model)
        if then == "free_memory":
            acc.free_memory(model, optimizer)
        elif then == "end_training":
            acc.end_training()
        x, y = cases._data(4, seed=9).tensors
        cases._loss(user(x), y).backward()
        grads[kind] = {n: p.grad for n, p in user.named_parameters()}
    assert all(g is not None for g in grads["cg"].values()), [n for n, g in grads["cg"].items() if g is None]
    assert all(torch.equal(grads["cg"][n], grads["eager"][n]) for n in grads["eager"])


def test_free_memory_then_prepare_the_same_model_again(fresh_accelerate_state):
    """free_memory() and a second prepare of the same model (a second phase, Accelerate's
    find_executable_batch_size pattern): the second prepare wraps it again and trains it. Before, Accelerate's
    "prepared" mark made prepare hand the bare model back while the old engine's hooks swallowed its
    gradients: the second phase trained nothing. Losses and weights equal plain Accelerate's, bit for bit."""
    cases = _cases()
    out = {}
    for kind in ("cg", "eager"):
        acc = cases._accelerator(kind, "cpu")
        torch.manual_seed(0)
        raw = cases.Net()
        model, optimizer, first = _phase(cases, acc, raw)
        acc.free_memory(model, optimizer)
        model, optimizer, second = _phase(cases, acc, raw, seed=1)
        if kind == "cg":
            assert type(model).__name__ == "GraphedDataParallel"
            assert model.graph_stats.forward_replays == N_LAYER * (4 - WARMUP)
        out[kind] = (first + second, {k: v.clone() for k, v in raw.state_dict().items()})
    assert out["cg"][0] == out["eager"][0]
    assert all(torch.equal(out["cg"][1][k], out["eager"][1][k]) for k in out["eager"][1])


@pytest.mark.parametrize("device", _CASE_DEVICES)
def test_gan_generator_waits_for_the_backward_that_reaches_it(device, fresh_accelerate_state):
    """A GAN loop: the generator's forward feeds the discriminator's loss detached, so that backward reaches no
    generator parameter; its micro-batch stays open until the generator's loss (it was a GradSyncError naming the
    generator's parameters as missing). Same losses and weights as plain Accelerate (bit for bit on CPU)."""
    cases = _cases()
    cg, eager = cases.run("cg", "gan", device), cases.run("eager", "gan", device)
    assert cg["replays"] == N_LAYER * (6 - WARMUP)
    _assert_same_training(cg, eager, 0.0 if device == "cpu" else 1e-6)


@pytest.mark.parametrize("zero_after", [False, True])
def test_a_backward_outside_accelerator_backward_mid_training_accumulates_as_plain(zero_after, fresh_accelerate_state):
    """After capture, a saliency-style backward through accelerator.unwrap_model(model) fills param.grad; the next
    accelerator.backward accumulates onto it as plain PyTorch does unless the loop zeroes first. The graphed
    blocks' share of those gradients was dropped (the replays add into main_grad, which never saw it; weights
    0.1 off), the eager layers' was kept. Losses and weights equal plain Accelerate, bit for bit."""
    cases = _cases()

    def saliency(step, model, optimizer):
        if step == 3:  # after capture (warmup 2)
            xs, ys = cases._data(4, seed=9).tensors
            cases._loss(acc.unwrap_model(model)(xs), ys).backward()
            if zero_after:
                optimizer.zero_grad()

    out = {}
    for kind in ("cg", "eager"):
        acc = cases._accelerator(kind, "cpu")
        torch.manual_seed(0)
        raw = cases.Net()
        _, _, losses = _phase(cases, acc, raw, steps=6, before_step=saliency)
        out[kind] = (losses, {k: v.clone() for k, v in raw.state_dict().items()})
    assert out["cg"][0] == out["eager"][0]
    assert all(torch.equal(out["cg"][1][k], out["eager"][1][k]) for k in out["eager"][1])


def test_two_forwards_then_two_backwards_is_refused_naming_the_pattern(fresh_accelerate_state):
    """Accelerate's trigger_sync_in_backward example (two forwards under no_sync, then one backward each) is not
    supported: the second backward is refused, and the message names that pattern and what to do instead."""
    cases = _cases()
    acc = cases._accelerator("cg", "cpu")
    torch.manual_seed(0)
    model, optimizer = acc.prepare(cases.Net(), torch.optim.SGD(cases.Net().parameters(), lr=0.1))
    (xa, ya), (xb, yb) = [t.tensors for t in (cases._data(4, seed=1), cases._data(4, seed=2))]
    with acc.no_sync(model):
        loss_a, loss_b = cases._loss(model(xa), ya), cases._loss(model(xb), yb)
    acc.backward(loss_a)
    with pytest.raises(RuntimeError, match=r"two forwards followed by two backwards as in Accelerate's "
                                            r"trigger_sync_in_backward example.*add the losses and run one backward"):
        with acc.trigger_sync_in_backward(model):
            acc.backward(loss_b)


def test_end_training_keeps_exposed_gradients_and_none_as_plain(fresh_accelerate_state):
    """end_training after a backward whose gradients were not zeroed: each param.grad keeps its values in a
    tensor of its own (not the engine's buffer), and one the loop set to None stays None (a zero tensor would
    make a plain optimizer step apply weight decay and momentum to it)."""
    cases = _cases()
    acc = cases._accelerator("cg", "cpu")
    torch.manual_seed(0)
    raw = cases.Net()
    model, optimizer = acc.prepare(raw, torch.optim.SGD(raw.parameters(), lr=0.1))
    x, y = cases._data(4).tensors
    acc.backward(cases._loss(model(x), y))
    expected = {n: p.grad.clone() for n, p in raw.named_parameters()}
    raw.head.weight.grad = None
    acc.end_training()
    assert raw.head.weight.grad is None
    for n, p in raw.named_parameters():
        if n != "head.weight":
            assert torch.equal(p.grad, expected[n]) and p.grad.data_ptr() != p.main_grad.data_ptr()


def test_overridden_accelerate_methods_are_marked():
    """Every ``Accelerator`` / ``AcceleratedOptimizer`` method the integration overrides (its faults mixin's too) is
    marked ``@override``."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    from cg_lightning.accelerate import CUDAGraphAccelerator, GradBufferOptimizer
    from cg_lightning.accelerate.faults import AccelerateFaultsMixin

    pairs = ((CUDAGraphAccelerator, Accelerator), (AccelerateFaultsMixin, Accelerator),
             (GradBufferOptimizer, AcceleratedOptimizer))
    for cls, base in pairs:
        names = [n for n, v in vars(cls).items() if n != "__init__" and callable(v) and hasattr(base, n)]
        assert names
        for name in names:
            assert getattr(vars(cls)[name], "__override__", False), f"{cls.__name__}.{name} lacks @override"
