"""``param.grad`` and ``main_grad`` between backwards: what the optimizer, clipping and the user see, and how what
they did is carried back before the next backward.

Part of :class:`~.engine.DataParallelEngine` (a base class of it): after the gradient sync the engine points
``param.grad`` at ``main_grad`` (:meth:`GradExposure.expose_grads`), and before the next backward it makes
``main_grad`` what ``param.grad`` says then (:meth:`GradExposure.take_back_grads`), so accumulation, clipping,
scaling, ``zero_grad`` and replaced gradients give what eager PyTorch computes.
"""

from __future__ import annotations

import operator
from collections import deque
from itertools import repeat

import torch

from .. import protocol
from ..torch_compat import foreach_zero_

_DATA_PTR = torch.Tensor.data_ptr
_GRAD = operator.attrgetter("grad")


class GradExposure:
    """The engine's gradient hand-over (see the module docstring). Uses the engine's ``params``, ``buffers_``,
    ``unused``, ``grads_exposed`` and the ``main_grad`` views it made (``_main_grads``, ``_buffer_views``,
    ``_buffer_ptrs``, ``_main_grads_same_dtype``)."""

    def expose_grads(self) -> None:
        """Point ``param.grad`` at ``main_grad`` (a cast copy if dtypes differ) for optimizers and clipping.

        Every step; while every ``main_grad`` is still the view the engine made and has its parameter's dtype
        (the usual case), in C-level ``map`` calls rather than a Python loop over the parameters. With
        ``ddp.find_unused_parameters``, parameters without a gradient in this window keep ``None``
        (:mod:`.unused`)."""
        self._point_grads_at_main()
        if self.unused is not None:
            self.unused.hide_unused_grads()

    def _point_grads_at_main(self) -> None:
        params, mains = self.params, self._main_grads
        self.grads_exposed = True
        if self._main_grads_same_dtype and all(map(operator.is_, map(protocol.MAIN_GRAD, params), mains)):
            try:
                deque(map(setattr, params, repeat("grad"), mains), maxlen=0)
                return
            except RuntimeError:  # a parameter's dtype changed since setup (module.to(dtype)): cast below
                pass
        for p in params:
            g = protocol.main_grad(p)
            p.grad = g if g.dtype is p.dtype else g.to(p.dtype)

    def expose_after_backward(self, completes_step: bool) -> None:
        """:meth:`expose_grads` after a backward: always on the micro-batch that completes an optimizer step; on
        the others (the sum so far, as plain PyTorch holds it in ``param.grad``) only when ``param.grad`` is the
        ``main_grad`` tensor itself (the gradient dtype is the parameters'), so that what a user does to it
        before the next backward (clip, scale, zero, replace) can be carried back exactly by
        :meth:`take_back_grads`; a cast copy could not be."""
        if completes_step or self._main_grads_same_dtype:
            self.expose_grads()

    def take_back_grads(self) -> None:
        """Before a backward, if gradients are still exposed: make ``main_grad`` what ``param.grad`` says now,
        then drop ``param.grad``, so the backward accumulates onto what eager PyTorch would accumulate onto.

        ``param.grad`` is ``None`` (zeroed with ``set_to_none``): ``main_grad`` is zeroed; another tensor
        (replaced by the user): copied in; ``main_grad`` itself: kept, with whatever was done to it in place
        (clipping, scaling). Dropping ``param.grad`` matters: autograd would otherwise add into ``main_grad``
        in place and the engine's hook would add the same gradient again.
        """
        if not self.grads_exposed:
            return
        if all(map(operator.is_, map(_GRAD, self.params), repeat(None))):  # zero_grad(set_to_none=True)
            self.zero_grad_buffer()  # one fill a buffer instead of one a parameter
            return
        if self.adoption.transient:  # a gradient set since zero_grad, to accumulate onto: the buffer back for good
            self.adoption.stop()
        self._reattach_main_grads(keep_values=True)
        if self.unused is not None:
            self.unused.window_starts()
        with torch.no_grad():
            for p in self.params:
                g = p.grad
                main = protocol.main_grad(p)
                if g is None:
                    main.zero_()
                elif g is not main:
                    main.copy_(g)
                p.grad = None
        self.grads_exposed = False

    def zero_grad_buffer(self, fill: bool = True) -> None:
        """Zero every ``main_grad`` and drop ``param.grad`` (after the optimizer step). ``fill=False``: everything
        but the fill, for a backward run under :meth:`grad_adds_batched` with ``fresh``, which stands for it. Transient
        storage (:mod:`.adoption`): every ``main_grad`` becomes a zero placeholder, fill or not."""
        if not self.adoption.zeroed():
            for buf in self.buffers_ if fill else ():
                buf.zero_()
            if fill and self.adoption.mains:  # storage adopted from autograd (:mod:`.adoption`)
                foreach_zero_(self.adoption.mains)
            self._reattach_main_grads(keep_values=False)
        for p in self.params:
            p.grad = None
            protocol.set_grad_added(p, False)
        self.grads_exposed = False
        if self.unused is not None:
            self.unused.window_starts(all_none=True)

    def _reattach_main_grads(self, keep_values: bool) -> None:
        """Point every ``main_grad`` back into the gradient buffer if its storage was swapped (``param.grad.data =
        x`` while ``param.grad`` is ``main_grad``), first copying its values there if ``keep_values``. Otherwise
        the buffer that graphs add into, that is all-reduced and zeroed, would no longer be the one the hooks and
        the optimizer see. One C-level pass over the data pointers in the usual case. Not for transient storage
        (:mod:`.adoption`), which has no home to go back to."""
        if self.adoption.transient or list(map(_DATA_PTR, self._main_grads)) == self._buffer_ptrs:
            return
        with torch.no_grad():
            for main, view in zip(self._main_grads, self._buffer_views):
                if main.data_ptr() != view.data_ptr():
                    if keep_values:
                        view.copy_(main)
                    main.data = view
