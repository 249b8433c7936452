"""Graph sets: shape policies (eager / error / recapture), the bounded set cache, capture-error fallback.

Numerical references are eager training of the same model on the same data: Lightning's "ddp" for the
Trainer runs (1e-5 on losses), plain PyTorch for the engine-level runs (1e-6 on gradients).
"""

import warnings

import pytest
import torch

from cg_lightning.graphs import GraphCaptureError, GraphSignatureError, LayerGraphRunner
from tests import engine_models as em
from tests.engine_models import BACKENDS, graphed_engine
from tests.helpers import cg_strategy, max_rel_diff, train_in_process

# 400 bytes of text, block_size 32, batch_size 4: 10 training windows per epoch -> batches of 4, 4, 2
SMALL_LAST = {"max_bytes": 400, "drop_last": False}
STEPS = 9  # three epochs: batch sizes 4 4 2 | 4 4 2 | 4 4 2


def _strategy(**graphs):
    """Per-layer graphs (what these tests count), one warmup step unless ``graphs`` says otherwise."""
    return cg_strategy(**{"warmup_steps": 1, "whole_step": False, **graphs})


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


def test_shape_policy_error_names_the_argument(monkeypatch):
    # the strategy refuses this data before training (tests/test_setup_checks.py); here the error it prevents
    monkeypatch.setattr("cg_lightning.trainer.strategy.check_train_data", lambda strategy, trainer: None)
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


@pytest.mark.parametrize("backend,device", BACKENDS)
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
    manager, engine = graphed_engine(model, device, backend=backend, shape_policy="recapture", max_graph_sets=2)
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
class Cache:
    """A mutable object a layer hands out (as a key/value cache is): no constant a replay could return."""


class TupleLayer(torch.nn.Module):
    """A residual MLP; ``tagged`` makes it also return a :class:`Cache`, which graph capture refuses."""

    def __init__(self, d, tagged=False):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.tagged = tagged
        self.cache = Cache()

    def forward(self, x):
        y = x + torch.tanh(self.fc(x))
        return (y, self.cache) if self.tagged else y


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
    manager, engine = graphed_engine(model, layers=["layers.*"], on_capture_error=on_capture_error)
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
    pytest.param(1, None, r"returns a Cache at output\[1\]", id="non-constant-output-at-warmup"),
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
    """The error that did not name the layer is raised naming it, itself: not a copy chained to the original."""
    if fixture:
        request.getfixturevalue(fixture)
    with pytest.raises(GraphCaptureError, match=rf"'layers\.1'.*{cause}") as info:
        _train_three("raise", tagged)
    assert not isinstance(info.value.__cause__, GraphCaptureError)
    assert not isinstance(info.value.__context__, GraphCaptureError)
