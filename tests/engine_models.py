"""Engine-level tests (no Lightning): small models (recomputation variants inside graphed layers), the graph
manager and data-parallel engine built over them, and the SGD runs the tests compare against eager PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tcp

import cg_lightning
from cg_lightning import CheckpointWithoutOutput
from cg_lightning.ddp import DataParallelEngine, DDPOptions
from cg_lightning.graphs import GraphManager, GraphOptions

LR = 0.05  # the SGD learning rate of eager_reference and train_steps
# (graph backend, torch device): the eager backend on CPU everywhere, real CUDA graphs on the GPU machine
BACKENDS = [pytest.param("eager", "cpu", id="eager-cpu"),
            pytest.param("cuda", "cuda", id="cuda", marks=pytest.mark.cuda)]


class SeedLayer(nn.Module):
    """Megatron-LM PR #6373's example: ``checkpointed`` runs only inside the recomputation."""

    def __init__(self, d: int, recompute: bool = True) -> None:
        super().__init__()
        self.checkpointed = nn.Linear(d, d)
        self.projection = nn.Linear(d, d)
        self.recompute = recompute

    def forward(self, x):
        if not self.recompute:
            return self.projection(self.checkpointed(x))
        ckpt = CheckpointWithoutOutput()
        hidden = ckpt.checkpoint(self.checkpointed, x)
        output = self.projection(hidden)
        ckpt.discard_output_and_register_recompute(output)
        return output


class InsideOutsideLayer(nn.Module):
    """``shared.weight`` is used inside the recomputation and again outside it."""

    def __init__(self, d: int, recompute: bool = True) -> None:
        super().__init__()
        self.shared = nn.Linear(d, d, bias=False)
        self.recompute = recompute

    def _inner(self, x):
        return torch.tanh(self.shared(x))

    def forward(self, x):
        if not self.recompute:
            return self.shared(self._inner(x))
        ckpt = CheckpointWithoutOutput()
        hidden = ckpt.checkpoint(self._inner, x)
        output = self.shared(hidden)
        ckpt.discard_output_and_register_recompute(output)
        return output


class RepeatedNestedLayer(nn.Module):
    """Three recomputation regions using weights a, b, a: nested backwards finalize [a, b, a]."""

    def __init__(self, d: int, recompute: bool = True) -> None:
        super().__init__()
        self.a = nn.Linear(d, d, bias=False)
        self.b = nn.Linear(d, d, bias=False)
        self.recompute = recompute

    def forward(self, x):
        h = x
        for lin in (self.a, self.b, self.a):
            if self.recompute:
                ckpt = CheckpointWithoutOutput()
                inner = ckpt.checkpoint(lin, h)
                h = torch.tanh(inner)
                ckpt.discard_output_and_register_recompute(h)
            else:
                h = torch.tanh(lin(h))
        return h


class TorchReentrantLayer(nn.Module):
    def __init__(self, d: int, recompute: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.recompute = recompute

    def _mlp(self, x):
        return self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x):
        if not self.recompute:
            return x + self._mlp(x)
        return x + tcp.checkpoint(self._mlp, x, use_reentrant=True)


class CgCheckpointLayer(TorchReentrantLayer):
    def forward(self, x):
        if not self.recompute:
            return x + self._mlp(x)
        return x + cg_lightning.checkpoint(self._mlp, x)


class TorchNonReentrantLayer(TorchReentrantLayer):
    def forward(self, x):
        if not self.recompute:
            return x + self._mlp(x)
        return x + tcp.checkpoint(self._mlp, x, use_reentrant=False)


class Stack(nn.Module):
    """``inp`` (eager) -> ``layers`` (graphed; each applied ``repeat`` times in a row) -> ``head`` (eager)."""

    def __init__(self, layer_cls, d: int = 16, n: int = 2, recompute: bool = True, repeat: int = 1) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList([layer_cls(d, recompute=recompute) for _ in range(n)])
        self.head = nn.Linear(d, 1)
        self.repeat = repeat

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            for _ in range(self.repeat):
                h = layer(h)
        return self.head(h).pow(2).mean()


class ConstantsLayer(nn.Module):
    """A residual MLP returning its output among constant leaves, as Hugging Face layers do. ``kind``:
    ``"plain"`` (the tensor alone), ``"pair"`` (``(h, None)``: no attention weights asked for), ``"triple"``
    (``(h, None, bias)``, a T5 encoder block: the attention bias it computes when ``computes_bias``, else the one
    it was handed, passed on) or
    ``"dict"`` (``{"hidden": h, "attentions": None, "flags": (False, 2, "block", torch.float32)}``)."""

    FLAGS = (False, 2, "block", torch.float32)

    def __init__(self, d: int, kind: str, computes_bias: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bias_proj = nn.Linear(d, d) if computes_bias else None
        self.kind = kind

    def forward(self, x, bias=None):
        h = x + torch.tanh(self.fc(x))
        if self.kind == "pair":
            return h, None
        if self.kind == "triple":
            bias = self.bias_proj(x) if self.bias_proj is not None else bias
            return h * torch.sigmoid(bias), None, bias
        if self.kind == "dict":
            return {"hidden": h, "attentions": None, "flags": self.FLAGS}
        return h


class ConstantsStack(nn.Module):
    """``inp`` (eager) -> one :class:`ConstantsLayer` per entry of ``kinds`` (graphed; the first ``"triple"``
    computes the bias, each later one is handed it) -> ``head`` (eager). Every constant leaf is checked where it
    is unpacked."""

    def __init__(self, kinds, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        first = list(kinds).index("triple") if "triple" in kinds else -1
        self.layers = nn.ModuleList([ConstantsLayer(d, kind, i == first) for i, kind in enumerate(kinds)])
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h, bias = self.inp(x), None
        for layer in self.layers:
            out = layer(h) if bias is None or layer.kind != "triple" else layer(h, bias)
            if layer.kind == "pair":
                h, none = out
            elif layer.kind == "triple":
                h, none, bias = out
            elif layer.kind == "dict":
                h, none = out["hidden"], out["attentions"]
                assert out["flags"] == ConstantsLayer.FLAGS and list(out) == ["hidden", "attentions", "flags"]
            else:
                h, none = out, None
            assert none is None and isinstance(h, torch.Tensor)
        return self.head(h).pow(2).mean()


def graph_manager(model: nn.Module, device="cpu", **graphs) -> GraphManager:
    """``GraphManager`` over ``model`` with ``GraphOptions(warmup_steps=1, backend="eager", **graphs)``."""
    return GraphManager(model, GraphOptions(**{"warmup_steps": 1, "backend": "eager", **graphs}), torch.device(device))


def graphed_engine(model: nn.Module, device="cpu", **graphs):
    """:func:`graph_manager` and a ``DataParallelEngine`` (default options) over ``model``, the manager bound to the
    engine's grad-ready reporter. Returns (manager, engine)."""
    manager = graph_manager(model, device, **graphs)
    engine = DataParallelEngine(model, DDPOptions(), grad_accumulator_stream=getattr(manager.backend, "stream", None))
    manager.bind_grad_ready(engine.grad_ready)
    return manager, engine


def batches(steps: int, d: int, device="cpu"):
    """``steps`` inputs of shape (8, d), the same on every call."""
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, d, generator=g).to(device) for _ in range(steps)]


def eager_reference(layer_cls, steps=4, d=16, n=2, device="cpu", repeat=1):
    """SGD steps of ``Stack(layer_cls)`` without recomputation; returns (each step's ``.grad`` by name, model)."""
    torch.manual_seed(0)
    model = Stack(layer_cls, d, n, recompute=False, repeat=repeat).to(device)
    grads = []
    for x in batches(steps, d, device):
        model.zero_grad(set_to_none=True)
        model(x).backward()
        grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return grads, model


def graphed_run(layer_cls, backend, device, steps=4, d=16, n=2, warmup_steps=1, recompute=True, repeat=1,
                graphs=True, **opts):
    """Train with the DDP engine; with ``graphs`` the layers are graphed (else eager, real recomputation).
    Returns (grads, counts, manager, engine, model), grads and counts as :func:`train_steps` gives them."""
    torch.manual_seed(0)
    model = Stack(layer_cls, d, n, recompute=recompute, repeat=repeat).to(device)
    manager, engine = graphed_engine(model, device, warmup_steps=warmup_steps, backend=backend, layers=["layers.*"],
                                     enabled=graphs, **opts)
    grads, counts = train_steps(manager, engine, model, batches(steps, d, device))
    return grads, counts, manager, engine, model


def train_steps(manager, engine, model, batches):
    """SGD steps of ``engine`` over ``batches`` with ``manager``'s graphs; returns each step's ``main_grad`` by name
    (after the all-reduce) and each step's grad-ready count by parameter name."""
    grads, counts = [], []
    for step, x in enumerate(batches):
        manager.begin_step(step)
        engine(x).backward()
        manager.end_step()
        counts.append({engine.names[p]: c for b in engine.buckets for p, c in b.counts.items()})
        engine.finish_grad_sync()
        grads.append({k: p.main_grad.detach().clone() for k, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.main_grad
        engine.zero_grad_buffer()
    return grads, counts


def assert_grads_equal(got, ref, tol=1e-6):
    """Per step and parameter name, ``got`` equals ``ref`` within ``tol`` (relative and absolute)."""
    assert len(got) == len(ref)
    for step, (g, r) in enumerate(zip(got, ref)):
        assert g.keys() == r.keys()
        for name in r:
            torch.testing.assert_close(g[name], r[name], rtol=tol, atol=tol, msg=f"step {step}: {name}")
