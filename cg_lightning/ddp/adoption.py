"""``main_grad`` storage adopted from autograd's own first gradient share, for one process under a graph of the
whole step.

A graph of the whole step leaves the buffer unfilled and copies each ``main_grad``'s first share in
(:mod:`cg_lightning.main_grad_adds`): 8 bytes moved a parameter a step. With one process nothing reads the buffer as
one tensor (no bucket is all-reduced), so the capture can instead let each first share, autograd's gradient tensor
allocated in the graph's memory pool, become the ``main_grad``'s storage: every replay writes the gradients where
the optimizer reads them, and no byte moves. After the capture the engine keeps the adopted storage as each
``main_grad``'s home (what it restores after ``param.grad.data = x``, what ``zero_grad_buffer`` zeroes), and a
buffer whose ``main_grad`` were all adopted gives its memory back. A failed capture puts every ``main_grad`` back
into the buffer. Megatron-LM saves the same bytes by fusing the accumulation into the weight-gradient GEMM
(``gradient_accumulation_fusion``); here no kernel changes, only where the gradient stays.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from .. import protocol


class MainGradAdoption:
    """The adoption state of one :class:`~.engine.DataParallelEngine`.

    Attributes:
        kept: the adopted storage is the ``main_grad`` home (after :meth:`keep`); no further adoption.
        mains: the ``main_grad`` tensors whose storage was adopted and kept.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.kept = False
        self.mains: List[torch.Tensor] = []
        self._pending: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def possible(self) -> bool:
        """One process, no sharded optimizer, no unused-parameter tracking, ``main_grad`` of the parameters' dtype,
        and nothing kept yet."""
        e = self.engine
        return (not self.kept and e.world_size == 1 and e.shards is None and e.unused is None
                and e._main_grads_same_dtype)

    def record(self, adopted: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``(main_grad, its storage before)`` pairs adopted by a backward (:class:`~cg_lightning.main_grad_adds.
        MainGradAdds`), to keep or undo."""
        self._pending.extend(adopted)

    def keep(self) -> None:
        """Make the adopted storage each ``main_grad``'s home; free every buffer whose ``main_grad`` were all adopted
        (its buckets are never all-reduced in one process)."""
        if not self._pending:
            return
        e = self.engine
        adopted = {id(m) for m, _ in self._pending}
        self.mains = [m for m in e._main_grads if id(m) in adopted]
        e._buffer_views = [m.detach() for m in e._main_grads]
        e._buffer_ptrs = [v.data_ptr() for v in e._buffer_views]
        for buf in e.buffers_:
            if all(id(protocol.main_grad(p)) in adopted for p, _ in buf.offsets):
                buf.release()
        self._pending = []
        self.kept = True

    def undo(self) -> None:
        """Every ``main_grad`` back into the buffer it had before the adoptions not kept."""
        for main, before in reversed(self._pending):
            main.data = before
        self._pending = []
