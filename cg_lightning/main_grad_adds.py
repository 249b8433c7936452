"""Adding a backward graph's parameter gradients into ``main_grad``, batched into few multi-tensor kernels.

A backward body ends with ``main_grad += gradient`` for each of its parameters (fp32, the parameter's shape).
One ``torch._foreach_add_`` per layer does that in one launch, but at small sizes one layer's gradients are
too few elements to fill the GPU: on an H200 at the benchmark's tiny size (d=256, 12 parameters and about
0.8 M elements per block) each such kernel took about 16 us where the bytes moved need about 2 us.
Inside a segment (one backward graph for several layers, nothing
observes ``main_grad`` between its members) the additions can wait: :class:`MainGradAdds` keeps them and
launches them together, when the pending gradients reach ``flush_bytes`` or at the end of the segment's
backward body.

Exactness: each ``main_grad`` still gets the same additions in the same order (a ``main_grad`` that is
already pending is flushed first, so no multi-tensor kernel holds it twice and the later share is added
after the earlier one), so the results are bit-identical to one ``add_`` per parameter right away. What
it costs: the pending gradients stay allocated until the flush (at most ``flush_bytes`` plus one layer's).

Only a member's own parameters wait. A share that a nested recomputation left for a parameter of another
module (a *foreign* parameter) goes in at once (:meth:`MainGradAdds.add` with ``defer=False``): an earlier
member may write that parameter's ``main_grad`` itself, in its backward (a fused weight-gradient kernel that
accumulates into ``main_grad``, Megatron-LM's gradient-accumulation fusion), and eager training adds the
nested share before that write (adding it later ends 3.7e-9 apart after 8 steps with accumulation).
A member's own parameter cannot be written by another member: a parameter two graphed calls reach is summed
through autograd and never queued, and a layer whose outputs depend on a parameter it neither owns nor
recomputes is refused at capture.

*Copied first shares* (``fresh``): where every ``main_grad`` would be zeroed just before (a graph of the whole
step zeroes the buffer and then runs the backward), the first share of each is copied in instead of added, and
the fill is left out: ``0 + g`` is ``g`` in IEEE arithmetic (only a ``-0.0`` share stays ``-0.0``, as torch
DDP's copy into its bucket leaves it), so the values are the same while the bytes moved per parameter drop from
16 (a fill, then a read-read-write addition) to 8. A ``main_grad`` that gets no share is zeroed by
:meth:`MainGradAdds.settle` before anything reads it.

*Adopted first shares* (``adopt``, with ``fresh``): the first share itself becomes the ``main_grad``'s storage
(``main_grad.data = share``), so no byte moves at all; a later share is added onto it. The share is autograd's own
gradient tensor, which nothing else holds once the hook has dropped ``param.grad``. A first share that cannot be the
storage (another dtype, not contiguous, not 16-byte aligned) is copied into a new tensor of the ``main_grad``'s own,
and a fresh ``main_grad`` that got no share gets new zeros: every fresh ``main_grad`` ends with storage of its own,
so the buffer it viewed is not written (it may have been released: :mod:`cg_lightning.ddp.adoption`). Only where
nothing reads the buffer as one tensor (one process: no bucket is all-reduced): :meth:`DataParallelEngine.
grad_adds_batched <cg_lightning.ddp.engine.DataParallelEngine.grad_adds_batched>` and the engine's adoption state
decide, and keep or undo the adoption.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

from .torch_compat import foreach_add_, foreach_copy_, foreach_zero_

#: default bound on the bytes of gradients kept pending (the tiny benchmark's 12 blocks need 36 MB)
FLUSH_BYTES = 64 * 2**20


class MainGradAdds:
    """Pending ``main_grad += gradient`` additions, launched by :meth:`flush` as one ``torch._foreach_add_``.

    Args:
        flush_bytes: flush as soon as the pending gradients hold at least this many bytes; 0 flushes at every
            :meth:`add` (one kernel per call, the per-layer behaviour).
        fresh: ``main_grad`` tensors whose values are to be taken as zero (left unfilled): the first share of
            each is copied in rather than added; :meth:`settle` zeroes those that got none.
        adopt: a fresh ``main_grad``'s first share becomes its storage where it can (same shape, dtype and device,
            contiguous, aligned), else a copy of it does; one without a share gets new zeros (:meth:`settle`).

    Attributes:
        queued: ids of the ``main_grad`` tensors that got at least one share through :meth:`add`.
        adopted: ``(main_grad, its storage before)`` of every ``main_grad`` given storage of its own, in order.
        outside: some ``main_grad`` was written by something other than :meth:`add` (:meth:`written_outside`).
    """

    def __init__(self, flush_bytes: int = FLUSH_BYTES, fresh: Sequence[torch.Tensor] = (), adopt: bool = False) -> None:
        self.flush_bytes = flush_bytes
        self._mains: List[torch.Tensor] = []
        self._addends: List[torch.Tensor] = []
        self._copy_into: List[torch.Tensor] = []
        self._copied: List[torch.Tensor] = []
        self._pending: Set[int] = set()
        self._bytes = 0
        self._fresh: Dict[int, torch.Tensor] = {id(m): m for m in fresh}
        self.queued: Set[int] = set()
        self.adopt = adopt
        self.adopted: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.outside = False

    def add(self, mains: Sequence[torch.Tensor], addends: Sequence[torch.Tensor], defer: bool = True) -> None:
        """Queue ``mains[i] += addends[i]`` (same shapes; ``mains`` fp32 ``main_grad`` buffers), in order.

        ``defer=False``: launch these additions now, together with whatever is pending (nothing is launched
        when ``mains`` is empty).
        """
        for main, addend in zip(mains, addends):
            key = id(main)
            if key in self._pending:  # a second share of the same main_grad: the first goes in first
                self.flush()
            if self._fresh.pop(key, None) is not None:
                if self.adopt:  # storage of its own: the share itself, else a copy of it
                    own = addend if _adoptable(main, addend) else _copy_as(main, addend)
                    self.adopted.append((main, main.data))
                    main.data = own
                    self.queued.add(key)
                    continue
                self._copy_into.append(main)
                self._copied.append(addend)
            else:
                self._mains.append(main)
                self._addends.append(addend)
            self._pending.add(key)
            self.queued.add(key)
            self._bytes += addend.numel() * addend.element_size()
        if self._bytes >= self.flush_bytes or (mains and not defer):
            self.flush()

    def flush(self) -> List[torch.Tensor]:
        """Launch the pending additions (none pending: nothing launched). Returns ``[]``, so that it can be a
        segment member's body with no outputs."""
        if self._copy_into:
            foreach_copy_(self._copy_into, self._copied)
        if self._mains:
            foreach_add_(self._mains, self._addends)
        self._mains, self._addends, self._pending, self._bytes = [], [], set(), 0
        self._copy_into, self._copied = [], []
        return []

    def is_fresh(self, main: torch.Tensor) -> bool:
        """Whether ``main`` is still taken as zero without holding zeros (a fresh one that got no share yet)."""
        return id(main) in self._fresh

    def written_outside(self, main: torch.Tensor) -> bool:
        """Note that ``main`` was written without :meth:`add` (a kernel that sets ``grad_added_to_main_grad``, a graph
        replay); returns whether it was fresh then (it was written onto values that were never zeroed)."""
        self.outside = True
        return self.is_fresh(main)

    def settle(self, mains: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Launch the pending additions, then zero those of ``mains`` (default: all) still fresh, so that they
        hold what they stand for: before a bucket's all-reduce reads them, and at the end of the backward."""
        self.flush()
        keys = list(self._fresh) if mains is None else [id(m) for m in mains if id(m) in self._fresh]
        if not keys:
            return
        if not self.adopt:
            foreach_zero_([self._fresh.pop(k) for k in keys])
            return
        for k in keys:
            main = self._fresh.pop(k)
            self.adopted.append((main, main.data))
            main.data = torch.zeros(main.shape, dtype=main.dtype, device=main.device)


#: where an adopted share must start: what the engine's buffer guarantees every ``main_grad`` (``ddp.buffer``)
_ALIGN_BYTES = 16


def _adoptable(main: torch.Tensor, share: torch.Tensor) -> bool:
    return (share.shape == main.shape and share.dtype == main.dtype and share.device == main.device
            and share.is_contiguous() and share.data_ptr() % _ALIGN_BYTES == 0)


def _copy_as(main: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``main``'s shape, dtype and device holding ``share`` (cast where the dtypes differ)."""
    own = torch.empty(main.shape, dtype=main.dtype, device=main.device)
    own.copy_(share)
    return own
