"""Reduce-scatter and all-gather of flat tensors, with a fallback where a backend lacks the flat-tensor form.

The distributed optimizer (``ddp.distributed_optimizer``) reduce-scatters each gradient bucket into this rank's
shard of it and all-gathers the updated parameter shards. torch's ``reduce_scatter_tensor`` and
``all_gather_into_tensor`` (named ``reduce_scatter_single`` and ``all_gather_single`` from torch 2.13 on) do that with
one flat input and one flat output, in place (the shard is a slice of the bucket); NCCL and gloo have both in torch
2.11 and 2.13 (checked on CPU with 2 and 4 processes, in place and out of place). A backend that refuses one raises at the call; from then on this module takes the fallback for that
backend: for reduce-scatter an all-reduce of the whole input and then a copy of this rank's shard (twice the
traffic, the same sums), for all-gather ``all_gather`` into views of the output's chunks.
"""

from __future__ import annotations

from typing import Callable, Set, Tuple

import torch
import torch.distributed as dist

_REFUSED: Set[Tuple[str, str]] = set()  # (backend, operation) that raised "not supported"
# torch 2.13 names the flat-tensor forms (the old names warn there); 2.11 has only the old ones
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Then:
    """A collective's handle whose :meth:`wait` also runs ``after`` (the fallback's copy)."""

    def __init__(self, handle, after: Callable[[], None]) -> None:
        self.handle = handle
        self.after = after

    def wait(self) -> bool:
        self.handle.wait()
        self.after()
        return True


def _unsupported(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, (NotImplementedError, AttributeError)) or "support" in text


def _native(name: str, group, call: Callable, native: bool):
    """``call()`` unless ``name`` was refused by this group's backend (or ``native`` is false); ``None`` means
    take the fallback."""
    key = (str(dist.get_backend(group)), name)
    if not native or key in _REFUSED:
        return None
    try:
        return call()
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        if not _unsupported(exc):
            raise
        _REFUSED.add(key)
        return None


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, native: bool = True):
    """Start summing ``input`` (1-D, ``world_size * output.numel()`` elements) over ``group`` into ``output``, this
    rank's chunk; ``output`` may be that chunk of ``input`` itself. Returns a handle with ``wait()``. The
    fallback (``native=False``, or a backend without ``reduce_scatter_tensor``) all-reduces ``input`` in place, so
    every element of ``input`` may change either way."""
    handle = _native("reduce_scatter_tensor", group,
                     lambda: _REDUCE_SCATTER(output, input, group=group, async_op=True), native)
    if handle is not None:
        return handle
    n = output.numel()
    start = dist.get_rank(group) * n
    mine = input[start : start + n]
    handle = dist.all_reduce(input, group=group, async_op=True)
    if mine.data_ptr() == output.data_ptr():
        return handle
    return _Then(handle, lambda: output.copy_(mine))


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, native: bool = True):
    """Start gathering every rank's ``input`` (1-D) into ``output`` (``world_size * input.numel()`` elements, in rank
    order); ``input`` may be this rank's chunk of ``output``. Returns a handle with ``wait()``."""
    handle = _native("all_gather_into_tensor", group,
                     lambda: _ALL_GATHER(output, input, group=group, async_op=True), native)
    if handle is not None:
        return handle
    chunks = list(output.chunk(dist.get_world_size(group)))
    return dist.all_gather(chunks, input.clone(), group=group, async_op=True)
