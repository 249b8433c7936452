"""Bucket all-reduce, issued strictly in bucket order, on a communication stream of its own.

A bucket's asynchronous all-reduce goes out as soon as it and every bucket before it are complete (all its
parameters reached their golden counts), so every rank issues the same sequence of collectives even when one
rank misses a gradient; the mismatch is then reported by the engine's ready check instead of pairing different
buckets. On CUDA with more than one process the all-reduce runs on its own stream, after the streams gradients
reach ``main_grad`` on: the training stream (graph replays, the optimizer) and the accumulator stream (the hooks
of eagerly computed gradients); a bucket is issued from a hook in the middle of the backward.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from .bucket import Bucket
from .options import DDPOptions


class BucketReducer:
    """Issues and waits for the all-reduce of an engine's buckets.

    Args:
        buckets: the engine's buckets, in index order.
        group: the process group to reduce over.
        world_size: the group's size (``1``: nothing is communicated, buckets are only marked dispatched).
        options: :class:`DDPOptions` (``average`` is read at every dispatch).
        device: the gradient buffers' device.
        grad_accumulator_stream: the stream the engine's hooks run on, or ``None``.

    Attributes:
        dispatch_log: bucket indices in dispatch order, this iteration.
        last_dispatch_order: the same for the last finished iteration.
    """

    def __init__(self, buckets: Sequence[Bucket], group, world_size: int, options: DDPOptions,
                 device: torch.device, grad_accumulator_stream: Optional["torch.cuda.Stream"] = None) -> None:
        self.buckets = buckets
        self.group = group
        self.world_size = world_size
        self.options = options
        self.dispatch_log: List[int] = []
        self.last_dispatch_order: List[int] = []
        self._next = 0
        #: called with the bucket before its all-reduce is started (queued main_grad additions are launched there)
        self.before_dispatch: Optional[Callable[[Bucket], None]] = None
        self._grad_streams: List["torch.cuda.Stream"] = []
        self._comm_stream: Optional["torch.cuda.Stream"] = None
        if device.type == "cuda" and world_size > 1:
            self._grad_streams = [torch.cuda.current_stream(device)]
            if grad_accumulator_stream is not None:
                self._grad_streams.append(grad_accumulator_stream)
            self._comm_stream = torch.cuda.Stream(device=device)

    def dispatch_ready_prefix(self) -> None:
        """Dispatch the complete buckets that follow the last dispatched one, up to the first incomplete one."""
        buckets = self.buckets
        while self._next < len(buckets) and buckets[self._next].complete:
            bucket = buckets[self._next]
            self._next += 1
            self.dispatch_log.append(bucket.index)
            if self.before_dispatch is not None:
                self.before_dispatch(bucket)
            if self._comm_stream is None:
                bucket.dispatch(self.group, self.world_size, self.options.average)
                continue
            with torch.cuda.stream(self._comm_stream):
                for stream in self._grad_streams:
                    self._comm_stream.wait_stream(stream)
                bucket.dispatch(self.group, self.world_size, self.options.average)

    def discard(self) -> None:
        """Forget this iteration's reports (a backward that failed part-way): started all-reduces are waited for,
        counts and the dispatch log start again; the last finished iteration's stay as they were."""
        for b in self.buckets:
            b.wait()
            last = b.slot_last
            b.reset()
            b.slot_last = last
        self._next = 0
        self.dispatch_log = []

    def finish(self) -> None:
        """Wait for every bucket's all-reduce and start a new iteration (counts reset, dispatch order kept in
        :attr:`last_dispatch_order`)."""
        for b in self.buckets:
            b.wait()
            b.reset()
        self._next = 0
        self.last_dispatch_order = self.dispatch_log
        self.dispatch_log = []
