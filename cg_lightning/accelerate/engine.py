"""``GraphedDataParallel``: the DDP engine with the graph manager and the step points an Accelerate loop has.

Under Lightning, :class:`~cg_lightning.CUDAGraphDDPStrategy` is told where a training micro-batch starts
(``training_step``), where its backward ends (``post_backward``) and when the optimizer stepped. An
Accelerate script calls ``model(...)``, ``accelerator.backward(loss)``, ``optimizer.step()`` and
``optimizer.zero_grad()`` instead; this engine turns those calls into the same events:

* **micro-batch start**: the first forward with autograd enabled since the last backward calls
  ``GraphManager.begin_step(steps)``. Every forward until the backward belongs to that
  micro-batch, so a layer called twice gets call indices 0 and 1, as in one ``training_step``.
* **backward** (driven by :meth:`CUDAGraphAccelerator.backward
  <cg_lightning.accelerate.CUDAGraphAccelerator.backward>`): :meth:`start_backward` ends the micro-batch
  (``end_step``); after autograd, :meth:`finish_backward` waits for the buckets (unless under
  :meth:`no_sync`) and points ``param.grad`` at ``main_grad``, for clipping and the optimizer on the
  micro-batch that completes an optimizer step and, as plain PyTorch has it, on the others too.
* **step count**: every micro-batch whose backward ran with Accelerate's ``sync_gradients`` completes one
  optimizer step;
  their number is the manager's global step (as Lightning's ``global_step``), so the schedule does not
  depend on the optimizer being prepared.
* **zero_grad**: the prepared optimizer's ``zero_grad`` calls :meth:`zero_grad_buffer`. Gradients
  dropped or replaced in ``param.grad`` by other means (a raw optimizer's ``zero_grad``) are carried
  into ``main_grad`` before the next backward, so the result is what eager PyTorch computes.

Imports only torch and the project's engine; the Accelerate glue lives in ``accelerator.py``.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.nn as nn

from .. import protocol
from ..ddp import DataParallelEngine, DDPOptions
from ..graphs import GraphManager, GraphStats

_GRAD = operator.attrgetter("grad")


class GraphedDataParallel(DataParallelEngine):
    """:class:`~cg_lightning.ddp.DataParallelEngine` that drives a :class:`~cg_lightning.graphs.GraphManager`.

    Args:
        module: the model, already on its device (with Accelerate's autocast forward, if any). Its
            trainable parameters get ``param.main_grad``; parameters and buffers are broadcast from
            rank 0.
        options: :class:`~cg_lightning.ddp.DDPOptions` (bucket size in MiB, averaging, ``main_grad``
            dtype, timeout in seconds).
        graph_manager: a manager already installed on ``module``'s layers, built with
            ``accumulate_into_main_grad=True``; ``None`` trains eagerly through the same engine.

    Attributes:
        graph_manager: the manager, or ``None``.
        steps: optimizer steps completed so far (int): micro-batches whose backward ran with
            ``sync_gradients``. Graphs are scheduled by it (capture happens in the first micro-batch with
            ``steps >= warmup_steps``).
        micro_batch_open: a forward with autograd enabled ran and its backward has not started yet.
        grads_exposed: ``param.grad`` currently points at ``main_grad`` (after every ``accelerator.backward``
            until ``zero_grad``; see :meth:`finish_backward`).

    Raises:
        GradSyncError: from :meth:`finish_backward`, when a parameter did not report its gradient (see
            :class:`~cg_lightning.ddp.DataParallelEngine`).
        RuntimeError: from :meth:`check_ready_for_step`, when the backward did not go through
            ``accelerator.backward``.
    """

    def __init__(
        self,
        module: nn.Module,
        options: Optional[DDPOptions] = None,
        graph_manager: Optional[GraphManager] = None,
    ) -> None:
        backend = graph_manager.backend if graph_manager is not None else None
        super().__init__(module, options, grad_accumulator_stream=getattr(backend, "stream", None))
        self.graph_manager = graph_manager
        if graph_manager is not None:
            graph_manager.bind_grad_ready(self.grad_ready)
        self.steps = 0
        self.micro_batch_open = False
        # the last backward through accelerator.backward completed an optimizer step, and the optimizer has not
        # stepped since (what check_ready_for_step asks for)
        self._step_backward_done = False
        # armed by CUDAGraphAccelerator.backward only: a backward outside it (through accelerator.unwrap_model's
        # model, or after training) fills param.grad as plain PyTorch does
        self.hooks_armed = False
        #: a forward ran whose micro-batch no backward has reached yet (CUDAGraphAccelerator.backward): a GAN's
        #: generator, whose detached output fed the discriminator's loss, waits for the generator's loss
        self.backward_pending = False

    @property
    def graph_stats(self) -> Optional[GraphStats]:
        """The manager's counters (captured runners, replays, eager calls, capture seconds), or ``None``."""
        return self.graph_manager.stats if self.graph_manager is not None else None

    def forward(self, *args, **kwargs):
        """Open a micro-batch at the first forward with autograd since the last backward, then the engine's
        forward (buffers broadcast from rank 0 when due, ``ddp.broadcast_buffers``; then the module)."""
        if not self.micro_batch_open and torch.is_grad_enabled():
            self.micro_batch_open = True
            if self.graph_manager is not None:
                self.graph_manager.begin_step(self.steps)
        return super().forward(*args, **kwargs)

    # ----------------------------------------------------------------- backward
    def start_backward(self) -> bool:
        """Close the micro-batch before autograd runs; return whether one was open.

        If gradients are still exposed (no ``zero_grad`` through the prepared optimizer or model since the
        last step), ``param.grad`` is taken back into ``main_grad`` first, as eager PyTorch would keep
        accumulating into it: ``None`` (zeroed with ``set_to_none``) zeroes ``main_grad``, another tensor is
        copied in, the alias itself keeps its values. Then ``param.grad`` is dropped, since autograd would
        otherwise add into ``main_grad`` in place and the hook would add the same gradient again.

        If they are not exposed, ``param.grad`` set anyway came from a backward outside
        ``accelerator.backward`` (through ``accelerator.unwrap_model(model)``, which fills ``param.grad`` as plain
        PyTorch does): it is added into ``main_grad`` and dropped, so this backward accumulates onto it as plain
        PyTorch would, for graphed and eager parameters alike.
        """
        was_open = self.micro_batch_open or self.backward_pending
        self.micro_batch_open = False
        self.backward_pending = False
        self.reached = False
        if self.graph_manager is not None:
            self.graph_manager.end_step()
        if self.grads_exposed:
            self.take_back_grads()
        else:
            self._carry_outside_grads()
        return was_open

    def _carry_outside_grads(self) -> None:
        grads = list(map(_GRAD, self.params))
        if grads.count(None) == len(grads):  # the usual case, checked without a Python loop
            return
        with torch.no_grad():
            for p, g in zip(self.params, grads):
                if g is not None:
                    protocol.main_grad(p).add_(g)
                    p.grad = None

    def finish_backward(self, completes_step: bool) -> None:
        """After autograd: wait for the buckets (unless under :meth:`no_sync`), then point ``param.grad`` at
        ``main_grad``, as plain PyTorch holds the sum so far in ``param.grad`` after every backward: on an
        accumulation micro-batch too (the local, not yet all-reduced sum), so clipping, scaling or reading it
        there works as without the engine. Only where ``ddp.grad_dtype`` differs from the parameters' dtype
        (``param.grad`` would be a cast copy, which :meth:`take_back_grads` could not carry back exactly) are
        accumulation micro-batches left with ``param.grad`` ``None``.

        Args:
            completes_step: the micro-batch completes an optimizer step (counted in :attr:`steps`).
        """
        if self.sync_enabled:
            self.finish_grad_sync()
        self.expose_after_backward(completes_step)
        self._step_backward_done = completes_step
        if completes_step:
            self.steps += 1

    # ----------------------------------------------------------------- optimizer
    def check_ready_for_step(self) -> None:
        """Raise if a forward's backward did not go through ``accelerator.backward`` (no grads exposed)."""
        if self.micro_batch_open and not self._step_backward_done:
            raise RuntimeError(
                "cg_lightning: the optimizer steps while a forward's backward has not gone through "
                "accelerator.backward(loss). With CUDAGraphAccelerator call accelerator.backward(loss) "
                "instead of loss.backward(): it finishes the gradient all-reduce and points param.grad at "
                "param.main_grad."
            )

    def after_optimizer_step(self) -> None:
        """Close a micro-batch left open by a forward after the backward (the next forward starts a new one)."""
        self._step_backward_done = False
        if self.micro_batch_open:
            self.micro_batch_open = False
            if self.graph_manager is not None:
                self.graph_manager.end_step()

    def covers_all(self, params) -> bool:
        """Whether ``params`` (an optimizer's) include every trainable parameter of this engine: its
        ``zero_grad`` may then zero the whole buffer (:meth:`zero_grad_buffer`). An optimizer over a part only
        zeroes its own ``param.grad`` (``set_to_none`` drops the alias, and :meth:`start_backward` then zeroes
        those ``main_grad`` views before the next backward), so another optimizer's gradients survive until its
        own step, as with plain PyTorch."""
        ids = {id(p) for p in params}
        return all(id(p) in ids for p in self.params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad`` that also zeroes ``main_grad`` (where the gradients really are)."""
        super().zero_grad(set_to_none)
        self.zero_grad_buffer()

    def remove_graphs(self) -> None:
        """Restore the graphed layers' own ``forward`` and drop the graphs (the engine keeps working)."""
        if self.graph_manager is not None:
            self.graph_manager.remove()

    def release(self) -> None:
        """Give the model back as if never prepared: graphs removed, the engine's hooks removed (a later
        ``backward`` fills ``param.grad`` again), ``param.grad`` no longer pointing at ``main_grad``, and
        Accelerate's "prepared" mark taken off the model, so ``prepare`` wraps it again. Called by
        ``CUDAGraphAccelerator.free_memory`` and ``end_training``; the engine must not be used afterwards."""
        self.remove_graphs()
        if self.grads_exposed:
            had_grad = [p.grad is not None for p in self.params]  # None stays None, as plain PyTorch leaves it
            self.take_back_grads()
            for p, keep in zip(self.params, had_grad):
                if keep:
                    main = protocol.main_grad(p)
                    p.grad = main.detach().clone() if main.dtype is p.dtype else main.to(p.dtype)
        self.close()
        self.module.__dict__.pop("_is_accelerate_prepared", None)
