"""``Fabric(strategy="cudagraph_ddp")`` against Fabric's own ``"ddp"``, bit for bit on the CPU (graphs on the eager
backend): one process in-process, two processes launched by Fabric (gloo); accumulation, clipping, bf16-mixed, a
transformers Llama, ``fabric.save`` / ``fabric.load`` in the middle of a run; ``ddp.distributed_optimizer`` (its
shards saved beside the checkpoint, resumed with and without it); the strategy names and the refusals."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import cg_lightning  # noqa: F401  (registers "cudagraph_ddp" with Fabric)
from cg_lightning.fabric import CUDAGraphDDPStrategy
from cg_lightning.lifecycle import GraphedDataParallel
from tests.fabric_loop import train
from tests.helpers import ROOT, free_port, subprocess_env


def _engine(**graphs):
    return CUDAGraphDDPStrategy(graphs={"warmup_steps": 1, **graphs})


def _assert_same(got, ref):
    assert torch.equal(got["losses"], ref["losses"]), (got["losses"] - ref["losses"]).abs().max()
    for name, p in ref["weights"].items():
        assert torch.equal(got["weights"][name], p), name
    for slot, state in ref["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer"]["state"][slot][key], value), (slot, key)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("accumulate, clip", [(1, None), (2, 0.05)])
def test_one_process_equals_fabric_ddp(precision, accumulate, clip):
    ref = train("ddp", precision=precision, accumulate=accumulate, clip=clip)
    got = train(_engine(), precision=precision, accumulate=accumulate, clip=clip)
    _assert_same(got, ref)
    assert got["stats"]["captured_runners"] == 3 and got["stats"]["forward_replays"] > 0, got["stats"]


def test_a_transformers_llama_equals_fabric_ddp():
    pytest.importorskip("transformers")
    ref = train("ddp", model="llama", accumulate=2, clip=1.0)
    got = train(_engine(), model="llama", accumulate=2, clip=1.0)
    _assert_same(got, ref)
    assert got["stats"]["forward_replays"] > 0, got["stats"]


def test_the_strategy_strings_build_the_engine():
    from lightning.fabric import Fabric

    for name, unused in (("cudagraph_ddp", False), ("cudagraph_ddp_find_unused_parameters_true", True)):
        fabric = Fabric(accelerator="cpu", devices=1, strategy=name)
        assert isinstance(fabric.strategy, CUDAGraphDDPStrategy)
        assert fabric.strategy.ddp_options.find_unused_parameters is unused
        fabric.launch()
        model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
        assert isinstance(model._forward_module, GraphedDataParallel)
        fabric.strategy.teardown()


def _assert_close(got, ref, tol):
    assert (got["losses"] - ref["losses"]).abs().max() <= tol * ref["losses"].abs().max()
    for name, p in ref["weights"].items():
        assert (got["weights"][name] - p).abs().max() <= tol * p.abs().max(), name
    for slot, state in ref["optimizer"]["state"].items():
        for key, value in state.items():
            assert (got["optimizer"]["state"][slot][key] - value).abs().max() <= tol * value.abs().max(), (slot, key)


def test_the_distributed_optimizer_in_one_process_equals_fabric_ddp_and_resumes(tmp_path):
    """``ddp.distributed_optimizer`` with 2 micro-batches and clipping by norm: bit for bit Fabric's ``"ddp"`` (one
    process: the norm over the one shard is torch's own); its checkpoint holds a descriptor and the shard beside it,
    joined equal to ``"ddp"``'s state; resumed with the distributed optimizer, and without it (the shard joined into a
    full state), both end equal to the run that did not stop."""
    from cg_lightning.distributed_optimizer import consolidate

    sharded = lambda: CUDAGraphDDPStrategy(graphs={"warmup_steps": 1}, ddp={"distributed_optimizer": True})  # noqa: E731
    run = dict(accumulate=2, clip=0.05)
    ref_path, path = str(tmp_path / "ref"), str(tmp_path / "ckpt")
    ref = train("ddp", **run, save=ref_path, save_at=3)
    got = train(sharded(), **run, save=path, save_at=3)
    _assert_same(got, ref)
    assert got["stats"]["forward_replays"] > 0, got["stats"]
    saved = torch.load(path, weights_only=False)
    assert set(saved["optimizer"]) == {"sharded_optimizer_files"} and os.listdir(path + ".optim") == ["rank0-of-1.pt"]
    joined, theirs = consolidate(path)["optimizer"], torch.load(ref_path, weights_only=False)["optimizer"]
    assert joined["param_groups"] == theirs["param_groups"]
    for slot, state in theirs["state"].items():
        for key, value in state.items():
            assert torch.equal(joined["state"][slot][key], value), (slot, key)
    for strategy in (sharded(), _engine()):
        resumed = train(strategy, **run, resume=path)
        assert torch.equal(resumed["losses"], got["losses"][6:])
        for name, p in got["weights"].items():
            assert torch.equal(resumed["weights"][name], p), name


def test_the_distributed_optimizer_refuses_a_grad_scaler():
    """16-mixed (``GradScaler``) with ``ddp.distributed_optimizer``: refused at ``fabric.setup``, naming bf16. (Fabric
    turns 16-mixed into bf16 on a CPU, so the precision with a scaler is set by hand.)"""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision

    fabric = Fabric(accelerator="cpu", devices=1,
                    strategy=CUDAGraphDDPStrategy(ddp={"distributed_optimizer": True}))
    fabric.launch()
    model = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
    fabric.strategy.precision = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="does not support 16-mixed precision.*use bf16-mixed"):
        fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    fabric.strategy.teardown()


def test_save_and_load_in_the_middle_resume_exactly(tmp_path):
    path = str(tmp_path / "ckpt")
    whole = train(_engine(), steps=6, accumulate=2)
    train(_engine(), steps=3, accumulate=2, save=path, save_at=3)
    resumed = train(_engine(), steps=6, accumulate=2, resume=path)
    for name, p in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], p), name
    assert torch.equal(resumed["losses"], whole["losses"][6:])
    ref_path = str(tmp_path / "ref")
    train("ddp", steps=3, accumulate=2, save=ref_path, save_at=3)
    ours, theirs = torch.load(path, weights_only=False), torch.load(ref_path, weights_only=False)
    assert sorted(ours["model"]) == sorted(theirs["model"])  # the keys "ddp" writes: a checkpoint for either


@pytest.mark.parametrize("options, match", [
    ({"graphs": {"whole_step": True}}, "graphs.whole_step does not apply under Fabric"),
    ({"graphs": {"capture_optimizer": True}}, "graphs.capture_optimizer does not apply under Fabric"),
    ({"find_unused_parameters": True}, "find_unused_parameters: torch DistributedDataParallel arguments"),
    ({"graphs": {"warmup_step": 1}}, "warmup_step"),
])
def test_what_does_not_apply_is_refused_with_the_option_named(options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        CUDAGraphDDPStrategy(**options)


SCRIPT = os.path.join(ROOT, "tests", "fabric_loop.py")
#: how the two processes are started: by Fabric's own launcher (``fabric.launch()``), by torchrun, by ``fabric run``
LAUNCHERS = {
    "fabric.launch": lambda: [sys.executable, SCRIPT],
    "torchrun": lambda: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                         "127.0.0.1", "--master_port", str(free_port()), SCRIPT],
    "fabric run": lambda: [sys.executable, "-c", "from lightning.fabric.cli import _main; _main()", "run",
                           "--accelerator=cpu", "--devices=2", "--main-address=127.0.0.1",
                           f"--main-port={free_port()}", SCRIPT],
}
ARGS = ("--accumulate", "2", "--clip", "0.05", "--amp", "bf16-mixed")


def _two_processes(tmp_path, launcher: str, strategy: str, *extra: str) -> dict:
    out = str(tmp_path / f"{strategy}-{launcher}.pt")
    env = subprocess_env(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run([*LAUNCHERS[launcher](), "--use", strategy, "--out", out, *ARGS, *extra], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def fabric_ddp_two_processes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ddp")
    out = _two_processes(folder, "fabric.launch", "ddp", "--save", str(folder / "ckpt"))
    return {**out, "checkpoint": str(folder / "ckpt")}


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_two_processes_equal_fabric_ddp(tmp_path, launcher, fabric_ddp_two_processes):
    ref = fabric_ddp_two_processes
    got = _two_processes(tmp_path, launcher, "cudagraph_ddp")
    assert ref["world_size"] == got["world_size"] == 2
    _assert_same(got, ref)
    assert got["stats"]["forward_replays"] > 0, got["stats"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_processes_with_the_distributed_optimizer(tmp_path, fabric_ddp_two_processes):
    """``ddp.distributed_optimizer`` on 2 processes against Fabric's ``"ddp"`` (bf16-mixed, 2 micro-batches, clipping
    by norm): losses, weights and the optimizer state (every rank's shard joined) within 1e-6 relative (the norm is
    summed over the ranks' shards in another order); the checkpoint's shards joined equal ``"ddp"``'s state within
    1e-6; a new model resumed from it in the same processes ends bit-equal to the run that did not stop."""
    from cg_lightning.distributed_optimizer import consolidate

    ref = fabric_ddp_two_processes
    ckpt = str(tmp_path / "ckpt")
    got = _two_processes(tmp_path, "fabric.launch", "cudagraph_ddp", "--distributed-optimizer", "--save", ckpt,
                         "--then-resume")
    _assert_close(got, ref, 1e-6)
    assert sorted(os.listdir(ckpt + ".optim")) == ["rank0-of-2.pt", "rank1-of-2.pt"]
    joined = consolidate(ckpt)["optimizer"]["state"]
    for slot, state in torch.load(ref["checkpoint"], weights_only=False)["optimizer"]["state"].items():
        for key, value in state.items():
            assert (joined[slot][key] - value).abs().max() <= 1e-6 * value.abs().max(), (slot, key)
    resumed = got["resumed"]
    assert torch.equal(resumed["losses"], got["losses"][-len(resumed["losses"]):])
    for name, p in got["weights"].items():
        assert torch.equal(resumed["weights"][name], p), name


def test_the_example_script_trains_and_reports_its_graphs(tmp_path):
    """``examples/train_fabric.py`` as documented, one process on the CPU, with a checkpoint at the end."""
    ckpt = str(tmp_path / "gpt.ckpt")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_fabric.py"), "--accelerator", "cpu",
                           "--steps", "3", "--log-every", "1", "--checkpoint", ckpt],
                          env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "graphed calls 4, forward replays" in done.stdout and "step 2: loss" in done.stdout, done.stdout
    assert set(torch.load(ckpt, weights_only=False)) == {"model", "optimizer", "step"}


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_a_stopped_rank_is_named_within_the_timeout(tmp_path):
    """Two processes under torchrun, ``ddp.timeout_s=10``; rank 1 stops itself (SIGSTOP) before step 3: rank 0's
    backward raises ``PeerLostError`` naming rank 1 and its last step within the timeout, instead of hanging."""
    import signal
    import time

    timeout_s = 10
    cmd = [*LAUNCHERS["torchrun"](), "--use", "cudagraph_ddp", "--out", str(tmp_path / "out.pt"), "--steps", "40",
           "--timeout-s", str(timeout_s), "--stop-rank", "1", "--stop-step", "3", "--faults", str(tmp_path)]
    with open(tmp_path / "torchrun.log", "w") as log:
        launcher = subprocess.Popen(cmd, env=subprocess_env(PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    try:
        error = tmp_path / "error0.txt"
        deadline = time.monotonic() + 150
        while not error.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert error.exists(), (tmp_path / "torchrun.log").read_text()[-3000:]
        time.sleep(0.5)
        when, message = error.read_text().split("\n", 1)
        assert message.startswith(f"PeerLostError: rank 0: rank 1 has been silent for {timeout_s} s"), message
        assert "rank 1 last reported" in message and "its process on this host is stopped" in message, message
        assert float(when) - float((tmp_path / "stopped").read_text()) < timeout_s + 10
    finally:
        for r in (0, 1):
            try:
                os.kill(int((tmp_path / f"pid{r}").read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=10)


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["parity", "llama"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_real_graphs_equal_fabric_ddp(model, precision, deterministic):
    """On the GPU with CUDA graphs: every precision (16-mixed through its GradScaler), bit for bit."""
    if model == "llama":
        pytest.importorskip("transformers")
    kw = dict(model=model, precision=precision, accumulate=2, clip=1.0, accelerator="cuda", steps=5)
    ref = train("ddp", **kw)
    got = train(_engine(backend="cuda"), **kw)
    assert got["scaler"] == (precision == "16-mixed")
    _assert_same(got, ref)
    assert got["stats"]["captured_runners"] == 3 and got["stats"]["forward_replays"] > 0, got["stats"]
    print(f"fabric {model} {precision} cuda graphs: loss diff 0, weight diff 0, "
          f"replays {got['stats']['forward_replays']}")


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_real_graphs_with_the_distributed_optimizer_equal_fabric_ddp(precision, deterministic):
    """``ddp.distributed_optimizer`` on the GPU with CUDA graphs (one process, overlapped all-gather), bit for bit."""
    kw = dict(precision=precision, accumulate=2, clip=1.0, accelerator="cuda", steps=5)
    ref = train("ddp", **kw)
    got = train(CUDAGraphDDPStrategy(graphs={"warmup_steps": 1, "backend": "cuda"},
                                     ddp={"distributed_optimizer": True}), **kw)
    _assert_same(got, ref)
    assert got["stats"]["forward_replays"] > 0, got["stats"]
    print(f"fabric distributed optimizer {precision} cuda graphs: loss diff 0, weight diff 0")
