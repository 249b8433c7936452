"""Parameters without a gradient (``DDPOptions.find_unused_parameters``), as torch DDP treats them.

A parameter that reports no gradient in a backward counts as ready with a zero contribution
(:meth:`Bucket.settle_absent <cg_lightning.ddp.bucket.Bucket.settle_absent>`). After a synchronized backward, the
parameters that reported on no rank in that window keep ``param.grad`` as it was when the window began: ``None``
after ``zero_grad``, so an optimizer skips them (no weight decay, no momentum), as torch DDP leaves such a
parameter's gradient untouched (its reducer's ``local_used_map``, pytorch/pytorch ``reducer.cpp``).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .bucket import Bucket


class UnusedParameters:
    """Which parameters got a gradient in the current accumulation window, and which had none before it.

    Args:
        params: the engine's trainable parameters, in its order.
        slots: ``(bucket, slot)`` of each parameter; the buckets record reports in ``slot_used``.
    """

    def __init__(self, params: Sequence[nn.Parameter], slots: Sequence[Tuple[Bucket, int]]) -> None:
        self.params = list(params)
        self.slots = list(slots)
        self.grad_none: List[bool] = [True] * len(self.params)  # param.grad was None when the window began
        self._window_used: Optional[List[bool]] = None  # reported on any rank in the window just synchronized

    def window_starts(self, all_none: bool = False) -> None:
        """Before a backward that takes ``param.grad`` back into ``main_grad``: note which were ``None``."""
        self.grad_none = [True] * len(self.params) if all_none else [p.grad is None for p in self.params]

    def window_synchronized(self, group, world_size: int, device: torch.device) -> None:
        """After a synchronized backward: which parameters reported on any rank (one ``MAX`` all-reduce of a
        flag per parameter); the buckets' ``slot_used`` start over."""
        used = [bucket.slot_used[slot] for bucket, slot in self.slots]
        for bucket in {id(b): b for b, _ in self.slots}.values():
            bucket.clear_used()
        if world_size > 1 and used:
            flags = torch.tensor(used, dtype=torch.int32, device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            used = [bool(f) for f in flags.tolist()]
        self._window_used = used

    def hide_unused_grads(self) -> None:
        """Set ``param.grad = None`` where the parameter got no gradient in this window (on any rank after a
        synchronized backward; on this rank after an accumulation micro-batch) and had none when it began."""
        used = self._window_used
        self._window_used = None
        if used is None:
            used = [bucket.slot_used[slot] for bucket, slot in self.slots]
        for p, was_used, was_none in zip(self.params, used, self.grad_none):
            if not was_used and was_none:
                p.grad = None
