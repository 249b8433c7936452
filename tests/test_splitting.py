"""``graphs.on_capture_error="split"`` on hand-written layers: a layer that cannot be captured whole is replaced by
its parts with trainable parameters; its own forward runs eagerly, the parts that capture are graphed, the others
run eagerly (``graphs/split/splitting.py``, ``graphs/split/failures.py``).

The layer here is a small mixture-of-experts decoder layer: two norms that read their input twice (so its
gradient comes in pieces, ``graphs/replay/input_pieces.py``), a mixing projection, and an MoE block whose experts find
their tokens with ``nonzero`` (a host sync). Engine-level runs are compared with plain PyTorch, the Lightning run
with ``"ddp"``, same seed and data: gradients and weights equal bit for bit.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from lightning.pytorch import LightningModule, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from cg_lightning import GraphCaptureError
from cg_lightning.lifecycle.summary import CaptureSummary
from tests.engine_models import LR, graphed_engine, train_steps
from tests.helpers import cg_strategy, make_trainer

D = 16


class RMSNorm(nn.Module):
    """Reads its input twice (``pow`` and ``*``): the input's gradient arrives in two pieces."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Router(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, n, bias=False)

    def forward(self, x):
        return torch.softmax(self.proj(x), dim=-1).topk(1, dim=-1)  # (weights, expert indices)


class LoopExperts(nn.Module):
    """Every token through its expert, the expert's tokens found with ``nonzero``: a host sync."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d, d) * 0.2)

    def forward(self, x, weights, indices):
        out = torch.zeros_like(x)
        for e in range(self.weight.shape[0]):
            rows = (indices[:, 0] == e).nonzero().squeeze(1)
            out = out.index_add(0, rows, (x[rows] @ self.weight[e]) * weights[rows])
        return out


class MoE(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.router = Router(d, n)
        self.experts = LoopExperts(d, n)
        self.shared = nn.Linear(d, d)

    def forward(self, x):
        weights, indices = self.router(x)
        return self.experts(x, weights, indices) + self.shared(x)


class MoELayer(nn.Module):
    def __init__(self, d: int = D, n: int = 4) -> None:
        super().__init__()
        self.norm1 = RMSNorm(d)
        self.mix = nn.Linear(d, d)
        self.norm2 = RMSNorm(d)
        self.moe = MoE(d, n)

    def forward(self, x):
        x = x + self.mix(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoEStack(nn.Module):
    def __init__(self, d: int = D, n_layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList([MoELayer(d) for _ in range(n_layers)])
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).pow(2).mean()


GRAPHED_PARTS = ["norm1", "mix", "norm2", "moe.router", "moe.shared"]
NAMES = [f"layers.{i}.{p}" for i in range(2) for p in GRAPHED_PARTS]


def _batches(steps: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(12, D, generator=g) for _ in range(steps)]


def _eager(steps: int):
    """Plain PyTorch SGD: each step's ``.grad`` by name, and the model."""
    torch.manual_seed(0)
    model = MoEStack()
    grads = []
    for x in _batches(steps):
        model.zero_grad(set_to_none=True)
        model(x).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return grads, model


def _graphed(steps: int, **graphs):
    torch.manual_seed(0)
    model = MoEStack()
    manager, engine = graphed_engine(model, layers=["layers.*"], **graphs)
    grads, _ = train_steps(manager, engine, model, _batches(steps))
    return grads, manager, model


def _assert_equal(got, ref):
    assert len(got) == len(ref)
    for step, (g, r) in enumerate(zip(got, ref)):
        for name in r:
            assert torch.equal(g[name], r[name]), f"step {step}: {name} {(g[name] - r[name]).abs().max():.3g}"


def test_split_graphs_the_parts_and_runs_the_host_sync_eagerly_bit_exact():
    """warmup 1: step 0 records; step 1 splits the layers, step 2 their MoE blocks (each time the step records
    again); step 3 captures with the experts eager and replays, as do steps 4 and 5. One warning names both layers, the
    operation and this file's line, the graphed parts and the eager one."""
    ref, ref_model = _eager(6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, manager, model = _graphed(6, on_capture_error="split")
    _assert_equal(got, ref)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
    stats = manager.stats
    assert stats.split_layers == ["layers.0", "layers.1", "layers.0.moe", "layers.1.moe"]
    assert stats.failed_layers == ["layers.0.moe.experts", "layers.1.moe.experts"]
    assert sorted(stats.graphed_parts) == sorted(NAMES)
    assert stats.captured_runners == len(NAMES) and stats.captures == 1
    assert stats.forward_replays == 3 * len(NAMES)  # steps 3 to 5
    assert sorted({r.name for r in manager.all_runners()}) == sorted(NAMES)
    summary = CaptureSummary.of(manager)  # parts graphed, the experts with the modules outside the layers eager
    assert summary.layers == tuple(NAMES)
    assert summary.eager == ("inp", "layers.0.moe.experts", "layers.1.moe.experts", "head")
    messages = [str(w.message) for w in caught if "cg_lightning" in str(w.message)]
    assert len(messages) == 1, messages
    text = messages[0]
    assert "layers 'layers.0', 'layers.1' could not be captured whole" in text
    assert "nonzero" in text and "test_splitting.py" in text and "rows = (indices[:, 0] == e).nonzero()" in text
    assert "Graphed: norm1, mix, norm2, moe.router, moe.shared." in text
    assert "Eager: moe.experts (host synchronization nonzero" in text


def test_raise_names_the_operation_and_suggests_split():
    with pytest.raises(GraphCaptureError, match=r"(?s)'layers\.0'.*nonzero.*test_splitting\.py.*"
                                                r"on_capture_error='split'"):
        _graphed(3)


def test_eager_policy_still_runs_the_whole_layer_eagerly():
    ref, _ = _eager(3)
    with pytest.warns(UserWarning, match=r"layer 'layers\.0' could not be captured and runs eagerly"):
        got, manager, _ = _graphed(3, on_capture_error="eager")
    _assert_equal(got, ref)
    assert manager.stats.failed_layers == ["layers.0", "layers.1"] and manager.stats.captured_runners == 0
    assert manager.stats.split_layers == []


def test_remove_gives_every_part_its_forward_back():
    _, manager, model = _graphed(4, on_capture_error="split")
    assert "forward" in model.layers[0].moe.router.__dict__
    manager.remove()
    assert not [name for name, m in model.named_modules() if "forward" in m.__dict__]


class Pair(nn.Module):
    """Returns a tuple with a ``None`` in it, as transformers' attention does (``(output, weights or None)``)."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.lin(x)), None


class PairStack(nn.Module):
    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Pair(d) for _ in range(2)])
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.layers:
            out, nothing = layer(x)
            assert nothing is None
            x = x + out
        return self.head(x).pow(2).mean()


def test_a_none_output_is_structure_not_a_failure():
    torch.manual_seed(0)
    ref = PairStack()
    torch.manual_seed(0)
    model = PairStack()
    manager, engine = graphed_engine(model, layers=["layers.*"])
    got, _ = train_steps(manager, engine, model, _batches(4))
    want = []
    for x in _batches(4):
        ref.zero_grad(set_to_none=True)
        ref(x).backward()
        want.append({k: p.grad.clone() for k, p in ref.named_parameters()})
        with torch.no_grad():
            for p in ref.parameters():
                p -= LR * p.grad
    _assert_equal(got, want)
    assert manager.stats.captured_runners == 2 and manager.stats.forward_replays == 2 * 3


def test_hooked_submodule_becomes_a_graphed_part_with_its_hook():
    """A forward hook on a submodule is refused in a graphed layer; under "split" the layer is split at setup and
    the hooked submodule is a part, graphed with its hook around the replay (which then runs at every step)."""
    ref, _ = _eager(6)
    calls = []
    torch.manual_seed(0)
    model = MoEStack()
    model.layers[0].mix.register_forward_hook(lambda *a: calls.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager, engine = graphed_engine(model, layers=["layers.*"], on_capture_error="split")
        assert manager.stats.split_layers == ["layers.0"]  # at setup, before any step
        got, _ = train_steps(manager, engine, model, _batches(6))
    _assert_equal(got, ref)
    assert len(calls) == 6
    assert "layers.0.mix" in manager.stats.graphed_parts and manager.stats.forward_replays > 0


def test_hook_added_between_warmup_steps_splits_at_the_next_step_and_stays_exact():
    """A hook on a submodule that appears between two warmup steps is refused when the next step starts; under
    "split" that step records the parts' calls, the one after captures (and splits the MoE block)."""
    ref, _ = _eager(7)
    torch.manual_seed(0)
    model = MoEStack()
    manager, engine = graphed_engine(model, layers=["layers.1"], warmup_steps=2, on_capture_error="split")
    calls = []
    batches = _batches(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, _ = train_steps(manager, engine, model, batches[:1])
        model.layers[1].mix.register_forward_hook(lambda *a: calls.append(1))
        more, _ = train_steps(manager, engine, model, batches[1:])
    _assert_equal(got + more, ref)
    assert len(calls) == 6  # the hook ran at every step from step 1 on, replayed or not
    assert manager.stats.split_layers == ["layers.1", "layers.1.moe"]
    assert "layers.1.mix" in manager.stats.graphed_parts and manager.stats.forward_replays > 0


def test_hook_added_during_a_step_splits_at_the_layers_call_and_stays_exact():
    """A hook on a submodule added in the middle of a warmup step (by a pre-hook of the second graphed layer, after
    the step's first graphed call) is refused at that layer's call: the layer is split there, the rest of the step
    runs eagerly, the next step records and the one after captures; the other layer is split at the capture."""
    ref, _ = _eager(8)
    torch.manual_seed(0)
    model = MoEStack()
    manager, engine = graphed_engine(model, layers=["layers.*"], warmup_steps=2, on_capture_error="split")
    calls, forwards, split_by_step = [], [], []

    def add_hook_at_step_1(module, args):
        forwards.append(1)
        if len(forwards) == 2:
            model.layers[1].mix.register_forward_hook(lambda *a: calls.append(1))

    model.layers[1].register_forward_pre_hook(add_hook_at_step_1)  # on the graphed layer itself: allowed
    model.head.register_forward_hook(lambda *a: split_by_step.append(list(manager.stats.split_layers)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, _ = train_steps(manager, engine, model, _batches(8))
    _assert_equal(got, ref)
    assert len(calls) == 7  # the hook ran at every step from step 1 on, replayed or not
    assert split_by_step[:2] == [[], ["layers.1"]]  # split at its call in step 1
    assert manager.stats.split_layers == ["layers.1", "layers.0", "layers.1.moe", "layers.0.moe"]
    assert sorted(manager.stats.graphed_parts) == sorted(NAMES) and manager.stats.forward_replays == 3 * len(NAMES)


# ------------------------------------------------------------------------------------------------ Lightning
class MoEModule(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = MoEStack()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def _fit(strategy, steps: int = 7):
    seed_everything(0, workers=True)
    module = MoEModule()
    data = DataLoader(TensorDataset(torch.randn(12 * steps, D, generator=torch.Generator().manual_seed(2))),
                      batch_size=12)
    trainer = make_trainer(strategy, steps)
    trainer.fit(module, data)
    return module, trainer


def test_lightning_split_matches_ddp_bit_for_bit():
    """warmup 2 (steps 0, 1), splits at steps 2 and 3 (each records again), capture and replays from step 4 on."""
    ref, _ = _fit("ddp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, trainer = _fit(cg_strategy("eager", on_capture_error="split", whole_step=False))
    for (name, p), q in zip(got.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    stats = trainer.strategy.last_graph_stats
    assert sorted(stats.graphed_parts) == sorted(f"net.{n}" for n in NAMES)
    assert stats.failed_layers == ["net.layers.0.moe.experts", "net.layers.1.moe.experts"]
    assert stats.captured_runners == len(NAMES) and stats.forward_replays == 3 * len(NAMES)  # steps 4 to 6
    assert sum("could not be captured whole" in str(w.message) for w in caught) == 1
