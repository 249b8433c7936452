"""Copying parameters and buffers from the group's first rank, in place (graphs captured on them stay valid)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import torch_compat


def _source(group) -> int:
    """The global rank of ``group``'s rank 0."""
    return dist.get_global_rank(group, 0) if group is not None else 0


def broadcast_states(module: nn.Module, group) -> None:
    """Every parameter and buffer of ``module`` from rank 0 of ``group`` (at setup)."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=_source(group), group=group)


def broadcast_buffers(module: nn.Module, group) -> None:
    """Every buffer of ``module`` from rank 0 of ``group``, coalesced where torch offers it (before a forward,
    ``ddp.broadcast_buffers``). The buffers are looked up at every call: a module may reassign one."""
    buffers = list(module.buffers())
    if not buffers:
        return
    with torch.no_grad():
        if torch_compat.broadcast_coalesced(group, buffers, 250 * 1024 * 1024, 0):  # group-local source
            return
        src = _source(group)
        for b in buffers:
            dist.broadcast(b, src=src, group=group)
