"""Segments over layers called with a shared context (``graphs.segments``, :mod:`cg_lightning.graphs.segments.context`):
``h = layer(h, mask=m, pos=(cos, sin), scale=s)`` with the same ``m``, ``cos``, ``sin`` and ``s`` for every layer,
as Hugging Face decoder layers are called. Engine level (graph manager and data-parallel engine, eager graph
backend on CPU) against plain PyTorch on the same seed and data."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from cg_lightning import SegmentError
from tests.engine_models import BACKENDS, LR, assert_grads_equal, graphed_engine

D, T, N = 16, 6, 3
STEPS = 4


class ContextLayer(nn.Module):
    """Rotary-style mixing with ``pos = (cos, sin)``, then masked attention over the sequence (additive ``mask``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(D, D)
        self.k = nn.Linear(D, D)
        self.v = nn.Linear(D, D)

    def forward(self, h, mask=None, pos=None, scale=1.0, extra=None):
        cos, sin = pos
        q = self.q(h) * cos + self.k(h) * sin
        att = torch.softmax((q @ h.transpose(-1, -2)) * scale + mask, dim=-1)
        return h + att @ self.v(h)


class ContextStack(nn.Module):
    """``inp`` (eager) -> ``N`` :class:`ContextLayer` (graphed), each given the mask and position embeddings the
    forward computed once -> ``head`` (eager). ``learned_pos``: the position embeddings come from a parameter (they
    require grad); ``extra``: an object passed to every layer; ``late``: what happens at layer 1's call in steps
    from ``late_from`` on (a cloned mask, a mask changed in place, another ``scale``)."""

    def __init__(self, learned_pos: bool = False, extra=None, late: str = "", late_from: int = 2,
                 frozen: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.layers = nn.ModuleList(ContextLayer() for _ in range(N))
        self.head = nn.Linear(D, 1)
        if frozen:  # no gradient flows through the layers: the segment's backward stays one graph per layer
            self.inp.requires_grad_(False)
            self.layers.requires_grad_(False)
        self.freq = nn.Parameter(torch.linspace(0.1, 1.0, D)) if learned_pos else None
        self.extra, self.late, self.late_from, self.step = extra, late, late_from, 0

    def forward(self, x):
        h = self.inp(x)
        # new tensors every forward, as the library builds them, with values that change from step to step
        mask = torch.full((T, T), -math.inf, device=x.device).triu(1) + 0.1 * x.detach()[0, :, :T]
        t = torch.arange(T, dtype=torch.float32, device=x.device)[:, None] + x.detach()[0, 0, 0]
        freq = self.freq if self.freq is not None else torch.linspace(0.1, 1.0, D, device=x.device)
        pos = (torch.cos(t * freq), torch.sin(t * freq))
        kwargs = {"extra": self.extra} if self.extra is not None else {}
        for i, layer in enumerate(self.layers):
            m, scale = mask, 0.5
            if i == 1 and self.late and self.step >= self.late_from:
                if self.late == "other_mask":
                    m = mask.clone()
                elif self.late == "inplace":
                    mask.add_(0.0)
                elif self.late == "scale":
                    scale = 0.25
            h = layer(h, mask=m, pos=pos, scale=scale, **kwargs)
        self.step += 1
        return self.head(h).pow(2).mean()


def _batches(device: str = "cpu"):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, T, D, generator=g).to(device) for _ in range(STEPS)]


def _eager(device: str = "cpu", **kwargs):
    """Plain PyTorch: SGD steps; each step's ``.grad`` by name (of the parameters that require grad)."""
    torch.manual_seed(0)
    model = ContextStack(**kwargs).to(device)
    grads = []
    for x in _batches(device):
        model.zero_grad(set_to_none=True)
        model(x).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad})
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p -= LR * p.grad
    return grads


def _graphed(segments: bool = True, backend: str = "eager", device: str = "cpu", **kwargs):
    """The same steps with the layers graphed (one warmup step, capture in step 1); each step's ``main_grad`` by
    name, and the manager."""
    torch.manual_seed(0)
    model = ContextStack(**kwargs).to(device)
    manager, engine = graphed_engine(model, device, layers=["layers.*"], segments=segments, backend=backend)
    grads = []
    for step, x in enumerate(_batches(device)):
        manager.begin_step(step)
        engine(x).backward()
        manager.end_step()
        engine.finish_grad_sync()
        grads.append({k: p.main_grad.clone() for k, p in model.named_parameters() if p.requires_grad})
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p -= LR * p.main_grad
        engine.zero_grad_buffer()
    return grads, manager


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("frozen", [False, True], ids=["one-node", "frozen-layers"])
def test_layers_sharing_mask_and_position_embeddings_form_one_segment(frozen, backend, device):
    """Every layer called with the same mask, ``(cos, sin)`` and scale (new values every step): the three calls form
    one segment, and ``main_grad`` equals plain PyTorch's ``.grad`` at every step (eager backend: bit for bit;
    CUDA graphs: 1e-6). Trainable layers replay through the segment's one node; frozen ones (their outputs need no
    gradient) through their own nodes after the segment's forward graph ran them all."""
    ref = _eager(device, frozen=frozen)
    got, manager = _graphed(backend=backend, device=device, frozen=frozen)
    runners = list(manager.runners.values())
    assert manager.stats.segments == 1 and manager.stats.captured_runners == N
    assert runners[0].segment is not None and all(r.segment is runners[0].segment for r in runners)
    assert runners[0].segment.node_runners == (None if frozen else runners)
    assert manager.stats.forward_replays == N * (STEPS - 1) and manager.stats.fallback_calls == 0
    assert_grads_equal(got, ref, tol=0 if backend == "eager" else 1e-6)


@pytest.mark.parametrize("case", ["learned_pos", "object"])
def test_context_that_requires_grad_or_is_an_object_ends_the_chain(case):
    """Position embeddings computed from a parameter (they require grad: each layer adds its share of their
    gradient) or an object passed to every layer (it could change between the calls): no segment, one graph per
    layer call, gradients equal plain PyTorch's bit for bit."""
    kwargs = {"learned_pos": True} if case == "learned_pos" else {"extra": SimpleNamespace(flag=True)}
    ref = _eager(**kwargs)
    got, manager = _graphed(**kwargs)
    assert manager.stats.segments == 0 and manager.stats.captured_runners == N
    assert manager.stats.forward_replays == N * (STEPS - 1) and manager.stats.fallback_calls == 0
    assert_grads_equal(got, ref, tol=0)


@pytest.mark.parametrize("late,match", [
    ("other_mask", r"'layers\.1'.*other ones:\n  kwargs\['mask'\]: another tensor than the segment's first call's"),
    ("inplace", r"'layers\.1'.*other ones:\n  kwargs\['mask'\]: changed in place since the segment's first call"),
    ("scale", r"'layers\.1'.*other ones:\n  kwargs\['scale'\]: 0\.25, the segment's first call had 0\.5"),
])
@pytest.mark.parametrize("frozen", [False, True], ids=["one-node", "frozen-layers"])
def test_a_following_member_called_with_other_context_is_an_error_naming_it(late, match, frozen):
    """From step 2 on (after capture), layer 1 gets a clone of the mask, the mask changed in place before its call,
    or another scale: the segment already ran layer 1 with the first call's context, so its call raises
    ``SegmentError`` naming the layer and the argument (as for any other argument a following member gets)."""
    with pytest.raises(SegmentError, match=match):
        _graphed(late=late, frozen=frozen)


@pytest.mark.parametrize("late", ["other_mask", "inplace", "scale"])
def test_the_same_calls_train_like_plain_pytorch_with_per_layer_graphs(late):
    """The calls refused above, with graphs.segments=false: each layer's graph gets its own arguments (the other
    scale is another signature: that call runs eagerly); gradients equal plain PyTorch's bit for bit."""
    ref = _eager(late=late)
    with pytest.warns(UserWarning, match="layers.1") if late == "scale" else contextlib.nullcontext():
        got, manager = _graphed(segments=False, late=late)
    assert manager.stats.segments == 0
    assert_grads_equal(got, ref, tol=0)
