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

*Transient storage* (:meth:`MainGradAdoption.want`, asked for by the whole step before its capture): the eager steps
before the capture would otherwise hold the whole buffer beside their activations, and the capture the buffer
beside its pool, one gradient's size above what plain PyTorch holds (4 bytes a parameter in fp32). So once a complete
backward has shown that only the engine's hooks write ``main_grad`` (no kernel that sets ``grad_added_to_main_grad``),
the buffer is freed and every zeroing makes each ``main_grad`` a *placeholder*, a zero expanded to its shape that
owns no memory (it reads as zeros; writing into it in place raises): the next backward adopts autograd's gradient as
the storage, as plain PyTorch's ``zero_grad(set_to_none=True)`` and ``AccumulateGrad`` do, and the capture's own
adoption then makes the graph's pool the home. :meth:`~MainGradAdoption.stop` (the whole step refused) puts every
``main_grad`` back into a restored buffer, values kept.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import protocol
from ..main_grad_adds import MainGradAdds
from .errors import GradSyncError


#: why a ``main_grad`` written by a kernel was a placeholder, and what to do (the end of the engine's errors)
TRANSIENT_WRITE = ("the run's first backward had no kernel that writes main_grad itself, so in one process, before the "
                   "whole step is captured, the gradient buffer was freed (docs/limitations.md). Use such a kernel "
                   "from the first step on, or set graphs.whole_step: false")


class MainGradAdoption:
    """The adoption state of one :class:`~.engine.DataParallelEngine`.

    Attributes:
        kept: the adopted storage is the ``main_grad`` home (after :meth:`keep`); no further adoption.
        mains: the ``main_grad`` tensors whose storage was adopted and kept.
        wanted: transient storage was asked for (:meth:`want`); ``proven``: a complete backward since then put every
            gradient into ``main_grad`` through the engine's hooks alone; ``transient``: the buffer is freed and each
            zeroing leaves placeholders (see the module docstring).
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.kept = False
        self.mains: List[torch.Tensor] = []
        self._pending: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.wanted = False
        self.proven = False
        self.transient = False
        self._eager: Optional[MainGradAdds] = None
        self._zeros: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}

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
        self.transient = self.wanted = False

    def undo(self) -> None:
        """Every ``main_grad`` back into the buffer it had before the adoptions not kept."""
        for main, before in reversed(self._pending):
            main.data = before
        self._pending = []

    # ----------------------------------------------------------------- transient storage
    def want(self) -> None:
        """Ask for transient storage where :meth:`possible`: the hooks' next complete backward is watched, and the
        first zeroing after it frees the buffer (see the module docstring)."""
        if self.wanted or not self.possible():
            return
        self.wanted = True
        for main in self.engine._main_grads:  # made now: never inside a capture, where it would live in its pool
            self._placeholder(main)
        self._watch()

    def _watch(self) -> None:
        """Hand the hooks this adoption's own additions for the next eager backward (unless one is open)."""
        e = self.engine
        if e.batched_adds is not None and e.batched_adds is not self._eager:
            return
        if self.transient:  # every main_grad is a placeholder: each first share becomes its storage
            self._eager = MainGradAdds(flush_bytes=0, fresh=e._main_grads, adopt=True)
        else:  # the buffer holds them: added at once, as without batching, and watched
            self._eager = MainGradAdds(flush_bytes=0)
        e.batched_adds = self._eager

    def backward_done(self) -> None:
        """After a complete backward (its additions settled): a watched one proves the hooks alone wrote."""
        e, adds = self.engine, self._eager
        if adds is None or e.batched_adds is not adds:
            return
        e.batched_adds = self._eager = None
        if not self.transient and not adds.outside:
            self.proven = all(id(m) in adds.queued for m in e._main_grads)

    def step_begins(self) -> None:
        """Before a step's forward, where transient storage is proven: the previous step's gradients (or the buffer)
        are released now rather than at the zeroing after the forward, so that the forward's activations never sit
        beside them (plain PyTorch's ``zero_grad(set_to_none=True)`` before the forward). Nothing where the adoption
        was kept (a replayed step writes in place) or not proven yet."""
        if self.wanted and not self.kept and (self.transient or self.proven):
            self.zeroed()

    def zeroed(self) -> bool:
        """At every zeroing of the engine (``zero_grad_buffer``): where transient storage is wanted and proven, every
        ``main_grad`` becomes a placeholder (the buffer is freed the first time) and the next backward is watched.
        Returns whether the ``main_grad`` are transient (nothing else to zero)."""
        if not self.wanted or self.kept:
            return False
        if not self.transient and self.proven and self.possible():
            self.transient = True
            for buf in self.engine.buffers_:
                buf.release()
        if self.transient:
            self._reset_zeros()
            for main in self.engine._main_grads:
                main.data = self._placeholder(main)
        self._watch()
        return self.transient

    def _placeholder(self, main: torch.Tensor) -> torch.Tensor:
        key = (main.dtype, main.device)
        zero = self._zeros.get(key)
        if zero is None:
            zero = self._zeros[key] = torch.zeros((), dtype=main.dtype, device=main.device)
        return zero.expand(main.shape)

    def explain(self, exc: BaseException) -> Optional[GradSyncError]:
        """The error to raise instead of ``exc``, raised by a backward: torch refusing an in-place write into a
        placeholder (a kernel that accumulates into ``main_grad`` itself, first used after the first step), or
        ``None``."""
        if not (self.transient and isinstance(exc, RuntimeError) and "single memory location" in str(exc)):
            return None
        return GradSyncError(f"the backward wrote into a main_grad in place ({str(exc).splitlines()[0]}) while it "
                             f"was a transient placeholder: {TRANSIENT_WRITE}")

    def _reset_zeros(self) -> None:
        """An in-place ``fill_`` into a placeholder (it passes torch's overlap check; ``add_`` and ``copy_`` do not)
        lands in the one zero behind all of them; Lightning's ``zero_grad(set_to_none=True)`` would have discarded
        it, so the zero is simply made zero again at each zeroing (one element a dtype), except while a stream captures
        (the graph would repeat it every replay, after which no placeholder is read)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        for zero in self._zeros.values():
            zero.zero_()

    def stop(self) -> None:
        """No transient storage any more: with the buffer restored, every ``main_grad`` views it again, holding the
        values it had (zeros for a placeholder). Nothing to do where the adoption was kept or never transient."""
        e = self.engine
        if e.batched_adds is not None and e.batched_adds is self._eager:
            e.batched_adds = None
        self._eager = None
        self.wanted = False
        if not self.transient:
            return
        self.transient = False
        for buf in e.buffers_:
            buf.restore()
        self._reset_zeros()
        with torch.no_grad():
            for main, view in zip(e._main_grads, e._buffer_views):
                view.copy_(main)  # a placeholder reads as zeros
                main.data = view
        e._buffer_ptrs = [v.data_ptr() for v in e._buffer_views]  # the restored memory lies elsewhere
