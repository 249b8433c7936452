"""`Trainer(strategy="cudagraph_ddp")` against Lightning's own "ddp" on the same seed and data (CPU)."""

import pytest
import torch
from lightning.pytorch import Callback

import cg_lightning
from cg_lightning.examples.data import TextDataModule
from cg_lightning.examples.gpt import GPTLightningModule
from tests.helpers import cg_strategy, make_trainer, max_rel_diff, state_rel_diff, train_in_process, train_subprocess


def test_strategy_is_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    assert "cudagraph_ddp" in StrategyRegistry.available_strategies()
    assert issubclass(cg_lightning.CUDAGraphDDPStrategy, __import__("lightning").pytorch.strategies.DDPStrategy)


def test_single_process_parity_and_main_grad():
    """20 steps, one process: losses and weights equal "ddp"; main_grad of the first replayed step equals
    the eager gradient within 1e-6."""
    warmup = 2
    ref_model, ref, _ = train_in_process("ddp", steps=20, at_steps=(warmup,))
    strategy = cg_strategy(warmup_steps=warmup, whole_step=False)
    cg_model, cg, trainer = train_in_process(strategy, steps=20, at_steps=(warmup,))

    stats = strategy.last_graph_stats
    assert stats.captured_runners == 2  # two blocks, one call each per step
    assert stats.forward_replays == 2 * (20 - warmup)
    assert max_rel_diff(cg.losses, ref.losses) < 1e-5
    assert state_rel_diff(cg_model.state_dict(), ref_model.state_dict()) < 1e-5
    g_cg, g_ref = cg.grads[warmup], ref.grads[warmup]
    assert g_cg.keys() == g_ref.keys() and g_cg
    for name in g_ref:
        torch.testing.assert_close(g_cg[name], g_ref[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_process_parity(tmp_path):
    """gloo, 2 processes, 20 steps from a fixed seed, the defaults (the whole step replayed from one graph on both
    ranks): per-step losses and final weights equal "ddp"."""
    common = ["--devices", "2", "--steps", "20", "--backend", "eager"]
    ref = train_subprocess(str(tmp_path / "ddp.pt"), "--strategy", "ddp", *common)
    cg = train_subprocess(str(tmp_path / "cg.pt"), "--strategy", "cudagraph_ddp", *common)
    assert cg["step_stats"]["captures"] == 1 and cg["step_stats"]["replays"] == 20 - 3, cg["step_stats"]
    assert max_rel_diff(cg["losses"], ref["losses"]) < 1e-5
    assert state_rel_diff(cg["state"], ref["state"]) < 1e-5


def test_graphs_disabled_trains_through_engine():
    ref_model, ref, _ = train_in_process("ddp", steps=6)
    strategy = cg_lightning.CUDAGraphDDPStrategy(graphs={"enabled": False})
    model, rec, _ = train_in_process(strategy, steps=6)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert strategy.last_graph_stats is None


def test_each_strategy_has_options_of_its_own():
    """The defaults of ``graphs`` and ``ddp`` are instances (what ``--print_config`` shows); a strategy's options
    changed in place (as ``CUDAGraphCallback`` sets its schedule) reach no other strategy, nor the instance given."""
    first, second = cg_lightning.CUDAGraphDDPStrategy(), cg_lightning.CUDAGraphDDPStrategy()
    first.graph_options.warmup_steps, first.ddp_options.bucket_size_mb = 7, 7.0
    assert second.graph_options == cg_lightning.GraphOptions() and second.ddp_options == cg_lightning.DDPOptions()
    assert cg_lightning.CUDAGraphDDPStrategy().graph_options == cg_lightning.GraphOptions()
    given = cg_lightning.GraphOptions(warmup_steps=3)
    cg_lightning.CUDAGraphDDPStrategy(graphs=given).graph_options.warmup_steps = 5
    assert given.warmup_steps == 3


def test_torch_ddp_options_map_onto_the_engine_or_are_refused_with_the_reason():
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = cg_lightning.CUDAGraphDDPStrategy(find_unused_parameters=True, static_graph=True, bucket_cap_mb=5,
                                                 gradient_as_bucket_view=False, broadcast_buffers=False,
                                                 ddp_comm_hook=None, start_method="popen")
    ddp = strategy.ddp_options
    assert (ddp.find_unused_parameters, ddp.bucket_size_mb, ddp.broadcast_buffers) == (True, 5, False)
    assert cg_lightning.CUDAGraphDDPStrategy(static_graph=False).ddp_options == cg_lightning.DDPOptions()
    for name, value in (("cudagraph_ddp_find_unused_parameters_true", True),
                        ("cudagraph_ddp_find_unused_parameters_false", False)):
        assert StrategyRegistry.get(name).ddp_options.find_unused_parameters is value
    with pytest.raises(ValueError, match=r"ddp_comm_hook=.* cannot be honoured: the engine all-reduces its own"):
        cg_lightning.CUDAGraphDDPStrategy(ddp_comm_hook=lambda *a: None)
    with pytest.raises(ValueError, match=r"init_sync=False cannot be honoured"):
        cg_lightning.CUDAGraphDDPStrategy(init_sync=False)
    with pytest.raises(ValueError, match=r"bucket_cap_mb=5 contradicts ddp.bucket_size_mb=8"):
        cg_lightning.CUDAGraphDDPStrategy(bucket_cap_mb=5, ddp={"bucket_size_mb": 8})
    with pytest.raises(ValueError, match=r"output_devic=0 is not an argument"):
        cg_lightning.CUDAGraphDDPStrategy(output_devic=0)


def test_manual_optimization_with_graphs_equals_ddp():
    """The example GPT under manual optimization (one optimizer, ``manual_backward``, step, zero_grad): graphs
    replay, and losses and weights equal "ddp" bit for bit."""

    class Manual(GPTLightningModule):
        def __init__(self):
            super().__init__(n_layer=2, d_model=32, n_head=2, block_size=16)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = super().training_step(batch, batch_idx)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return loss

    def fit(strategy):
        torch.manual_seed(0)
        model = Manual()
        trainer = make_trainer(strategy, 6)
        trainer.fit(model, datamodule=TextDataModule(block_size=16, batch_size=2, max_bytes=50_000))
        return model, trainer

    ref, _ = fit("ddp")
    got, trainer = fit("cudagraph_ddp")
    assert trainer.strategy.last_graph_stats.forward_replays > 0
    for (name, p), q in zip(ref.named_parameters(), got.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_process_checkpoint_hidden_parameter_parity(tmp_path):
    """Megatron-LM PR #6373's model (a Linear used only inside CheckpointWithoutOutput), graphed, gloo with 2
    processes, 10 steps: losses and weights equal Lightning "ddp" (which runs the same recomputation
    eagerly), and no bucket is left waiting (the run ends, well inside its timeout)."""
    common = ["--model", "seed", "--devices", "2", "--steps", "10", "--backend", "eager", "--warmup-steps", "1"]
    ref = train_subprocess(str(tmp_path / "ddp.pt"), "--strategy", "ddp", *common, timeout=200)
    cg = train_subprocess(str(tmp_path / "cg.pt"), "--strategy", "cudagraph_ddp", "--whole-step", "false", *common,
                          timeout=200)
    assert cg["stats"]["captured_runners"] == 2
    assert cg["stats"]["forward_replays"] == 2 * 9
    assert len(cg["losses"]) == len(ref["losses"]) == 10
    assert max_rel_diff(cg["losses"], ref["losses"]) < 1e-5
    assert state_rel_diff(cg["state"], ref["state"]) < 1e-5


def _counts_of(result, prefix):
    return [{k: v for k, v in c.items() if k.startswith(prefix)} for c in result["ready_counts"]]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_two_process_tied_weights_with_accumulation(tmp_path):
    """Tied embedding/output weight, loss under recomputation, accumulate_grad_batches=4, gloo, 2 processes:
    losses and weights equal "ddp" within 1e-5; the tied weight reports ready twice in every iteration
    (outer backward through the embedding + the loss's nested backward through the head), eager and
    replayed alike.

    The "ddp" reference runs the same model without the loss recomputation (recomputation changes no
    value): torch DDP refuses a parameter finalized in two backward passes per iteration ("marked ready
    twice") unless static_graph=True, and static_graph=True fails with no_sync (accumulation) on torch
    2.13 ("expect_autograd_hooks_ INTERNAL ASSERT"). Without biases: the key projection's bias has a zero
    true gradient (softmax ignores a per-query constant), so AdamW turns the rounding noise of a different
    summation order (recomputed or not) into 1e-4 relative weight differences even in plain PyTorch.
    """
    common = ["--devices", "2", "--steps", "6", "--accumulate", "4", "--backend", "eager", "--tie-weights",
              "--warmup-steps", "2", "--no-bias"]
    ref = train_subprocess(str(tmp_path / "ddp.pt"), "--strategy", "ddp", *common)
    cg = train_subprocess(str(tmp_path / "cg.pt"), "--strategy", "cudagraph_ddp", "--recompute-loss", *common)
    assert len(cg["losses"]) == len(ref["losses"]) == 24
    assert max_rel_diff(cg["losses"], ref["losses"]) < 1e-5
    assert state_rel_diff(cg["state"], ref["state"]) < 1e-5
    assert cg["stats"]["captured_runners"] == 2
    assert cg["stats"]["forward_replays"] == 2 * 4 * (6 - 2)
    assert len(cg["ready_counts"]) == 6
    assert [c["model.tok_emb.weight"] for c in cg["ready_counts"]] == [2] * 6
    assert "model.lm_head.weight" not in cg["ready_counts"][0]  # one parameter, one name
    assert all(v == 1 for c in _counts_of(cg, "model.blocks.") for v in c.values())


def test_tied_weight_without_recomputation_reports_once():
    """Both uses of a tied weight in one backward pass are summed before its AccumulateGrad node runs, so
    it reports ready once per iteration, in eager and replayed iterations; parity with "ddp"."""
    ref_model, ref, _ = train_in_process("ddp", steps=6, model_kwargs={"tie_weights": True})
    model, rec, _ = train_in_process(cg_strategy(), steps=6, model_kwargs={"tie_weights": True})
    counts = [c["model.tok_emb.weight"] for c in rec.ready_counts]
    assert counts == [1] * 6
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_two_process_block_applied_twice(tmp_path):
    """Block 0 applied twice per step (block_schedule 0,0,1) with per-block recomputation, gloo, 2
    processes: parity with "ddp"; block 0's weights report ready twice per iteration (one nested backward
    per application), block 1's once, eager and replayed."""
    common = ["--devices", "2", "--steps", "10", "--backend", "eager", "--block-schedule", "0,0,1",
              "--recompute-blocks", "--warmup-steps", "2"]
    ref = train_subprocess(str(tmp_path / "ddp.pt"), "--strategy", "ddp_static", *common)
    cg = train_subprocess(str(tmp_path / "cg.pt"), "--strategy", "cudagraph_ddp", "--whole-step", "false", *common)
    assert max_rel_diff(cg["losses"], ref["losses"]) < 1e-5
    assert state_rel_diff(cg["state"], ref["state"]) < 1e-5
    assert cg["stats"]["captured_runners"] == 3
    assert cg["stats"]["forward_replays"] == 3 * (10 - 2)
    for c in cg["ready_counts"]:
        assert c["model.blocks.0.fc_in.weight"] == 2 and c["model.blocks.0.ln1.bias"] == 2
        assert c["model.blocks.1.fc_in.weight"] == 1


def test_python_options_errors_name_the_key_and_suggest():
    """The Python API checks option dicts as the command line does: an unknown key names the closest field and
    lists them all; ``layers`` given as one string (which would graph one module per character) is refused with
    the list written out; a value of the wrong type names the option and the value."""
    with pytest.raises(TypeError, match=r"graphs\.segment: unknown key \(did you mean 'segments'\?\); valid keys "
                                        r"under 'graphs': enabled"):
        cg_lightning.CUDAGraphDDPStrategy(graphs={"segment": False})
    with pytest.raises(TypeError, match=r"ddp\.bucket_size: unknown key \(did you mean 'bucket_size_mb'\?\)"):
        cg_lightning.CUDAGraphDDPStrategy(ddp={"bucket_size": 4})
    with pytest.raises(TypeError, match=r"graphs\.layers: expected list of str or null, got 'blocks\.\*' "
                                        r"\(a single item is written as a list: \['blocks\.\*'\]\)"):
        cg_lightning.CUDAGraphDDPStrategy(graphs={"layers": "blocks.*"})
    with pytest.raises(TypeError, match=r"^graphs\.warmup_steps: expected int, got 'two'$"):
        cg_lightning.CUDAGraphDDPStrategy(graphs={"warmup_steps": "two"})


@pytest.mark.parametrize("segments", [True, False])
def test_block_applied_several_times_with_accumulation_is_bit_exact(segments):
    """Blocks applied several times per step (block_schedule 0,1,0,1,0: block 0 three times) with
    accumulate_grad_batches=2: every graphed call's share of a block's gradient is summed by autograd first, in
    the order eager backward delivers them, and then added into the non-zero main_grad once, ``main + (c + b + a)``
    as in eager training (a graph adding its own share into main_grad gave other float32 rounding: 1.9e-6 apart
    in a bias after 6 steps). Losses and weights equal to "ddp" bit for bit, with and without segments."""
    kw = dict(steps=6, accumulate=2, model_kwargs={"block_schedule": [0, 1, 0, 1, 0]})
    ref_model, ref, _ = train_in_process("ddp", **kw)
    model, rec, trainer = train_in_process(cg_strategy(segments=segments), **kw)
    assert trainer.strategy.last_graph_stats.forward_replays > 0
    assert rec.losses == ref.losses
    for (name, a), (_, b) in zip(model.state_dict().items(), ref_model.state_dict().items()):
        assert torch.equal(a, b), name


def _overrides(cls, base):
    """``(name, function)`` of every method ``cls`` or a class between it and ``base`` (the shared body)
    defines that ``base`` also has (constructor aside)."""
    out = []
    for klass in cls.__mro__[:cls.__mro__.index(base)]:
        for name, value in vars(klass).items():
            if name == "__init__" or not hasattr(base, name):
                continue
            func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            if callable(func):
                out.append((name, func))
    return out


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_overridden_lightning_hooks_are_public_and_marked(package):
    """The strategy overrides public Lightning hooks only (a private one can change in any Lightning release
    without notice), each marked ``@override``; in both Lightning packages."""
    ddp_strategy = pytest.importorskip(f"{package}.strategies").DDPStrategy
    module = "cg_lightning.trainer.strategy" if package == "lightning.pytorch" else "cg_lightning.trainer.pytorch_lightning"
    cls = __import__(module, fromlist=["CUDAGraphDDPStrategy"]).CUDAGraphDDPStrategy

    overridden = _overrides(cls, ddp_strategy)
    assert {"configure_ddp", "backward", "training_step", "optimizer_step", "teardown"} <= {n for n, _ in overridden}
    for name, func in overridden:
        assert not name.startswith("_"), f"CUDAGraphDDPStrategy overrides Lightning's private {name}"
        assert getattr(func, "__override__", False), f"CUDAGraphDDPStrategy.{name} lacks @override"


class _HookOrder(Callback):
    """Records, per backward, the Lightning hooks and the lifecycle driver's backward events in the order they
    run, with whether ``param.grad`` was set at each."""

    def __init__(self) -> None:
        self.events = []

    def _grad_set(self, pl_module) -> bool:
        return all(p.grad is not None for p in pl_module.parameters())

    def on_train_start(self, trainer, pl_module) -> None:
        driver = trainer.strategy.driver
        for name in ("before_backward", "after_backward"):
            inner = getattr(driver, name)

            def spy(*args, _inner=inner, _name=name, **kwargs):
                out = _inner(*args, **kwargs)
                self.events.append((_name, self._grad_set(pl_module)))
                return out

            setattr(driver, name, spy)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.events.append(("on_before_backward", self._grad_set(pl_module)))

    def on_after_backward(self, trainer, pl_module) -> None:
        self.events.append(("on_after_backward", self._grad_set(pl_module)))


def test_backward_is_lightnings_with_the_driver_around_autograd():
    """``CUDAGraphDDPStrategy.backward`` runs Lightning's own ``Strategy.backward`` (no copy of it): the driver's
    ``before_backward`` comes after ``on_before_backward`` (which sees the sum so far on the second micro-batch
    of a window) and drops ``param.grad``; ``after_backward`` comes before ``on_after_backward`` and exposes the
    gradients. The precision plugin is left as it was."""
    order = _HookOrder()
    trainer = make_trainer(cg_strategy(warmup_steps=1), 3, [order], accumulate_grad_batches=2)
    trainer.fit(GPTLightningModule(n_layer=1, d_model=32, n_head=2, block_size=16),
                datamodule=TextDataModule(block_size=16, batch_size=2, max_bytes=50_000))
    window = [("on_before_backward", False), ("before_backward", False), ("after_backward", True),
              ("on_after_backward", True),
              ("on_before_backward", True), ("before_backward", False), ("after_backward", True),
              ("on_after_backward", True)]
    assert order.events == window * 3
    assert "backward" not in trainer.precision_plugin.__dict__



def test_gan_passes_replay_their_own_graph_sets():
    """A GAN trained by hand with ``toggle_optimizer`` (the generator pass runs the discriminator frozen, the
    discriminator pass runs it twice, trainable): each pass is a micro-batch whose calls replay a graph set
    captured for its kind, nothing falls back to eager, and the weights equal
    "ddp_find_unused_parameters_true" bit for bit."""
    from lightning.pytorch import Trainer, seed_everything
    from torch.utils.data import DataLoader

    from tests.lightning_manual_models import GANModel
    from tests.lightning_models import dataset

    def fit(strategy):
        seed_everything(0)
        model = GANModel()
        trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, DataLoader(dataset(), batch_size=8))
        return model, trainer

    ref, _ = fit("ddp_find_unused_parameters_true")
    got, trainer = fit("cudagraph_ddp_find_unused_parameters_true")
    stats = trainer.strategy.last_graph_stats
    assert stats.graph_sets == 2 and stats.fallback_calls == 0 and stats.forward_replays > 0, vars(stats)
    for (name, p), q in zip(ref.named_parameters(), got.parameters()):
        assert torch.equal(p, q), name


def test_the_callbacks_and_the_command_line_mark_their_lightning_overrides():
    """``GraphMonitor``, ``CUDAGraphCallback`` and the command line's ``LightningCLI`` and callback mark every method
    they override with ``@override`` (a renamed Lightning hook is then a type checker's error, not a silent no-op)."""
    from lightning.pytorch import Callback
    from lightning.pytorch.cli import LightningCLI

    from cg_lightning.callbacks import CUDAGraphCallback, GraphMonitor
    from cg_lightning.cli.app import CGLightningCLI, _FirstBatch

    checked = 0
    for cls, base in ((GraphMonitor, Callback), (CUDAGraphCallback, Callback), (_FirstBatch, Callback),
                      (CGLightningCLI, LightningCLI)):
        for name, func in _overrides(cls, base):
            assert getattr(func, "__override__", False), f"{cls.__name__}.{name} lacks @override"
            checked += 1
    assert checked >= 15, checked
