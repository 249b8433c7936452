"""Small models for engine-level tests: recomputation variants inside graphed layers."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tcp

import cg_lightning
from cg_lightning import CheckpointWithoutOutput


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
