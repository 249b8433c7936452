"""Contiguous gradient buffers: one flat tensor per gradient dtype, ``param.main_grad`` views into it."""

from __future__ import annotations

from typing import List, Sequence

import torch

from ..protocol import set_main_grad
from .bucket import Bucket


class GradBuffer:
    """One flat gradient buffer for the parameters of one ``main_grad`` dtype.

    Parameters are laid out in *reverse* order, so the buffer fills from its start as the backward walks
    the model from the last layer to the first, and buckets (contiguous slices of at most
    ``bucket_size_bytes``; a parameter never spans two) become ready in order (Megatron-LM's layout).

    Args:
        params: parameters in forward (``module.parameters()``) order.
        dtype: gradient dtype.
        device: buffer device.
        bucket_size_bytes: bucket capacity in bytes.
        first_bucket_index: index of this buffer's first bucket in the engine's list.

    After construction every parameter has ``param.main_grad`` (same shape, ``dtype``), zeroed.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        dtype: torch.dtype,
        device: torch.device,
        bucket_size_bytes: int,
        first_bucket_index: int = 0,
    ) -> None:
        self.dtype = dtype
        ordered = list(reversed(params))
        total = sum(p.numel() for p in ordered)
        self.data = torch.zeros(total, dtype=dtype, device=device)
        self.buckets: List[Bucket] = []
        element = torch.empty((), dtype=dtype).element_size()
        offset = 0
        bucket_params: List[torch.nn.Parameter] = []
        bucket_start = 0
        for p in ordered:
            n = p.numel()
            set_main_grad(p, self.data[offset : offset + n].view_as(p))
            offset += n
            bucket_params.append(p)
            if (offset - bucket_start) * element >= bucket_size_bytes:
                self._close_bucket(bucket_params, bucket_start, offset, first_bucket_index)
                bucket_params, bucket_start = [], offset
        if bucket_params:
            self._close_bucket(bucket_params, bucket_start, offset, first_bucket_index)

    def _close_bucket(self, params, start: int, end: int, first_index: int) -> None:
        self.buckets.append(Bucket(first_index + len(self.buckets), list(params), self.data[start:end]))

    def zero_(self) -> None:
        self.data.zero_()
