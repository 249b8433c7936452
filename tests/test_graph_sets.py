"""Shape policies (eager / error / recapture), capture-error fallback, CUDAGraphCallback and GraphMonitor.

Numerical references are eager training of the same model on the same data: Lightning's "ddp" for the
Trainer runs (1e-5 on losses), plain PyTorch for the engine-level runs (1e-6 on gradients).
"""

import csv
import glob
import warnings

import pytest
import torch

import cg_lightning
from cg_lightning.callbacks import CUDAGraphCallback, GraphMonitor
from cg_lightning.callbacks.monitor import graph_state
from cg_lightning.ddp import DataParallelEngine, DDPOptions
from cg_lightning.graphs import GraphCaptureError, GraphManager, GraphOptions, GraphSignatureError, LayerGraphRunner
from tests import engine_models as em
from tests.helpers import max_rel_diff, train_in_process

# 400 bytes of text, block_size 32, batch_size 4: 10 training windows per epoch -> batches of 4, 4, 2
SMALL_LAST = {"max_bytes": 400, "drop_last": False}
STEPS = 9  # three epochs: batch sizes 4 4 2 | 4 4 2 | 4 4 2


def _strategy(**graphs):
    return cg_lightning.CUDAGraphDDPStrategy(graphs={"warmup_steps": 1, "backend": "eager", **graphs})


@pytest.fixture(scope="module")
def ddp_losses():
    _, rec, _ = train_in_process("ddp", steps=STEPS, data_kwargs=SMALL_LAST, record_batches=True)
    assert [len(b[0]) for b in rec.batches] == [4, 4, 2] * 3  # the data really has a smaller last batch
    return rec.losses


def test_shape_policy_eager_smaller_last_batch_through_strategy(ddp_losses):
    strategy = _strategy(shape_policy="eager")
    with pytest.warns(UserWarning, match=r"model\.blocks\.0.*captured Tensor\[4, 32, 64\].*got Tensor\[2, 32, 64\]"):
        _, rec, _ = train_in_process(strategy, steps=STEPS, data_kwargs=SMALL_LAST)
    stats = strategy.last_graph_stats
    assert max_rel_diff(rec.losses, ddp_losses) < 1e-5
    assert stats.graph_sets == 1 and stats.captures == 1 and stats.captured_runners == 2
    assert stats.fallback_calls == 2 * 3  # both blocks in each of the three smaller batches
    assert stats.forward_replays == 2 * 5  # the full batches after step 0: steps 1, 3, 4, 6, 7


def test_shape_policy_recapture_captures_a_second_graph_set(ddp_losses):
    strategy = _strategy(shape_policy="recapture")
    _, rec, _ = train_in_process(strategy, steps=STEPS, data_kwargs=SMALL_LAST)
    stats = strategy.last_graph_stats
    assert max_rel_diff(rec.losses, ddp_losses) < 1e-5
    # set 1 (batch 4) captured at step 1; step 2 (batch 2) runs eagerly and is recorded; step 5 captures set 2
    assert stats.graph_sets == 2 and stats.captures == 2
    assert stats.captured_runners == 2 * 2
    assert stats.fallback_calls == 2  # only the recorded step 2
    assert stats.forward_replays == 2 * 7  # every step but 0 (warmup) and 2 (recorded)


def test_shape_policy_error_names_the_argument():
    strategy = _strategy(shape_policy="error")
    with pytest.raises(GraphSignatureError, match=r"'model\.blocks\.0'.*\n  args\[0\]: captured Tensor\[4, 32, 64\] "
                                                  r"float32 on cpu, requires_grad, got Tensor\[2, 32, 64\]"):
        train_in_process(strategy, steps=STEPS, data_kwargs=SMALL_LAST)


def test_another_memory_layout_is_another_signature():
    """A call with the captured shape but other strides (a transposed view) does not replay the graph: the
    kernels were chosen for the captured layout (eager ran them on that layout, 6e-8 off). Size-1
    dimensions do not count. The message names the strides."""
    from cg_lightning.graphs.signature import CallSignature

    x = torch.randn(8, 4).t()  # [4, 8], strides (1, 4)
    sig = CallSignature((x,), {})
    assert sig.matches((x.clone(),), {})  # clone keeps the layout
    assert not sig.matches((x.contiguous(),), {})
    assert sig.mismatches((x.contiguous(),), {}) == [
        "args[0]: another memory layout, same Tensor[4, 8] float32 on cpu: captured strides [1, 4], got [8, 1] "
        "(dims longer than 1); pass the same view every step, e.g. .contiguous()"]
    assert CallSignature((x,), {}).mismatches((x[:2],), {}) == [  # other shape: the plain form
        "args[0]: captured Tensor[4, 8] float32 on cpu, strides [1, 4], got Tensor[2, 8] float32 on cpu, strides [1, 4]"]
    one = CallSignature((torch.randn(1, 8),), {})  # strides (8, 1)
    assert one.matches((torch.randn(8, 1).t(),), {})  # strides (1, 1): only the size-1 dimension differs
    assert not one.matches((torch.randn(8, 2)[:, 0].unsqueeze(0),), {})  # stride 2 along the length-8 dim


@pytest.mark.parametrize("backend,device", [
    pytest.param("eager", "cpu", id="eager-cpu"),
    pytest.param("cuda", "cuda", id="cuda", marks=pytest.mark.cuda),
])
def test_recapture_cache_is_bounded(backend, device):
    """max_graph_sets=2 with batch sizes 8, 5 and 3: two sets sharing one pool; steps of batch 3 run
    eagerly, warned once; main_grad equals the eager gradient at every step, also when the sets alternate."""
    sizes = [8, 8, 5, 5, 3, 8, 5, 3, 3]
    g = torch.Generator().manual_seed(2)
    data = [torch.randn(b, 16, generator=g).to(device) for b in sizes]
    torch.manual_seed(0)
    ref_model = em.Stack(em.SeedLayer, 16, 2, recompute=False).to(device)
    torch.manual_seed(0)
    model = em.Stack(em.SeedLayer, 16, 2, recompute=True).to(device)
    options = GraphOptions(warmup_steps=1, backend=backend, shape_policy="recapture", max_graph_sets=2)
    manager = GraphManager(model, options, torch.device(device))
    engine = DataParallelEngine(model, DDPOptions(), grad_accumulator_stream=getattr(manager.backend, "stream", None))
    manager.bind_grad_ready(engine.grad_ready)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, x in enumerate(data):
            ref_model.zero_grad(set_to_none=True)
            ref_model(x).backward()
            manager.begin_step(step)
            engine(x).backward()
            manager.end_step()
            engine.finish_grad_sync()
            for (name, p), r in zip(model.named_parameters(), ref_model.parameters()):
                torch.testing.assert_close(p.main_grad, r.grad, rtol=1e-6, atol=1e-6, msg=f"step {step}: {name}")
            with torch.no_grad():
                for p, r in zip(model.parameters(), ref_model.parameters()):
                    p -= 0.05 * p.main_grad
                    r -= 0.05 * r.grad
            engine.zero_grad_buffer()
    full = [w for w in caught if "max_graph_sets=2" in str(w.message)]
    assert len(full) == 1 and "Tensor[3, 16]" in str(full[0].message)
    assert manager.stats.graph_sets == 2 and manager.stats.captured_runners == 4
    assert len(manager.signatures()) == 2 and "Tensor[8, 16]" in manager.signatures()[0]
    assert (manager.stats.pool_bytes > 0) == (backend == "cuda")  # memory_allocated delta at capture; 0 on CPU
    # replayed: steps 1, 5 (batch 8), 3, 6 (batch 5); eager: 0 (warmup), 2 (recorded), 4, 7, 8 (cache full)
    assert manager.stats.forward_replays == 2 * 4
    assert manager.stats.fallback_calls == 2 * 4


# ----------------------------------------------------------------- capture errors
class TupleLayer(torch.nn.Module):
    """A residual MLP; ``tagged`` makes it also return an int, which graph capture refuses."""

    def __init__(self, d, tagged=False):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.tagged = tagged

    def forward(self, x):
        y = x + torch.tanh(self.fc(x))
        return (y, 1) if self.tagged else y


class ThreeLayers(torch.nn.Module):
    def __init__(self, d=16, tagged=1):
        super().__init__()
        self.layers = torch.nn.ModuleList([TupleLayer(d, tagged=(i == tagged)) for i in range(3)])
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.layers:
            out = layer(x)
            x = out[0] if isinstance(out, tuple) else out
        return self.head(x).pow(2).mean()


def _train_three(on_capture_error, tagged, steps=4):
    """Engine + manager on ThreeLayers; returns per-step main_grads, eager per-step grads, manager, model."""
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(8, 16, generator=g) for _ in range(steps)]
    torch.manual_seed(0)
    ref = ThreeLayers(tagged=tagged)
    torch.manual_seed(0)
    model = ThreeLayers(tagged=tagged)
    options = GraphOptions(warmup_steps=1, backend="eager", layers=["layers.*"], on_capture_error=on_capture_error)
    manager = GraphManager(model, options, torch.device("cpu"))
    engine = DataParallelEngine(model, DDPOptions())
    manager.bind_grad_ready(engine.grad_ready)
    got, want = [], []
    for step, x in enumerate(data):
        ref.zero_grad(set_to_none=True)
        ref(x).backward()
        want.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        manager.begin_step(step)
        engine(x).backward()
        manager.end_step()
        engine.finish_grad_sync()
        got.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p, r in zip(model.parameters(), ref.parameters()):
                p -= 0.05 * p.main_grad
                r -= 0.05 * r.grad
        engine.zero_grad_buffer()
    return got, want, manager, model


@pytest.fixture
def failing_backward(monkeypatch):
    """Capture of layers.1's backward raises GraphCaptureError (after every forward was captured); the
    message does not name the layer, so the manager must."""
    original = LayerGraphRunner.capture_backward

    def capture_backward(self):
        if self.name == "layers.1":
            raise GraphCaptureError("simulated host synchronization")
        return original(self)

    monkeypatch.setattr(LayerGraphRunner, "capture_backward", capture_backward)


CAUSES = [
    pytest.param(1, None, r"non-tensor outputs \(int\)", id="non-tensor-output-at-warmup"),
    pytest.param(None, "failing_backward", "simulated host synchronization", id="backward-capture"),
]


@pytest.mark.parametrize("tagged,fixture,cause", CAUSES)
def test_capture_error_eager_fallback_keeps_other_layers_graphed(request, tagged, fixture, cause):
    if fixture:
        request.getfixturevalue(fixture)
    with pytest.warns(UserWarning, match=rf"layer 'layers\.1' could not be captured and runs eagerly.*{cause}") as rec:
        got, want, manager, model = _train_three("eager", tagged)
    assert sum("could not be captured" in str(w.message) for w in rec) == 1  # one warning only
    stats = manager.stats
    assert stats.failed_layers == ["layers.1"]
    assert {r.module for r in manager.all_runners()} == {model.layers[0], model.layers[2]}
    assert stats.captured_runners == 2 and stats.captures == 1
    assert stats.forward_replays == 2 * 3  # layers 0 and 2 replay in steps 1..3
    for step, (g, w) in enumerate(zip(got, want)):
        for name in w:
            torch.testing.assert_close(g[name], w[name], rtol=1e-6, atol=1e-6, msg=f"step {step}: {name}")


@pytest.mark.parametrize("tagged,fixture,cause", CAUSES)
def test_capture_error_raise_names_the_layer(request, tagged, fixture, cause):
    if fixture:
        request.getfixturevalue(fixture)
    with pytest.raises(GraphCaptureError, match=rf"'layers\.1'.*{cause}"):
        _train_three("raise", tagged)


# ----------------------------------------------------------------- callbacks
def test_callback_overrides_strategy_warmup_steps():
    strategy = _strategy(warmup_steps=3)
    _fit_with(strategy, [], steps=6)
    assert strategy.last_graph_stats.forward_replays == 2 * (6 - 3)
    strategy = _strategy(warmup_steps=3)
    _fit_with(strategy, [CUDAGraphCallback(warmup_steps=1, shape_policy="recapture")], steps=6)
    assert strategy.graph_options.warmup_steps == 1 and strategy.graph_options.shape_policy == "recapture"
    assert strategy.last_graph_stats.forward_replays == 2 * (6 - 1)
    with pytest.raises(ValueError, match="shape_policy"):
        CUDAGraphCallback(shape_policy="sometimes")


def _fit_with(strategy, callbacks, steps, ckpt_path=None, root=None, logger=False, progress=False):
    from lightning.pytorch import Trainer, seed_everything

    from examples.data import TextDataModule
    from examples.gpt import GPTLightningModule
    from tests.helpers import GradRecorder

    seed_everything(7, workers=True)
    model = GPTLightningModule(n_layer=2, d_model=64, n_head=4, block_size=32, lr=3e-3)
    rec = GradRecorder()
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=logger,
        enable_checkpointing=any(type(c).__name__ == "ModelCheckpoint" for c in callbacks),
        enable_progress_bar=progress, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[rec, *callbacks], default_root_dir=root, log_every_n_steps=1,
    )
    trainer.fit(model, datamodule=TextDataModule(block_size=32, batch_size=4, max_bytes=2000), ckpt_path=ckpt_path)
    return model, rec, trainer


def test_callback_state_round_trips_and_resume_recaptures(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    strategy = _strategy(warmup_steps=3)
    first = CUDAGraphCallback(warmup_steps=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2, save_top_k=-1)
    _fit_with(strategy, [first, ckpt], steps=4, root=tmp_path)
    assert strategy.last_graph_stats.captures == 1
    assert strategy.last_graph_stats.forward_replays == 2 * (4 - 1)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"]["CUDAGraphCallback"]
    assert saved["captures"] == 1
    assert saved["options"]["warmup_steps"] == 1 and saved["options"]["shape_policy"] == "eager"
    assert len(saved["signatures"]) == 1 and "Tensor[4, 32, 64]" in saved["signatures"][0]

    # resume with a callback given no arguments: the saved schedule (warmup 1) beats the strategy's 3
    strategy = _strategy(warmup_steps=3)
    resumed = CUDAGraphCallback()
    _, rec, trainer = _fit_with(strategy, [resumed], steps=8, ckpt_path=str(tmp_path / "last.ckpt"), root=tmp_path)
    assert trainer.global_step == 8 and len(rec.losses) == 4
    assert strategy.graph_options.warmup_steps == 1
    stats = strategy.last_graph_stats
    assert stats.captures == 1  # captured again after the resume ...
    assert stats.forward_replays == 2 * (8 - 5)  # ... at step 5: one warmup step counted from step 4
    assert resumed.captures == 2 and resumed.state_dict()["captures"] == 2
    assert resumed.signatures == saved["signatures"]


def test_graph_monitor_metrics_and_progress_bar(tmp_path):
    from lightning.pytorch import Callback
    from lightning.pytorch.loggers import CSVLogger

    class BarProbe(Callback):
        def __init__(self):
            self.states, self.bar = [], None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.bar = trainer.progress_bar_callback
            self.states.append(self.bar.get_metrics(trainer, pl_module).get("graphs"))

    strategy = _strategy(warmup_steps=2)
    probe = BarProbe()
    _fit_with(strategy, [GraphMonitor(log_every_n_steps=2), probe], steps=8, logger=CSVLogger(tmp_path),
              progress=True)
    rows = list(csv.DictReader(open(glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)[0])))
    logged = [r for r in rows if r.get("graphs/captured")]
    assert logged, rows[:3]
    last = logged[-1]
    for key in ("graphs/capture_s", "graphs/replays_per_step", "graphs/step_time_ms", "graphs/pool_bytes",
                "graphs/sets", "graphs/eager_fallbacks"):
        assert last.get(key) not in (None, ""), key
    assert float(last["graphs/captured"]) == 2.0 and float(last["graphs/replays_per_step"]) == 2.0
    assert float(last["graphs/capture_s"]) > 0 and float(last["graphs/step_time_ms"]) > 0
    assert float(last["graphs/pool_bytes"]) == 0.0  # CPU: no device memory
    assert probe.states[0] == "eager" and probe.states[-1] == "captured 2"
    assert "get_metrics" not in probe.bar.__dict__  # the wrapper is removed at teardown


def test_graph_state_text():
    from cg_lightning.graphs import GraphStats

    assert graph_state(GraphStats()) == "eager"
    assert graph_state(GraphStats(captured_runners=4, graph_sets=2, fallback_calls=2)) == "captured 4 in 2 sets, fallback"
    assert graph_state(GraphStats(captured_runners=2, failed_layers=["layers.1"])) == "captured 2, fallback"
