"""The shard layout of ``ddp.distributed_optimizer``: each rank owns one equal slice of every gradient bucket.

A bucket of the engine's gradient buffer (:mod:`.buffer`; padded to a multiple of the world size) splits into
``world_size`` equal, contiguous shards; rank ``r`` owns the ``r``-th. The bucket's collective becomes a
reduce-scatter into that shard (:mod:`.collectives`), still issued from the grad-ready hooks as the bucket
completes, so that after the backward only this rank's shard of ``main_grad`` holds the averaged gradient (the rest
holds local sums, unused). The parameters move into a contiguous buffer per gradient buffer with the same layout
(``param.data`` becomes a view into it, before the engine's hooks are made and before any graph is captured), so
that a rank updates its shard of the parameters in place and one in-place all-gather per bucket gives every rank
the updated parameters (Megatron-LM's distributed optimizer: ``param_and_grad_buffer.py``, ``distrib_optimizer.py``).

A :class:`Piece` is the part of one parameter inside this rank's shard: the unit of optimizer state.
"""

from __future__ import annotations

from typing import List, NamedTuple

import torch
import torch.nn as nn

from .buffer import GradBuffer
from .collectives import all_gather, reduce_scatter


class Piece(NamedTuple):
    """Elements ``[start, end)`` of ``param.view(-1)``, held by this rank; ``offset``: where ``start`` lies in its
    buffer (the same in the gradient and the parameter buffer); ``buffer``: the buffer's index in the layout."""

    param: nn.Parameter
    start: int
    end: int
    buffer: int
    offset: int


class ShardLayout:
    """This rank's shard of every bucket of ``buffers``, and the parameters moved into buffers of their layout.

    Args:
        buffers: the engine's gradient buffers, built with ``pad_to=world_size``, each over parameters of one
            dtype (their ``main_grad`` views are set; their buckets get a reduce-scatter as :attr:`Bucket.reduce`).
        group: the process group (``None``: one process).
        rank, world_size: this process in ``group``.

    Attributes:
        param_data: one flat tensor per gradient buffer, the parameters' storage (``param.data`` views it).
        pieces: this rank's pieces, in buffer order (bucket by bucket).
        shard_numel: elements this rank owns, padding included (``sum(bucket length) / world_size``).
    """

    def __init__(self, buffers: List[GradBuffer], group, rank: int, world_size: int) -> None:
        self.buffers = buffers
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.param_data: List[torch.Tensor] = []
        self.pieces: List[Piece] = []
        self.shard_numel = 0
        self._gathers: List[tuple] = []  # (full bucket of param_data, this rank's shard of it)
        with torch.no_grad():
            for index, buf in enumerate(buffers):
                self._move_params(buf)
                for bucket, (start, end) in zip(buf.buckets, buf.bucket_ranges):
                    size = (end - start) // world_size
                    lo = start + rank * size
                    self.shard_numel += size
                    bucket.reduce = self._reducer(bucket.data, rank * size, size)
                    full = self.param_data[index][start:end]
                    self._gathers.append((full, full[rank * size : (rank + 1) * size]))
                    for p, offset in buf.offsets:
                        a, b = max(offset, lo), min(offset + p.numel(), lo + size)
                        if start <= offset < end and a < b:
                            self.pieces.append(Piece(p, a - offset, b - offset, index, a))

    def _move_params(self, buf: GradBuffer) -> None:
        dtypes = {p.dtype for p, _ in buf.offsets}
        if len(dtypes) != 1:
            raise ValueError(f"a sharded gradient buffer holds parameters of several dtypes: {sorted(map(str, dtypes))}")
        data = torch.zeros(buf.data.numel(), dtype=dtypes.pop(), device=buf.data.device)
        for p, offset in buf.offsets:
            view = data[offset : offset + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
        self.param_data.append(data)

    @staticmethod
    def _reducer(data: torch.Tensor, start: int, size: int):
        shard = data[start : start + size]
        return lambda full, group: reduce_scatter(shard, full, group)

    def grad_shard(self, piece: Piece) -> torch.Tensor:
        """``piece``'s elements of the gradient buffer (1-D view; after the reduce-scatter: the averaged gradient)."""
        return self.buffers[piece.buffer].data[piece.offset : piece.offset + piece.end - piece.start]

    def param_shard(self, piece: Piece) -> torch.Tensor:
        """``piece``'s elements of the parameter buffer (1-D view of the parameter itself)."""
        return self.param_data[piece.buffer][piece.offset : piece.offset + piece.end - piece.start]

    def start_gather(self, bucket: int):
        """Start the in-place all-gather of bucket number ``bucket`` (the engine's bucket index) of the parameter
        buffers: every rank's updated shard into every rank's parameters. Returns the collective's handle."""
        full, shard = self._gathers[bucket]
        return all_gather(full, shard, self.group)

    def gather_params(self) -> None:
        """:meth:`start_gather` of every bucket, all started before the first is waited for (the overlapped form is
        :class:`~.param_gather.ParamGather`). Nothing to do in one process."""
        if self.world_size == 1:
            return
        handles = [self.start_gather(i) for i in range(len(self._gathers))]
        for handle in handles:
            handle.wait()
