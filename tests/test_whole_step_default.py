"""The strategy's default: the whole training step as one graph wherever that is provably safe.

With ``graphs.whole_step`` unset, a step whose Python reads only its batch, submodules and watched values, and
whose host reads are of constants, is captured and replayed (eager backend here: a replay runs the step again), and
trains bit for bit like ``"ddp"``. Anything else gets per-layer graphs, announced in one line, not warned; what a
replay relies on (watched attributes, train/eval modes, ``requires_grad``) is compared before each replay, and a
change hands the rest of the run to per-layer graphs, still equal to ``"ddp"``.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, seed_everything

from tests.helpers import cg_strategy, make_trainer
from tests.lightning_models import Block, ParityModel, loader, make_body
from tests.lightning_runs import assert_same, train

STEPS = 8  # warmup steps 0-1, capture in step 2, replays in steps 3-7


class PlainStep(ParityModel):
    """A training step that reads only its batch and submodules (``ParityModel``'s reads ``batch_idx``)."""

    def __init__(self, scale: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.scale = scale

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y) * self.scale
        self.log("train_loss", loss)
        return loss


def _run(model, strategy, **kwargs):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run = train(strategy, model, max_steps=kwargs.pop("max_steps", STEPS), **kwargs)
    return run, [str(w.message) for w in record if "cg_lightning" in str(w.message)]


class _Adoption(Callback):
    """What the engine's ``main_grad`` adoption looked like at the end of training (kept in a class attribute: the
    run copies its callbacks)."""

    seen: dict = {}
    steps: list = []
    forwards: list = []

    def on_train_start(self, trainer, pl_module) -> None:
        type(self).steps = []
        type(self).forwards = []
        engine = trainer.strategy.engine

        def held(module, args) -> None:  # whether gradient memory sits beside this forward's activations
            mains = [p.main_grad for p in engine.params]
            type(self).forwards.append((trainer.global_step, not all(b.released for b in engine.buffers_)
                                        or any(m.untyped_storage().nbytes() > m.element_size() for m in mains)))

        pl_module.register_forward_pre_hook(held)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        engine = trainer.strategy.engine
        in_buffer = all(p.main_grad.untyped_storage().data_ptr() == engine.buffers_[0].data.untyped_storage().data_ptr()
                        for p in engine.params)
        type(self).steps.append((engine.adoption.transient, engine.adoption.kept, in_buffer,
                                 all(b.released for b in engine.buffers_)))

    def on_train_end(self, trainer, pl_module) -> None:
        engine = trainer.strategy.engine
        type(self).seen = dict(kept=engine.adoption.kept, adopted=len(engine.adoption.mains),
                               params=len(engine.params), released=[b.released for b in engine.buffers_])


@pytest.mark.parametrize("body", ["modulelist", "sequential", "linear"])
def test_a_plain_step_is_replayed_from_one_graph_by_default_and_equals_ddp(body):
    """Replayed from one graph, bit for bit "ddp"; in one process every ``main_grad`` keeps the gradient tensor the
    capture's backward made as its storage (nothing copied) and the buffer's memory is given back. Before the capture
    the buffer is freed as soon as the first step has shown that only the engine's hooks write ``main_grad``: the
    second step's gradients are autograd's own tensors, as under plain PyTorch."""
    ref = train("ddp", lambda: PlainStep(body=body), max_steps=STEPS)
    strategy = cg_strategy()
    got, warned = _run(lambda: PlainStep(body=body), strategy, callbacks=[_Adoption()])
    assert_same(ref.facts(), got.facts())
    stats = strategy.last_step_graph_stats
    assert stats.captures == 1 and stats.replays == STEPS - 3 and stats.refusal is None, stats
    assert stats.fresh_main_grads
    seen = _Adoption.seen
    assert seen["kept"] and seen["adopted"] == seen["params"] and all(seen["released"]), seen
    # (transient, kept, every main_grad in the buffer, the buffer released) before each optimizer step
    assert _Adoption.steps[:3] == [(False, False, True, False), (True, False, False, True), (False, True, False, True)]
    # (step, gradient memory held) at each forward: the first step's proof holds the buffer; from then on the last
    # step's gradients are freed before the forward, the capture's eager run and captured run included
    assert {seen for seen in _Adoption.forwards if seen[0] <= 2} == {(0, True), (1, False), (2, False)}, \
        _Adoption.forwards  # (steps after 2: the eager backend's replays run the step, in the storage kept)
    assert warned == []  # a model without repeated layers ("linear") is graphed whole: nothing to warn about


def test_a_step_that_reads_batch_idx_gets_per_layer_graphs_with_one_line_and_no_warning(caplog):
    ref = train("ddp", ParityModel, max_steps=STEPS)
    strategy = cg_strategy()
    with caplog.at_level(logging.INFO):
        got, warned = _run(ParityModel, strategy)
    assert_same(ref.facts(), got.facts())
    assert strategy.last_step_graph_stats.captures == 0
    assert "reads its argument 'batch_idx'" in strategy.last_step_graph_stats.refusal
    assert strategy.last_graph_stats.captures > 0  # the blocks are graphed instead
    assert warned == []
    lines = [r.getMessage() for r in caplog.records if "not captured as one graph" in r.getMessage()]
    assert len(lines) == 1 and "per-layer graphs instead" in lines[0], lines


def test_a_refused_model_without_layers_to_graph_is_warned_about():
    class Linear(ParityModel):
        def training_step(self, batch, batch_idx):
            return F.mse_loss(self(batch[0]), batch[1]) * (batch_idx + 1)

    strategy = cg_strategy()
    _, warned = _run(lambda: Linear(body="linear"), strategy)
    assert len(warned) == 1 and "graphs.layers" in warned[0], warned


class _SetsScale(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 5:
            pl_module.scale = 0.5


class _Freezes(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 5:
            pl_module.body.blocks[0].requires_grad_(False)


class _DropoutToEval(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 5:
            pl_module.body.blocks[1].drop.eval()


class _AnnealsDropout(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 5:
            pl_module.body.blocks[1].drop.p = 0.05


class _ReplacesDropout(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 5:
            pl_module.body.blocks[1].drop = torch.nn.Identity()


@pytest.mark.parametrize("callback, reason", [
    (_SetsScale, "self.scale: 1.0 -> 0.5 after the step was captured"),
    (_Freezes, "requires_grad changed since capture for parameter(s) ['body.blocks.0.fc.weight', "
               "'body.blocks.0.fc.bias'] (toggle_optimizer or freezing)"),
    (_DropoutToEval, "train/eval mode changed since capture for submodule(s) ['body.blocks.1.drop']"),
    (_AnnealsDropout, "attribute(s) changed since capture, which the captured kernels hold as constants: "
                      "body.blocks.1.drop.p: 0.1 -> 0.05"),
    (_ReplacesDropout, "since capture: submodule(s) ['body.blocks.1.drop'] replaced or removed"),
])
def test_a_change_the_replay_relies_on_hands_the_run_to_per_layer_graphs_and_still_equals_ddp(callback, reason):
    def model():
        return PlainStep(body="modulelist", dropout=0.1)

    ref = train("ddp_find_unused_parameters_true", model, max_steps=STEPS, callbacks=[callback()])
    strategy = cg_strategy(ddp={"find_unused_parameters": True})
    got, _ = _run(model, strategy, callbacks=[callback()])
    assert_same(ref.facts(), got.facts())
    stats = strategy.last_step_graph_stats
    assert stats.captures == 1 and stats.replays == 2 and reason in stats.refusal, stats


def test_a_transformers_llama_step_is_replayed_by_default_with_its_constant_reads_answered():
    hf = pytest.importorskip("tests.hf_models")
    ref, _ = hf.fit_hf("ddp", hf.tiny_llama, steps=STEPS)
    strategy = cg_strategy()
    got, trainer = hf.fit_hf(strategy, hf.tiny_llama, steps=STEPS)
    hf.assert_same_weights(got.model, ref.model)
    stats = strategy.last_step_graph_stats
    assert stats.captures == 1 and stats.replays == STEPS - 3 and stats.refusal is None, stats
    assert stats.fresh_main_grads  # the replays copied each first share into the unfilled buffer


def test_whole_step_false_keeps_per_layer_graphs():
    strategy = cg_strategy(whole_step=False)
    ref = train("ddp", PlainStep, max_steps=STEPS)
    got, _ = _run(PlainStep, strategy)
    assert_same(ref.facts(), got.facts())
    assert strategy.last_step_graph_stats is None and strategy.last_graph_stats.forward_replays > 0


class _KeepsHistory(PlainStep):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.history = []

    def training_step(self, batch, batch_idx):
        loss = self.loss_of(batch)
        self.history.append(loss.detach())
        return loss

    def loss_of(self, batch):
        return super().training_step(batch, 0)  # super() is followed too


def test_a_step_that_changes_a_value_it_reads_is_handed_to_per_layer_graphs_after_one_capture():
    """``self.history.append(...)`` would happen only at capture: the capture's two runs start from the same
    list, the change is seen, and the rest of the run has per-layer graphs; the history is as long as under
    "ddp" and the training equal."""
    ref = train("ddp", _KeepsHistory, max_steps=STEPS)
    strategy = cg_strategy()
    got, _ = _run(_KeepsHistory, strategy)
    assert_same(ref.facts(), got.facts())
    assert len(got.model.history) == len(ref.model.history) == STEPS
    stats = strategy.last_step_graph_stats
    assert stats.captures == 1 and stats.replays == 0, stats
    assert "training_step changes what it reads (self.history: [tensor(" in stats.refusal, stats


class _Counter(nn.Module):
    """Counts its calls in a public attribute: Python state a forward changes, which a replay would not."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x


class _CountsCalls(PlainStep):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.counter = _Counter()

    def forward(self, x):
        return super().forward(self.counter(x))


def test_a_forward_that_changes_a_submodule_attribute_is_handed_to_per_layer_graphs_after_one_capture():
    """A submodule counting its calls: both runs of the capture start from the count before it (so it rises by one in
    that step, as under "ddp"), the change is seen after the capture and named, and the rest of the run has per-layer
    graphs; the count and the training equal "ddp"."""
    ref = train("ddp", _CountsCalls, max_steps=STEPS)
    strategy = cg_strategy()
    got, _ = _run(_CountsCalls, strategy)
    assert_same(ref.facts(), got.facts())
    assert got.model.counter.calls == ref.model.counter.calls == STEPS
    stats = strategy.last_step_graph_stats
    assert stats.captures == 1 and stats.replays == 0, stats
    assert stats.refusal == ("the step's forward changes counter.calls: 2 -> 3 at every step, which a replay would not "
                             "do"), stats


class _CountingBlock(Block):
    """A repeated (graphed) block whose own forward counts its calls."""

    def __init__(self, d: int) -> None:
        super().__init__(d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


class _CountingBlocks(PlainStep):
    def __init__(self, **kwargs) -> None:
        super().__init__(body="modulelist", **kwargs)
        d = self.body.blocks[0].fc.in_features
        self.body.blocks = nn.ModuleList([_CountingBlock(d) for _ in self.body.blocks])


@pytest.mark.parametrize("whole_step", [None, False], ids=["default", "per-layer"])
def test_a_graphed_block_that_counts_its_calls_runs_its_own_forward_eagerly(whole_step):
    """The counter is inside the graphed blocks: their capture is refused at its warmup (the forward changed
    ``calls``), the values put back, and (split by default) the blocks' own forward runs eagerly around their graphed
    parts; under the default the whole step has given up first. Counts and training equal "ddp"; the warning names
    the attribute."""
    ref = train("ddp", _CountingBlocks, max_steps=STEPS)
    strategy = cg_strategy(whole_step=whole_step)
    got, warned = _run(_CountingBlocks, strategy)
    assert_same(ref.facts(), got.facts())
    assert [b.calls for b in got.model.body.blocks] == [b.calls for b in ref.model.body.blocks] == [STEPS] * 3
    assert any("its forward changes calls: " in w and "at every call" in w for w in warned), warned
    stats = strategy.last_graph_stats
    assert stats.failed_layers == [] and sorted(stats.graphed_parts) == [f"body.blocks.{i}.fc" for i in range(3)], stats


@pytest.mark.parametrize("model", [PlainStep, ParityModel])
def test_a_lightning_module_compiled_before_fit_equals_the_same_compiled_module_under_ddp(model):
    """``trainer.fit(torch.compile(module))``: Lightning unwraps the wrapper and compiles the module's
    ``training_step`` and ``forward`` in place (``lightning.pytorch.utilities.compile.from_compiled``). The code
    check reads through the compiled ``training_step``: a plain step is replayed from one graph, one that reads
    ``batch_idx`` gets per-layer graphs; both bit for bit the same compiled module under "ddp"."""
    def build():
        return torch.compile(model(), backend="aot_eager")

    strategy = cg_strategy()
    torch._dynamo.reset()
    try:
        ref = train("ddp", build, max_steps=STEPS)
        got, warned = _run(build, strategy)
    finally:
        torch._dynamo.reset()
    assert_same(ref.facts(), got.facts())
    assert got.model._compiler_ctx is not None  # Lightning saw a compiled module
    stats = strategy.last_step_graph_stats
    if model is PlainStep:
        assert stats.captures == 1 and stats.replays == STEPS - 3 and stats.refusal is None, stats
        assert warned == []
    else:  # the compiled code runs as under "ddp": no per-layer graphs inside it, and a warning that says so
        assert stats.captures == 0 and "reads its argument 'batch_idx'" in stats.refusal, stats
        assert strategy.last_graph_stats.forward_replays == 0 and strategy.last_graph_stats.captures == 0
        assert len(warned) == 1 and "runs its compiled code without CUDA graphs" in warned[0], warned


class _SlicingBody(nn.Module):
    """``ListBody`` whose forward slices its ``ModuleList`` (``self.blocks[:n]``, as transformers' decoders do):
    every call registers the blocks again in a new ``ModuleList``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_body("modulelist")

    def forward(self, x):
        body = self.body
        h = body.inp(x)
        for block in body.blocks[: len(body.blocks)]:
            h = block(h)
        return body.head(h)


class _CompiledBody(PlainStep):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.compile(_SlicingBody(), backend="aot_eager")


def test_a_model_compiled_before_the_first_step_is_compiled_once(monkeypatch):
    """``torch.compile`` guards on whether torch's global module registration hooks exist. The strategy installs its
    registration count (``graphs/module_state.py``) when it builds, before the first step runs the compiled model,
    so the capture does not recompile it; a recompile there made graphs other than the warmup steps' and ``"ddp"``'s
    (a graph break at every registration by the slicing forward). A process without the hooks yet: torch's hook
    tables emptied for this test."""
    from collections import OrderedDict

    from torch._dynamo.utils import counters
    from torch.nn.modules import module as nn_module

    from cg_lightning.graphs.module_state import _Registrations

    compiles = {}
    for name in ("ddp", "cudagraph_ddp"):
        for table in ("_global_module_registration_hooks", "_global_parameter_registration_hooks",
                      "_global_buffer_registration_hooks"):
            monkeypatch.setattr(nn_module, table, OrderedDict())
        monkeypatch.setattr(_Registrations, "installed", False)
        torch._dynamo.reset()
        counters.clear()
        strategy = "ddp" if name == "ddp" else cg_strategy()
        try:
            run, warned = _run(_CompiledBody, strategy)
        finally:
            torch._dynamo.reset()
        compiles[name] = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), run)
    (ref_graphs, ref_breaks, ref), (graphs, breaks, got) = compiles["ddp"], compiles["cudagraph_ddp"]
    assert_same(ref.facts(), got.facts())
    assert strategy.last_step_graph_stats.replays == STEPS - 3, strategy.last_step_graph_stats
    assert (graphs, breaks) == (ref_graphs, ref_breaks) == (1, 0), {k: v[:2] for k, v in compiles.items()}
    assert warned == []


@pytest.mark.parametrize("case", ["handed-off-after-capture", "accumulation"])
def test_a_compiled_model_whose_step_cannot_be_one_graph_runs_its_compiled_code_as_under_ddp(case):
    """A model the user compiled whole whose step is refused (accumulation) or no longer replayable (a value the
    step reads changed after the capture) gets no per-layer graphs: they would run inside the code dynamo traces
    (a graph break and recompiles at every layer call; a capture after the hand-off failed inside AOT autograd).
    It keeps running its compiled code, compiled as often as under "ddp", with one warning, bit for bit "ddp"."""
    from torch._dynamo.utils import counters

    kwargs = (dict(callbacks=[_SetsScale()]) if case == "handed-off-after-capture"
              else dict(accumulate_grad_batches=2, max_steps=STEPS // 2))
    compiles = {}
    for name in ("ddp", "cudagraph_ddp"):
        torch._dynamo.reset()
        counters.clear()
        strategy = "ddp" if name == "ddp" else cg_strategy()
        try:
            run, warned = _run(_CompiledBody, strategy, **kwargs)
        finally:
            torch._dynamo.reset()
        compiles[name] = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), run, warned)
    (ref_graphs, ref_breaks, ref, _), (graphs, breaks, got, warned) = compiles["ddp"], compiles["cudagraph_ddp"]
    assert_same(ref.facts(), got.facts())
    assert (graphs, breaks) == (ref_graphs, ref_breaks) == (1, 0), {k: v[:2] for k, v in compiles.items()}
    stats = strategy.last_step_graph_stats
    if case == "accumulation":
        assert stats.captures == 0 and "accumulate_grad_batches=2" in stats.refusal, stats
    else:
        assert stats.captures == 1 and stats.replays == 2 and "self.scale: 1.0 -> 0.5" in stats.refusal, stats
    assert strategy.last_graph_stats.captures == 0 and strategy.last_graph_stats.forward_replays == 0
    assert len(warned) == 1 and "runs its compiled code without CUDA graphs" in warned[0], warned


def test_layers_compiled_one_by_one_keep_per_layer_graphs():
    """Layers whose forward is compiled (``graphs.compile``) are per-layer graphs' business: the default does not
    capture the whole step around them, and says so."""
    strategy = cg_strategy(compile=True, compile_backend="aot_eager")
    ref = train("ddp", PlainStep, max_steps=STEPS)
    torch._dynamo.reset()
    try:
        got, _ = _run(PlainStep, strategy)
    finally:
        torch._dynamo.reset()
    assert "forwards are compiled one by one" in strategy.last_step_graph_stats.refusal
    assert strategy.last_graph_stats.forward_replays > 0
    for (name, p), q in zip(got.model.named_parameters(), ref.model.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), name  # aot_eager decomposes ops: not bit-equal


class _FailsInBackward(torch.autograd.Function):
    """Identity whose backward raises at its ``fail_at``-th call (counted from the run's start): the capture run of the
    step fails there, after the layers behind it reported their gradients ready."""

    calls = 0
    fail_at = None

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _FailsInBackward.calls += 1
        if _FailsInBackward.calls == _FailsInBackward.fail_at:
            raise RuntimeError("this backward cannot be captured")
        return grad


class _Gate(nn.Module):
    def forward(self, x):
        return _FailsInBackward.apply(x * 1.0)


class _FailsInBackwardStep(PlainStep):
    def __init__(self) -> None:
        super().__init__()
        self.gate = _Gate()
        self.out = nn.Linear(1, 1)  # reports ready before the gate's backward fails

    def forward(self, x):
        return self.out(self.gate(self.body(x)))


def test_a_capture_that_fails_inside_the_backward_leaves_the_step_to_train_like_ddp(monkeypatch):
    """The failed capture's backward reported some gradients ready: they are forgotten (the eager step that follows
    counts from zero, no ``GradSyncError``), the buffer is restored for per-layer graphs, and every step equals
    "ddp"."""
    ref = train("ddp", _FailsInBackwardStep, max_steps=STEPS)
    monkeypatch.setattr(_FailsInBackward, "calls", 0)
    monkeypatch.setattr(_FailsInBackward, "fail_at", 4)  # steps 0 and 1, the capture's eager run, then its capture
    strategy = cg_strategy()
    got, _ = _run(_FailsInBackwardStep, strategy, callbacks=[_Adoption()])
    assert_same(ref.facts(), got.facts())
    stats = strategy.last_step_graph_stats
    assert stats.captures == 0 and "this backward cannot be captured" in stats.refusal, stats
    assert _Adoption.steps[1] == (True, False, False, True)  # transient before the capture
    assert all(step == (False, False, True, False) for step in _Adoption.steps[2:]), _Adoption.steps
