"""Engine-level tests (no Lightning): graphed layers + DataParallelEngine against eager PyTorch.

Every case trains the same model with the same data twice: eagerly without recomputation (plain
``param.grad``), and with per-layer graphs + the DDP engine (``main_grad``); gradients must agree within
1e-6 at every step. The backend is ``eager`` on CPU and ``cuda`` on a GPU (``cuda`` marker).
"""

import re

import pytest
import torch

from cg_lightning.ddp import DataParallelEngine, DDPOptions, GradSyncError
from tests import engine_models as em
from tests.engine_models import (
    BACKENDS, LR, assert_grads_equal, batches, eager_reference, graph_manager, graphed_engine, graphed_run,
)

LAYERS = [em.SeedLayer, em.InsideOutsideLayer, em.RepeatedNestedLayer, em.TorchReentrantLayer,
          em.CgCheckpointLayer, em.TorchNonReentrantLayer]


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("layer_cls", LAYERS, ids=lambda c: c.__name__)
def test_graphed_main_grad_equals_eager(layer_cls, backend, device):
    ref, _ = eager_reference(layer_cls, device=device)
    got, _, manager, _, _ = graphed_run(layer_cls, backend, device)
    assert manager.stats.captured_runners == 2
    assert manager.stats.forward_replays == 2 * 3  # steps 1..3 replay both layers
    assert_grads_equal(got, ref)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("layer_cls", LAYERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("repeat", [1, 2], ids=["once", "applied-twice"])
def test_ready_counts_equal_eager_every_step(layer_cls, repeat, backend, device):
    """Golden counts from eager training with real recomputation equal the replayed counts at every step,
    also when one graphed layer is applied twice per step (two runners sharing parameters); main_grad
    equals the un-checkpointed eager gradient within 1e-6. Counts are never checked against themselves:
    ``eager`` runs the same engine without graphs."""
    ref, _ = eager_reference(layer_cls, device=device, repeat=repeat)
    _, eager_counts, _, _, _ = graphed_run(layer_cls, backend, device, repeat=repeat, graphs=False)
    got, counts, manager, _, _ = graphed_run(layer_cls, backend, device, repeat=repeat)
    assert manager.stats.captured_runners == 2 * repeat
    assert manager.stats.forward_replays == 2 * repeat * 3
    assert_grads_equal(got, ref)
    for step, (c, e) in enumerate(zip(counts, eager_counts)):
        assert c == e, f"step {step}: graphed counts {c} != eager counts {e}"
    assert counts[0] == counts[-1]


def test_applied_twice_counts_are_two_when_recomputed():
    """Each application of a reentrant-checkpointed block runs its own nested backward in eager mode, so
    the block's weights report ready twice per step; replays must report them twice too."""
    _, counts, _, _, _ = graphed_run(em.CgCheckpointLayer, "eager", "cpu", repeat=2)
    assert all(c["layers.0.fc1.weight"] == 2 for c in counts)
    _, counts, _, _, _ = graphed_run(em.SeedLayer, "eager", "cpu", repeat=2)
    assert all(c["layers.0.checkpointed.weight"] == 2 and c["layers.0.projection.weight"] == 1 for c in counts)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_hidden_parameter_is_discovered_and_ordered(backend, device):
    _, _, manager, _, model = graphed_run(em.SeedLayer, backend, device, steps=2)
    for (key, index), runner in manager.runners.items():
        layer = runner.module
        assert [id(p) for p in runner.params_to_backprop] == [id(p) for p in layer.parameters()]
        assert {id(p) for p in runner.hidden_params} == {id(layer.checkpointed.weight), id(layer.checkpointed.bias)}


def test_warmup_steps_zero_still_discovers_hidden_parameter():
    ref, _ = eager_reference(em.SeedLayer)
    got, _, manager, _, _ = graphed_run(em.SeedLayer, "eager", "cpu", warmup_steps=0)
    runner = next(iter(manager.runners.values()))
    assert runner.hidden_params
    assert_grads_equal(got, ref)


def test_inside_outside_weight_counts_twice_and_sums_once():
    """A weight used inside and outside the recomputation: main_grad is the eager sum of both uses, and it
    reports ready twice per step (outer backward + nested backward), eager and replayed alike."""
    ref, _ = eager_reference(em.InsideOutsideLayer)
    got, counts, _, _, _ = graphed_run(em.InsideOutsideLayer, "eager", "cpu")
    assert_grads_equal(got, ref)
    for step_counts in counts:
        assert step_counts["layers.0.shared.weight"] == 2


def test_repeated_occurrences_recorded_in_order_and_replayed():
    """Nested backwards finalize [a, b, a]: capture records that list; each replay reports a twice, b once."""
    _, counts, manager, engine, model = graphed_run(em.RepeatedNestedLayer, "eager", "cpu")
    layer = model.layers[1]
    runner = next(r for r in manager.runners.values() if r.module is layer)
    assert [id(p) for p in runner.recorded_occurrences] == [id(layer.a.weight), id(layer.b.weight), id(layer.a.weight)]
    # a and b are used only inside recomputation: no autograd edge, every occurrence comes from the plan
    assert not runner.edge_params or all(p is not layer.a.weight and p is not layer.b.weight for p in runner.edge_params)
    reporter = engine.grad_ready.notifier
    assert runner.replay_plan == [reporter(layer.a.weight), reporter(layer.b.weight), reporter(layer.a.weight)]
    for step_counts in counts:  # step 0 eager, steps 1.. replayed
        assert step_counts["layers.1.a.weight"] == 2
        assert step_counts["layers.1.b.weight"] == 1


def test_positional_layout_stable_across_captures():
    _, _, m1, _, _ = graphed_run(em.SeedLayer, "eager", "cpu", steps=2)
    _, _, m2, _, _ = graphed_run(em.SeedLayer, "eager", "cpu", steps=2)
    names1 = [[n for n, _ in r.module.named_parameters() for p in r.params_to_backprop if p is _] for r in m1.runners.values()]
    names2 = [[n for n, _ in r.module.named_parameters() for p in r.params_to_backprop if p is _] for r in m2.runners.values()]
    assert names1 == names2 and names1[0] == ["checkpointed.weight", "checkpointed.bias", "projection.weight", "projection.bias"]


def test_foreign_parameter_not_added_to_layer_inputs():
    """A recomputation that closes over another module's parameter: not in this layer's inputs, and its
    gradient still reaches main_grad exactly (eager parity) with the right ready count."""

    class Foreign(torch.nn.Module):
        def __init__(self, d, recompute=True, shared=None):
            super().__init__()
            self.own = torch.nn.Linear(d, d)
            self.recompute = recompute
            self.shared = [shared]  # not registered: owned by the parent

        def _inner(self, x):
            return torch.tanh(self.shared[0](x))

        def forward(self, x):
            if not self.recompute:
                return self.own(self._inner(x))
            ckpt = em.CheckpointWithoutOutput()
            h = ckpt.checkpoint(self._inner, x)
            out = self.own(h)
            ckpt.discard_output_and_register_recompute(out)
            return out

    class Model(torch.nn.Module):
        def __init__(self, recompute=True):
            super().__init__()
            self.shared = torch.nn.Linear(16, 16)
            self.layers = torch.nn.ModuleList([Foreign(16, recompute, self.shared)])

        def forward(self, x):
            return self.layers[0](x).pow(2).mean()

    def run(graphed):
        torch.manual_seed(0)
        model = Model(recompute=graphed)
        engine = DataParallelEngine(model, DDPOptions())
        manager = graph_manager(model) if graphed else None
        if manager:
            manager.bind_grad_ready(engine.grad_ready)
        out = []
        for step, x in enumerate(batches(3, 16, "cpu")):
            if manager:
                manager.begin_step(step)
            engine(x).backward()
            engine.finish_grad_sync()
            out.append({k: p.main_grad.clone() for k, p in model.named_parameters()})
            engine.zero_grad_buffer()
        return out, manager, model

    ref, _, _ = run(False)
    got, manager, model = run(True)
    runner = next(iter(manager.runners.values()))
    assert all(p is not model.shared.weight and p is not model.shared.bias for p in runner.params_to_backprop)
    assert_grads_equal(got, ref)


def test_shape_policy_eager_and_error():
    torch.manual_seed(0)
    model = em.Stack(em.SeedLayer, 16, 1, recompute=True)
    engine = DataParallelEngine(model, DDPOptions())
    manager = graph_manager(model)
    manager.bind_grad_ready(engine.grad_ready)
    for step in range(2):
        manager.begin_step(step)
        engine(torch.randn(8, 16)).backward()
        engine.finish_grad_sync()
        engine.zero_grad_buffer()
    manager.begin_step(2)
    with pytest.warns(UserWarning, match=r"layers\.0.*args\[0\]: captured Tensor\[8, 16\].*got Tensor\[5, 16\]"):
        engine(torch.randn(5, 16)).backward()
    assert manager.stats.fallback_calls == 1
    engine.finish_grad_sync()
    engine.zero_grad_buffer()
    manager.options.shape_policy = "error"
    manager.begin_step(3)
    from cg_lightning import GraphSignatureError

    with pytest.raises(GraphSignatureError, match=r"args\[0\]: captured Tensor\[8, 16\] float32 on cpu, requires_grad, got Tensor\[3, 16\]"):
        engine(torch.randn(3, 16))


class _SyncLayer(torch.nn.Module):
    """A layer with a host synchronization: a data-dependent branch (bool(tensor) -> .item())."""

    def __init__(self, d: int, recompute: bool = True) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        y = self.lin(x)
        if y.mean() > 0:
            y = y * 2
        return y


class _PrintLayer(_SyncLayer):
    def forward(self, x):
        y = self.lin(x)
        print(y.sum())
        return y


@pytest.mark.parametrize("layer_cls,what", [(_SyncLayer, r"bool\(tensor\)"), (_PrintLayer, "printing a tensor")])
def test_host_sync_inside_a_graphed_layer_is_a_named_error(layer_cls, what):
    """The eager backend refuses what CUDA capture refuses: the error names the layer, the operation and the
    source line."""
    from cg_lightning import GraphCaptureError

    torch.manual_seed(0)
    model = em.Stack(layer_cls, 16, 2)
    manager = graph_manager(model, layers=["layers.*"])
    manager.begin_step(0)
    model(torch.randn(4, 16)).backward()
    manager.begin_step(1)
    with pytest.raises(GraphCaptureError, match=rf"layer 'layers\.0'.*{what}.*test_graph_engine\.py\", line \d+, in forward"):
        model(torch.randn(4, 16))


def test_hooks_on_submodules_are_refused_at_setup():
    from cg_lightning import GraphCaptureError

    model = em.Stack(em.SeedLayer, 16, 1, recompute=False)
    model.layers[0].projection.register_forward_hook(lambda *a: None)
    with pytest.raises(GraphCaptureError, match=r"forward hook on submodule 'projection' would run once at capture"):
        graph_manager(model, layers=["layers.*"])


def test_hooks_added_after_setup_are_refused_at_the_first_warmup_call():
    """Not after the warmup steps: the first recorded call of the layer sees the hook."""
    from cg_lightning import GraphCaptureError

    model = em.Stack(em.SeedLayer, 16, 1, recompute=False)
    manager = graph_manager(model, layers=["layers.*"])
    model.layers[0].projection.register_forward_pre_hook(lambda *a: None)
    manager.begin_step(0)
    with pytest.raises(GraphCaptureError, match=r"forward pre hook on submodule 'projection' would run once"):
        model(torch.randn(4, 16))


def test_hooks_under_on_capture_error_eager_leave_only_that_layer_eager():
    model = em.Stack(em.SeedLayer, 16, 2, recompute=False)
    model.layers[1].projection.register_forward_hook(lambda *a: None)
    with pytest.warns(UserWarning, match=r"layer 'layers\.1' could not be captured and runs eagerly"):
        manager = graph_manager(model, layers=["layers.*"], on_capture_error="eager")
    for step in range(3):
        manager.begin_step(step)
        model(torch.randn(4, 16)).backward()
    assert manager.stats.failed_layers == ["layers.1"] and manager.stats.captured_runners == 1


@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_gradient_hooks_on_parameters_of_a_graphed_layer_are_refused_before_warmup(kind):
    """A gradient hook on a graphed layer's parameter cannot run at replay (the gradient is computed inside the
    graph): refused by name before the warmup passes, instead of the hook receiving None during capture (a
    TypeError inside the user's hook) or silently not firing after capture."""
    from cg_lightning import GraphCaptureError

    model = em.Stack(em.SeedLayer, 16, 1, recompute=False)
    calls = []
    getattr(model.layers[0].projection.weight, kind)(lambda t: calls.append(t is None))
    expected = "gradient hook (register_hook)" if kind == "register_hook" else "post-accumulate-grad hook"
    with pytest.raises(GraphCaptureError, match=rf"{re.escape(expected)} on parameter 'projection.weight' would run "
                                                r"once at capture.*on_before_optimizer_step"):
        graph_manager(model, layers=["layers.*"])
    assert calls == []  # refused at setup: the hook never ran with a None gradient


def test_weight_of_a_graphed_layer_also_used_outside_graphs():
    """A graphed layer's weight that the head uses as well (tied across the graph boundary): main_grad holds
    both contributions, equal to eager within 1e-6, and the weight reports ready once per step."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([em.SeedLayer(16, recompute=False) for _ in range(2)])

        def forward(self, x):
            h = x
            for layer in self.layers:
                h = layer(h)
            return torch.nn.functional.linear(h, self.layers[1].projection.weight).pow(2).mean()

    def run(graphed):
        torch.manual_seed(0)
        model = Model()
        manager, engine = graphed_engine(model, layers=["layers.*"], enabled=graphed)
        grads, counts = [], []
        for step, x in enumerate(batches(4, 16, "cpu")):
            manager.begin_step(step)
            engine(x).backward()
            manager.end_step()
            engine.finish_grad_sync()
            counts.append(engine.last_ready_counts["layers.1.projection.weight"])
            grads.append({k: p.main_grad.clone() for k, p in model.named_parameters()})
            with torch.no_grad():
                for p in model.parameters():
                    p -= LR * p.main_grad
            engine.zero_grad_buffer()
        return grads, counts, manager

    ref, ref_counts, _ = run(False)
    got, counts, manager = run(True)
    assert manager.stats.forward_replays == 2 * 3
    assert_grads_equal(got, ref)
    assert counts == ref_counts == [1] * 4


def _seed_stack_trained(steps: int, recompute: bool, frozen: str = ""):
    """Two graphed :class:`SeedLayer` blocks (eager backend, capture after 1 warmup step) under the DDP engine,
    trained ``steps`` steps; ``frozen``: a submodule of block 1 frozen before training."""
    torch.manual_seed(0)
    model = em.Stack(em.SeedLayer, 16, 2, recompute=recompute)
    if frozen:
        getattr(model.layers[1], frozen).weight.requires_grad_(False)
    manager, engine = graphed_engine(model, layers=["layers.*"])
    for step in range(steps):
        manager.begin_step(step)
        engine(torch.randn(4, 16)).backward()
        engine.finish_grad_sync()
        engine.zero_grad_buffer()
    return model, manager, engine


def test_requires_grad_changed_after_capture_runs_the_layer_eagerly():
    """Unfreezing (or freezing, as ``toggle_optimizer`` does) a graphed layer's parameter after capture: a graph
    would keep the old gradient set, so the call no longer matches its capture and follows ``shape_policy``
    (eager: one warning naming the layer and parameter; the layer's segment runs eagerly with it); the engine
    still refuses a parameter frozen at setup that now requires grad."""
    model, manager, engine = _seed_stack_trained(2, recompute=False, frozen="projection")
    model.layers[1].projection.weight.requires_grad_(True)
    manager.begin_step(2)
    replays = manager.stats.forward_replays
    with pytest.warns(UserWarning, match=r"requires_grad changed since capture for parameter\(s\) \['projection\.weight'\]"):
        out = engine(torch.randn(4, 16))
    assert manager.stats.forward_replays == replays  # layers.0 shares a segment with layers.1: eager too
    manager.remove()
    engine(torch.randn(4, 16)).backward()
    with pytest.raises(GradSyncError, match=r"frozen when training started now require grad \(layers\.1\.projection\.weight\)"):
        engine.finish_grad_sync()


def test_freezing_a_parameter_used_only_in_recomputation_after_capture_runs_the_layer_eagerly():
    """A parameter used only inside a layer's activation recomputation has no autograd edge: its grad-ready
    notifications are replayed and its gradient goes into main_grad inside the graph, so a replay after it was
    frozen would keep moving it. The call runs eagerly instead (one warning naming it); the frozen parameter then
    reports no gradient, which the engine names (it was trainable at setup)."""
    model, manager, engine = _seed_stack_trained(3, recompute=True)
    assert manager.stats.forward_replays > 0
    model.layers[1].checkpointed.weight.requires_grad_(False)
    manager.begin_step(3)
    with pytest.warns(UserWarning, match=r"requires_grad changed since capture for parameter\(s\) \['checkpointed\.weight'\]"):
        out = engine(torch.randn(4, 16))
    out.backward()
    with pytest.raises(GradSyncError, match=r"layers\.1\.checkpointed\.weight \(ready 0 times, expected 1\)"):
        engine.finish_grad_sync()
    manager.remove()


class _PassThrough(torch.nn.Module):
    """Returns (f(x, ctx), ctx): the second output is an input, unchanged (a context threaded through)."""

    def __init__(self, d: int, recompute: bool = True) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x, ctx):
        return self.lin(x) * torch.sigmoid(ctx), ctx


def test_output_that_is_an_input_replays_like_eager():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ctx = torch.nn.Linear(16, 16)
            self.layers = torch.nn.ModuleList([_PassThrough(16) for _ in range(2)])

        def forward(self, x):
            ctx = self.ctx(x)
            h = x
            for layer in self.layers:
                h, ctx = layer(h, ctx)
            return (h * ctx).pow(2).mean()

    def run(graphed):
        torch.manual_seed(0)
        model = Model()
        manager, engine = graphed_engine(model, layers=["layers.*"], enabled=graphed)
        out = []
        for step, x in enumerate(batches(4, 16, "cpu")):
            manager.begin_step(step)
            engine(x).backward()
            manager.end_step()
            engine.finish_grad_sync()
            out.append({k: p.main_grad.clone() for k, p in model.named_parameters()})
            engine.zero_grad_buffer()
        return out, manager

    ref, _ = run(False)
    got, manager = run(True)
    assert manager.stats.forward_replays == 2 * 3
    assert_grads_equal(got, ref)


class _InplaceOnInput(torch.nn.Module):
    def __init__(self, d: int, recompute: bool = True) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        return self.lin(torch.relu_(x))


def test_capture_failure_in_warmup_is_named_and_can_fall_back():
    """A layer that modifies its input in place fails in warmup: a GraphCaptureError naming the layer and
    the cause; with on_capture_error='eager' training goes on eagerly and matches eager."""
    from cg_lightning import GraphCaptureError

    def run(graphed, on_error="raise"):
        torch.manual_seed(0)
        model = em.Stack(_InplaceOnInput, 16, 2)
        manager, engine = graphed_engine(model, layers=["layers.*"], enabled=graphed, on_capture_error=on_error)
        out = []
        for step, x in enumerate(batches(3, 16, "cpu")):
            manager.begin_step(step)
            engine(x).backward()
            engine.finish_grad_sync()
            out.append({k: p.main_grad.clone() for k, p in model.named_parameters()})
            engine.zero_grad_buffer()
        return out

    with pytest.raises(GraphCaptureError, match=r"warmup of layer 'layers\.0'.*modifies one of its inputs in place"):
        run(True)
    with pytest.warns(UserWarning, match=r"layers\.0"):
        got = run(True, "eager")
    assert_grads_equal(got, run(False))


def test_graphed_layer_inside_non_reentrant_checkpoint_is_refused():
    import torch.utils.checkpoint as tcp
    from cg_lightning import GraphCaptureError

    torch.manual_seed(0)
    model = em.Stack(em.SeedLayer, 16, 1, recompute=False)
    manager = graph_manager(model, layers=["layers.*"])

    def loss(x):
        h = tcp.checkpoint(model.layers[0], model.inp(x), use_reentrant=False)
        return model.head(h).pow(2).mean()

    manager.begin_step(0)  # refused at the first warmup call, not after warmup
    with pytest.raises(GraphCaptureError, match=r"saved-tensor hooks.*non-reentrant torch\.utils\.checkpoint"):
        loss(torch.randn(4, 16))


def _train_constants_stack(kinds, steps=4, graphed=True, **graphs):
    """SGD steps of ``ConstantsStack(kinds)``: with ``graphed`` through the DDP engine with ``layers.*`` graphed
    (``main_grad``), else plain PyTorch (``.grad``). Returns (each step's gradients by name, manager or None)."""
    torch.manual_seed(0)
    model = em.ConstantsStack(kinds)
    manager = engine = None
    if graphed:
        manager, engine = graphed_engine(model, layers=["layers.*"], **graphs)
    grads = []
    for step, x in enumerate(batches(steps, 16, "cpu")):
        if manager is None:
            model.zero_grad(set_to_none=True)
            model(x).backward()
            grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        else:
            manager.begin_step(step)
            engine(x).backward()
            manager.end_step()
            engine.finish_grad_sync()
            grads.append({k: p.main_grad.clone() for k, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * (p.grad if manager is None else p.main_grad)
        if engine is not None:
            engine.zero_grad_buffer()
    return grads, manager


CONSTANT_KINDS = ["pair", "triple", "triple", "dict", "plain", "pair"]


@pytest.mark.parametrize("segments", [True, False], ids=["segments", "per-layer"])
def test_outputs_with_none_and_constants_are_graphed_like_eager(segments):
    """Layers returning ``(h, None)``, ``(h, None, bias)`` (the second one handed the first one's bias) and a dict
    with ``None`` and flag leaves are captured, not refused: every replay returns the recorded constants around
    the graph's tensors (the model checks each where it unpacks it), and ``main_grad`` equals plain PyTorch's
    ``.grad`` bit for bit at every step. The ``"plain"`` layer feeds the last ``"pair"`` one: with segments they
    chain, the tuple-returning layer as the segment's last member."""
    ref, _ = _train_constants_stack(CONSTANT_KINDS, graphed=False)
    got, manager = _train_constants_stack(CONSTANT_KINDS, segments=segments)
    stats = manager.stats
    assert stats.captured_runners == len(CONSTANT_KINDS) and not stats.failed_layers
    assert stats.forward_replays == len(CONSTANT_KINDS) * 3 and stats.fallback_calls == 0
    assert stats.segments == (1 if segments else 0)
    if segments:
        members = [r.name for r in manager.all_runners() if r.segment is not None]
        assert members == ["layers.4", "layers.5"], members
    assert_grads_equal(got, ref, tol=0)


@pytest.mark.parametrize("leaf,where", [
    (lambda layer: layer, r"returns a Linear at output\[1\]"),
    (lambda layer: [1, object()], r"returns a object at output\[1\]\[1\]"),
    (lambda layer: {"cache": {1, 2}}, r"returns a set at output\[1\]\['cache'\]"),
])
def test_output_leaf_that_may_change_between_calls_is_refused_naming_it(leaf, where):
    """A leaf that is neither a tensor nor a constant (a module, an arbitrary object, a mutable set) could
    change between calls while a replay returns the captured one: capture fails naming the layer and the leaf's
    place in the output."""
    from cg_lightning import GraphCaptureError

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.fc(x), leaf(self.fc)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer()])

        def forward(self, x):
            return self.layers[0](x)[0].pow(2).mean()

    model = Model()
    manager, engine = graphed_engine(model, layers=["layers.*"])
    with pytest.raises(GraphCaptureError, match=rf"layer 'layers\.0' {where}.*may change between calls"):
        for step, x in enumerate(batches(3, 16, "cpu")):
            manager.begin_step(step)
            engine(x).backward()
            manager.end_step()
            engine.finish_grad_sync()
            engine.zero_grad_buffer()
