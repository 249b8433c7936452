"""``graphs/module_state.py``: what a graph was captured over that Python changes without a kernel (structure,
modes, ``requires_grad``, scalar attributes), each change named, the structure walked again only after a
registration somewhere in the process."""

from __future__ import annotations

import torch
import torch.nn as nn

from cg_lightning.graphs.module_state import ModuleState


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Dropout(0.1), nn.LayerNorm(4))


def test_an_unchanged_tree_matches_and_names_nothing():
    block = _block()
    state = ModuleState(block)
    block(torch.randn(2, 4)).sum().backward()  # training runs no registration and changes no attribute
    nn.Linear(3, 3)  # another module built elsewhere: a registration, then the walk finds the same tree
    assert state.match() and state.changes() == [] and state.first_change() is None


def test_each_change_is_named():
    cases = {
        "mode": (lambda b: b[2].eval(), "train/eval mode changed since capture for submodule(s) ['2']"),
        "frozen": (lambda b: b[0].requires_grad_(False), "requires_grad changed since capture for parameter(s) "
                                                         "['0.weight', '0.bias']"),
        "p": (lambda b: setattr(b[2], "p", 0.3), "2.p: 0.1 -> 0.3"),
        "eps": (lambda b: setattr(b[3], "eps", 1e-3), "3.eps: 1e-05 -> 0.001"),
        "swapped": (lambda b: b.__setitem__(1, nn.Tanh()), "submodule(s) ['1'] replaced or removed"),
        "parameter": (lambda b: setattr(b[0], "weight", nn.Parameter(torch.zeros(4, 4))),
                      "parameter(s) ['0.weight'] replaced"),
    }
    for name, (change, words) in cases.items():
        block = _block()
        state = ModuleState(block)
        change(block)
        lines = state.changes()
        assert not state.match() and any(words in line for line in lines), (name, lines)


def test_a_new_buffer_or_a_replaced_one_is_a_structure_change():
    block = _block()
    block[3].register_buffer("scale", torch.ones(4))
    state = ModuleState(block)
    block[3].scale = torch.zeros(4)  # the graph would read the old tensor
    assert not state.structure_matches() and state.changes() == ["since capture: a buffer replaced"]
    block[3].register_buffer("shift", torch.zeros(4))
    assert not state.match()


def test_the_structure_is_walked_again_only_after_a_registration(monkeypatch):
    block = _block()
    state = ModuleState(block)
    walks = []
    original = nn.Module.modules
    monkeypatch.setattr(nn.Module, "modules", lambda self: walks.append(1) or original(self))
    for _ in range(3):
        assert state.structure_matches()
    assert walks == []
    nn.Linear(2, 2)  # a registration in the process
    assert state.structure_matches() and state.structure_matches()
    assert len(walks) == 1


def test_attributes_are_compared_by_identity_first_and_recorded_again_after_capture():
    block = _block()
    block[2].odd = float("nan")  # nan != nan: the same object still matches
    state = ModuleState(block)
    assert state.attributes_match()
    block[2].p = 0.5  # set by a capture's own runs, say
    state.snapshot_attributes()
    assert state.match()
    root = ModuleState(block, root_attributes=False)
    block.flag = True  # a new attribute is not one the capture could have read
    assert root.match()


class _Sliced(nn.Module):
    """Slices its ``ModuleList`` at every forward, as transformers' decoders do (``self.layers[:n]``): each slice is
    a new ``ModuleList`` that registers its layers again."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_block() for _ in range(3))

    def forward(self, x):
        for block in self.blocks[:2]:
            x = block(x)
        return x


def test_compiled_code_that_registers_modules_stays_one_graph_with_the_count_installed():
    """With the registration count installed, ``torch.compile`` still makes one graph of a forward that registers
    modules (no graph break at each registration) and compiles it once over several calls (no recompile on the
    count's value); eager registrations are still counted."""
    from torch._dynamo.utils import counters

    from cg_lightning.graphs.module_state import _Registrations, watch_registrations

    watch_registrations()
    torch._dynamo.reset()
    counters.clear()
    try:
        model = torch.compile(_Sliced(), backend="eager")
        for _ in range(3):
            model(torch.randn(2, 4))
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    before = _Registrations.count
    _Sliced()(torch.randn(2, 4))
    assert _Registrations.count > before
