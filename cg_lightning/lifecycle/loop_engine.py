"""``GraphedDataParallel``: the DDP engine that turns the calls of a loop the user writes into the lifecycle's events.

Under the Lightning Trainer, :class:`~cg_lightning.CUDAGraphDDPStrategy` maps Lightning's hooks onto a
:class:`~cg_lightning.lifecycle.TrainingDriver`. An Accelerate or Fabric script calls ``model(...)``, the front
end's backward (``accelerator.backward(loss)``, ``fabric.backward(loss)``), ``optimizer.step()`` and
``optimizer.zero_grad()`` instead; this engine owns a driver and maps those calls onto the same events:

* **micro-batch start**: the first forward with autograd enabled since the last backward calls
  ``begin_micro_batch(steps)``. Every forward until the backward belongs to that micro-batch, so a layer
  called twice gets call indices 0 and 1, as in one ``training_step``.
* **backward** (driven by the front end's backward: :meth:`CUDAGraphAccelerator.backward
  <cg_lightning.accelerate.CUDAGraphAccelerator.backward>`, :meth:`cg_lightning.fabric.CUDAGraphDDPStrategy.backward`):
  :meth:`start_backward` is the driver's
  ``before_backward`` (the micro-batch ends, exposed gradients go back into ``main_grad``); after autograd,
  :meth:`finish_backward` is ``after_backward``: it waits for the buckets (unless under :meth:`no_sync`) and
  points ``param.grad`` at ``main_grad``, for clipping and the optimizer on the micro-batch that completes an
  optimizer step and, as plain PyTorch has it, on the others too.
* **step count**: every micro-batch whose backward ran with gradient sync (Accelerate's ``sync_gradients``,
  outside Fabric's ``no_backward_sync``) completes one optimizer step; their number (the driver's
  ``completed_steps``) is the graph schedule's step (as
  Lightning's ``global_step``), so the schedule does not depend on the optimizer being prepared.
* **zero_grad**: the prepared optimizer's ``zero_grad`` calls :meth:`zero_grad_buffer`. Gradients
  dropped or replaced in ``param.grad`` by other means (a raw optimizer's ``zero_grad``) are carried
  into ``main_grad`` before the next backward, so the result is what eager PyTorch computes.

Imports only torch and the project's engine; the front ends' glue lives in :mod:`cg_lightning.accelerate` and
:mod:`cg_lightning.fabric`.
"""

from __future__ import annotations

import operator
from typing import Callable, ContextManager, Optional, Sequence

import torch
import torch.nn as nn
from typing_extensions import override

from .. import protocol
from ..ddp import DataParallelEngine, DDPOptions, progress
from ..graphs import GraphManager, GraphStats
from .building import capture_stream
from .driver import TrainingDriver

_GRAD = operator.attrgetter("grad")


class GraphedDataParallel(DataParallelEngine):
    """:class:`~cg_lightning.ddp.DataParallelEngine` that drives a graph manager through a
    :class:`~cg_lightning.lifecycle.TrainingDriver`.

    Args:
        module: the model, already on its device (with Accelerate's autocast forward, if any). Its
            trainable parameters get ``param.main_grad``; parameters and buffers are broadcast from
            rank 0.
        options: :class:`~cg_lightning.ddp.DDPOptions` (bucket size in MiB, averaging, ``main_grad``
            dtype, timeout in seconds).
        graph_manager: a manager already installed on ``module``'s layers
            (:func:`~cg_lightning.lifecycle.apply_graphs`, ``accumulate_into_main_grad=True``); ``None``
            trains eagerly through the same engine.

    Attributes:
        driver: the :class:`~cg_lightning.lifecycle.TrainingDriver` over the manager and this engine.
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
        super().__init__(module, options, grad_accumulator_stream=capture_stream(graph_manager))
        graph_options = graph_manager.options if graph_manager is not None else None
        self.driver = TrainingDriver(graph_options, graph_manager, self)
        if graph_manager is not None:  # every forward after a backward opens a pass; a loop may mix kinds (a GAN)
            graph_manager.warmup.multi_pass = True
        # the last backward through accelerator.backward completed an optimizer step, and the optimizer has not
        # stepped since (what check_ready_for_step asks for)
        self._step_backward_done = False
        # armed by CUDAGraphAccelerator.backward only: a backward outside it (through accelerator.unwrap_model's
        # model, or after training) fills param.grad as plain PyTorch does
        self.hooks_armed = False
        #: how the front end's backward is called, for messages
        self.backward_call = "accelerator.backward(loss)"

    @property
    def graph_manager(self) -> Optional[GraphManager]:
        return self.driver.graph_manager

    @property
    def steps(self) -> int:
        return self.driver.completed_steps

    @property
    def micro_batch_open(self) -> bool:
        return self.driver.micro_batch_open

    @property
    def graph_stats(self) -> Optional[GraphStats]:
        """The manager's counters (captured runners, replays, eager calls, capture seconds), or ``None``."""
        manager = self.driver.graph_manager
        return manager.stats if manager is not None else self.driver.last_graph_stats

    @override
    def forward(self, *args, **kwargs):
        """Open a micro-batch at the first forward with autograd since the last backward, then the engine's
        forward (buffers broadcast from rank 0 when due, ``ddp.broadcast_buffers``; then the module)."""
        if not self.driver.micro_batch_open and torch.is_grad_enabled():
            self.driver.begin_micro_batch()
            progress.report(self.driver.completed_steps, "forward")
        return super().forward(*args, **kwargs)

    # ----------------------------------------------------------------- backward
    def start_backward(self, loss: torch.Tensor) -> bool:
        """Before autograd runs for ``loss``: the driver's ``before_backward``; return whether a micro-batch of
        this model was waiting for a backward (its forward ran since the last backward, or an earlier backward
        did not reach it).

        If gradients are still exposed (no ``zero_grad`` through the prepared optimizer or model since the
        last step), the driver takes ``param.grad`` back into ``main_grad`` first, as eager PyTorch would keep
        accumulating into it: ``None`` (zeroed with ``set_to_none``) zeroes ``main_grad``, another tensor is
        copied in, the alias itself keeps its values. Then ``param.grad`` is dropped, since autograd would
        otherwise add into ``main_grad`` in place and the hook would add the same gradient again.

        If they are not exposed, ``param.grad`` set anyway came from a backward outside
        ``accelerator.backward`` (through ``accelerator.unwrap_model(model)``, which fills ``param.grad`` as plain
        PyTorch does): it is added into ``main_grad`` and dropped, so this backward accumulates onto it as plain
        PyTorch would, for graphed and eager parameters alike.
        """
        self.reached = False
        if not self.grads_exposed:
            self._carry_outside_grads()
        return self.driver.before_backward(loss)

    def _carry_outside_grads(self) -> None:
        grads = list(map(_GRAD, self.params))
        if grads.count(None) == len(grads):  # the usual case, checked without a Python loop
            return
        with torch.no_grad():
            for p, g in zip(self.params, grads):
                if g is not None:
                    protocol.main_grad(p).add_(g)
                    p.grad = None

    def defer_backward(self) -> None:
        """The backward did not reach this model (a GAN generator's detached output in the discriminator's
        loss): its micro-batch waits for a backward that reaches it."""
        self.driver.defer_backward()

    def finish_backward(self, completes_step: bool) -> None:
        """After autograd, the driver's ``after_backward``: wait for the buckets (unless under :meth:`no_sync`),
        then point ``param.grad`` at ``main_grad``, as plain PyTorch holds the sum so far in ``param.grad`` after
        every backward: on an accumulation micro-batch too (the local, not yet all-reduced sum), so clipping,
        scaling or reading it there works as without the engine. Only where ``ddp.grad_dtype`` differs from the
        parameters' dtype (``param.grad`` would be a cast copy, which the next backward could not carry back
        exactly) are accumulation micro-batches left with ``param.grad`` ``None``.

        Args:
            completes_step: the micro-batch completes an optimizer step (counted in :attr:`steps`).
        """
        self.driver.after_backward(completes_step)
        self._step_backward_done = completes_step

    # ----------------------------------------------------------------- optimizer
    def check_ready_for_step(self) -> None:
        """Raise if a forward's backward did not go through the front end's backward (no grads exposed)."""
        if self.driver.micro_batch_open and not self._step_backward_done:
            call = self.backward_call
            raise RuntimeError(
                f"cg_lightning: the optimizer steps while a forward's backward has not gone through {call}. "
                f"Call {call} instead of loss.backward(): it finishes the gradient all-reduce and points "
                "param.grad at param.main_grad."
            )

    def after_optimizer_step(self) -> None:
        """Close a micro-batch left open by a forward after the backward (the next forward starts a new one);
        ``main_grad`` is zeroed by the optimizer's ``zero_grad``, not here."""
        self._step_backward_done = False
        self.driver.after_optimizer_step(zero_grad=False)

    def covers_all(self, params) -> bool:
        """Whether ``params`` (an optimizer's) include every trainable parameter of this engine: its
        ``zero_grad`` may then zero the whole buffer (:meth:`zero_grad_buffer`). An optimizer over a part only
        zeroes its own ``param.grad`` (``set_to_none`` drops the alias, and :meth:`start_backward` then zeroes
        those ``main_grad`` views before the next backward), so another optimizer's gradients survive until its
        own step, as with plain PyTorch."""
        ids = {id(p) for p in params}
        return all(id(p) in ids for p in self.params)

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad`` that also zeroes ``main_grad`` (where the gradients really are)."""
        super().zero_grad(set_to_none)
        self.zero_grad_buffer()

    def remove_graphs(self) -> None:
        """Restore the graphed layers' own ``forward`` and drop the graphs (the engine keeps working)."""
        if self.driver.graph_manager is not None:
            self.driver.graph_manager.remove()

    def release(self) -> None:
        """Give the model back as if never prepared: graphs removed, the engine's hooks removed (a later
        ``backward`` fills ``param.grad`` again), ``param.grad`` no longer pointing at ``main_grad``, and
        Accelerate's "prepared" mark taken off the model, so ``prepare`` wraps it again (the driver's ``close``;
        :attr:`graph_stats` keeps the counters). Called by
        ``CUDAGraphAccelerator.free_memory`` and ``end_training``; the engine must not be used afterwards."""
        if self.grads_exposed:
            had_grad = [p.grad is not None for p in self.params]  # None stays None, as plain PyTorch leaves it
            self.take_back_grads()
            for p, keep in zip(self.params, had_grad):
                if keep:
                    main = protocol.main_grad(p)
                    p.grad = main.detach().clone() if main.dtype is p.dtype else main.to(p.dtype)
        self.driver.close()
        self.module.__dict__.pop("_is_accelerate_prepared", None)


def loop_backward(engines: Sequence[GraphedDataParallel], loss: torch.Tensor, autograd: Callable[[], None],
                  completes_step: Callable[[GraphedDataParallel], bool], bounded: Callable[[], ContextManager],
                  announce: Callable[[str], None], misuse: str) -> None:
    """A loop front end's backward (``accelerator.backward``, ``fabric.backward``) on its engines.

    Each engine's :meth:`~GraphedDataParallel.start_backward`; ``autograd()`` (the front end's own backward: loss
    scaling, ``loss.backward``) with the engines' hooks armed; then, inside ``bounded()``, for every engine whose
    forward fed this loss: :meth:`~GraphedDataParallel.finish_backward` (``completes_step(engine)``) and its capture
    summary handed to ``announce``. An engine whose forward ran but whose parameters the loss does not depend on (a
    GAN generator's detached output in the discriminator's loss) keeps its micro-batch open for the next backward.

    Raises:
        RuntimeError: ``misuse``, when the backward reached an engine's parameters without a forward of the engine
            since the last backward (their gradients would sit in ``main_grad``, never all-reduced or exposed).
        GradSyncError, PeerLostError: from the engines' gradient sync.
    """
    active = [engine for engine in engines if engine.start_backward(loss)]
    for engine in engines:
        engine.hooks_armed = True
    try:
        autograd()
    finally:
        for engine in engines:
            engine.hooks_armed = False
    for engine in engines:
        if engine not in active and any(any(b.slot_counts) for b in engine.buckets):
            raise RuntimeError(misuse)
    with bounded():  # the engines' waits: the grad-ready agreement, the buckets' all-reduce
        for engine in active:
            if not engine.reached:  # the loss did not depend on this model: its micro-batch waits
                engine.defer_backward()
                continue
            engine.finish_backward(completes_step=completes_step(engine))
            summary = engine.driver.capture_summary()
            if summary is not None:
                announce(str(summary))
