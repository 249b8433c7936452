"""Contiguous gradient buffers: one flat tensor per gradient dtype, ``param.main_grad`` views into it."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from ..protocol import set_main_grad
from .bucket import Bucket


#: where each parameter's ``main_grad`` starts in the buffer: the alignment of CUDA's vectorized 16-byte loads
ALIGN_BYTES = 16


class GradBuffer:
    """One flat gradient buffer for the parameters of one ``main_grad`` dtype.

    Parameters are laid out in *reverse* order, so the buffer fills from its start as the backward walks
    the model from the last layer to the first, and buckets (contiguous slices of at most
    ``bucket_size_bytes``; a parameter never spans two) become ready in order (Megatron-LM's layout). Each
    parameter starts at a multiple of :data:`ALIGN_BYTES`, as a gradient tensor of its own would: CUDA's multi-tensor
    kernels take their vectorized path only for aligned tensors, and the norm ``clip_grad_norm_`` takes through them
    sums in another order on the other path (a gradient after a 1-element bias came out 1 ulp off torch DDP's).

    Args:
        params: parameters in forward (``module.parameters()``) order.
        dtype: gradient dtype.
        device: buffer device.
        bucket_size_bytes: bucket capacity in bytes.
        first_bucket_index: index of this buffer's first bucket in the engine's list.
        pad_to: each bucket's length is rounded up to a multiple of this (zeros that no parameter views).

    After construction every parameter has ``param.main_grad`` (same shape, ``dtype``), zeroed.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        dtype: torch.dtype,
        device: torch.device,
        bucket_size_bytes: int,
        first_bucket_index: int = 0,
        pad_to: int = 1,
    ) -> None:
        self.dtype = dtype
        ordered = list(reversed(params))
        element = torch.empty((), dtype=dtype).element_size()
        #: ``(param, offset)`` in buffer order; ``bucket_ranges``: ``(start, end)`` of each bucket, padded so that
        #: its length is a multiple of ``pad_to`` (``ddp.distributed_optimizer``: a bucket splits into equal shards)
        self.offsets: List[Tuple[torch.nn.Parameter, int]] = []
        self.bucket_ranges: List[Tuple[int, int]] = []
        groups: List[List[torch.nn.Parameter]] = []
        offset = bucket_start = 0
        bucket_params: List[torch.nn.Parameter] = []
        align = max(1, ALIGN_BYTES // element)
        for i, p in enumerate(ordered):
            offset += -offset % align  # zeros that no parameter views
            self.offsets.append((p, offset))
            offset += p.numel()
            bucket_params.append(p)
            if (offset - bucket_start) * element >= bucket_size_bytes or i == len(ordered) - 1:
                offset += -(offset - bucket_start) % pad_to
                self.bucket_ranges.append((bucket_start, offset))
                groups.append(bucket_params)
                bucket_params, bucket_start = [], offset
        self.data = torch.zeros(offset, dtype=dtype, device=device)
        self.released = False
        for p, start in self.offsets:
            set_main_grad(p, self.data[start : start + p.numel()].view_as(p))
        self.buckets: List[Bucket] = []
        for group, (start, end) in zip(groups, self.bucket_ranges):
            self._close_bucket(group, start, end, first_bucket_index)

    def _close_bucket(self, params, start: int, end: int, first_index: int) -> None:
        self.buckets.append(Bucket(first_index + len(self.buckets), list(params), self.data[start:end]))

    def zero_(self) -> None:
        if not self.released:
            self.data.zero_()

    def release(self) -> None:
        """Free the buffer's memory (no ``main_grad`` views it any more: :mod:`.adoption`); its buckets' views are
        left without storage, which one process never reads."""
        self.data.untyped_storage().resize_(0)
        self.released = True

    def restore(self) -> None:
        """Memory for the buffer again after :meth:`release`, zeroed; its views and buckets read it again."""
        if self.released:
            self.data.untyped_storage().resize_(self.data.numel() * self.data.element_size())
            self.data.zero_()
            self.released = False
