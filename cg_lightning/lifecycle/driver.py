"""The training driver: one graph manager, one data-parallel engine and the optimizer steps, moved through the
events of a training step (listed in :mod:`cg_lightning.lifecycle`)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from ..ddp import DataParallelEngine
from ..graphs import GraphManager, GraphOptions, GraphStats
from ..optim.step_graph import step_replaced
from .optimizer_steps import OptimizerSteps
from .summary import CaptureSummary


class TrainingDriver:
    """Drives a graph manager, a data-parallel engine and the optimizer-step pieces through one training.

    Args:
        graph_options: the :class:`~cg_lightning.graphs.GraphOptions` the manager was built with (its
            ``capture_optimizer`` and ``cached_optimizer_step`` are read at every step, so a callback may
            change them before training); ``None``: the defaults.
        graph_manager: from :func:`~.building.apply_graphs`, or ``None`` (eager layers).
        engine: from :func:`~.building.apply_data_parallel` (or a subclass), or ``None`` (eval-only graphs:
            nothing to reduce).

    Attributes:
        graph_manager, engine: as given, ``None`` after :meth:`close`.
        completed_steps: micro-batches whose backward completed an optimizer step
            (:meth:`after_backward`); the default step index of :meth:`begin_micro_batch`.
        micro_batch_open: a micro-batch began and its forward calls are not over (:meth:`end_forward`).
        layers_paused: the graph manager sees no training micro-batch (its layers run eagerly): a graph of the
            whole step is warming up or replaying instead (``graphs.whole_step``).
        last_graph_stats: the manager's counters, kept by :meth:`close` (``None`` without a manager).
        last_optimizer_replays, last_cached_optimizer_steps: :attr:`optimizer_replays` and
            :attr:`cached_optimizer_steps`, kept by :meth:`close`.

    Errors: the engine's ``GradSyncError`` from :meth:`after_backward`; the manager's errors from the
    forward and backward calls they concern.
    """

    def __init__(
        self,
        graph_options: Optional[GraphOptions] = None,
        graph_manager: Optional[GraphManager] = None,
        engine: Optional[DataParallelEngine] = None,
    ) -> None:
        self.graph_options = graph_options if graph_options is not None else GraphOptions()
        self.graph_manager = graph_manager
        self.engine = engine
        self.completed_steps = 0
        self.micro_batch_open = False
        self.layers_paused = False
        self._backward_due = False  # a micro-batch began since the last backward
        self._deferred = False  # a backward did not reach the model: its micro-batch waits for the next one
        self._captures_seen = 0
        self._optimizer_steps = OptimizerSteps(self.graph_options, graph_manager, engine)
        self.step_backend = None
        self.last_graph_stats: Optional[GraphStats] = None
        self.last_optimizer_replays = 0
        self.last_cached_optimizer_steps = 0
        if engine is not None:
            self._connect(graph_manager, engine)

    @property
    def step_backend(self):
        """``graphs.whole_step``: the backend its graphs capture with (:func:`.building.build_driver`), which the
        optimizer's step graph also uses where no layer is graphed; ``None`` otherwise."""
        return self._optimizer_steps.step_backend

    @step_backend.setter
    def step_backend(self, backend) -> None:
        self._optimizer_steps.step_backend = backend

    @staticmethod
    def _connect(graph_manager: Optional[GraphManager], engine: DataParallelEngine) -> None:
        """The one place where a graph manager and the engine that reduces its gradients are joined (the engine
        was built on the manager's capture stream, :func:`~.building.apply_data_parallel`): replays report
        grad-ready to this engine's reporter. Under ``ddp.overlap_param_gather`` the parameters' all-gathers are
        waited for by forward pre-hooks on the modules outside the graphed layers and, for the graphed layers, by
        the manager's call before their parameters are read (:mod:`cg_lightning.ddp.param_gather`)."""
        gather = engine.param_gather
        graphed = [layer.module for layer in graph_manager.layers] if graph_manager is not None else []
        if gather is not None:
            gather.install(engine.module, graphed)
        if graph_manager is None:
            return
        graph_manager.bind_grad_ready(engine.grad_ready)
        if gather is not None:
            graph_manager.bind_param_reads(gather.wait_module)

    # ------------------------------------------------------------------------------------ micro-batch
    def begin_micro_batch(self, step: Optional[int] = None) -> None:
        """A training micro-batch starts: the graphed layers' calls from here on belong to it.

        Args:
            step: optimizer steps taken so far (Lightning's ``global_step``); the capture schedule counts
                ``graphs.warmup_steps`` in it. ``None``: :attr:`completed_steps`.
        """
        self.micro_batch_open = True
        self._backward_due = True
        if self.graph_manager is not None and not self.layers_paused:
            self.graph_manager.begin_step(self.completed_steps if step is None else step)

    @contextlib.contextmanager
    def passes_open_micro_batches(self, step: Callable[[], int]) -> Iterator[None]:
        """Inside, a graphed layer's training call after a backward (or an optimizer step) opens a new
        micro-batch at ``step()``: for a training step made of several forward-backward passes (manual
        optimization: a GAN's discriminator and generator passes), each pass is a micro-batch of its own,
        graphed as one, instead of running eagerly."""
        manager = self.graph_manager
        if manager is None:
            yield
            return
        manager.open_on_call = lambda: self.begin_micro_batch(step())
        manager.warmup.multi_pass = True
        try:
            yield
        finally:
            manager.open_on_call = None

    def end_forward(self) -> None:
        """The micro-batch's forward calls are over (its backward comes next, or none at all)."""
        if self.micro_batch_open:
            self.micro_batch_open = False
            if self.graph_manager is not None and not self.layers_paused:
                self.graph_manager.end_step()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate into ``main_grad`` without reducing (gradient accumulation)."""
        if self.engine is None:
            yield
            return
        with self.engine.no_sync():
            yield

    # ------------------------------------------------------------------------------------ backward
    def before_backward(self, loss: torch.Tensor) -> bool:
        """Right before autograd runs for ``loss``.

        Ends the forward calls; carries the gradients still exposed since the last backward (``param.grad``
        aliasing ``main_grad``, maybe clipped, scaled, replaced or set to ``None`` since) back into
        ``main_grad`` and drops ``param.grad``, so this backward accumulates onto what eager PyTorch would;
        lets the graph manager look at the loss's autograd graph (``graphs.segments``,
        ``graphs.direct_grad_ready``) when a micro-batch of this model is waiting for its backward.

        Returns:
            whether a micro-batch was waiting for this backward (one began, or one was deferred by
            :meth:`defer_backward`, since the last backward).
        """
        self.end_forward()
        due = self._backward_due or self._deferred
        self._backward_due = self._deferred = False
        if self.engine is not None:
            self.engine.wait_for_params()  # a parameter no forward hook covered: before the backward reads it
            self.engine.take_back_grads()
        if due and self.graph_manager is not None and not self.layers_paused:
            self.graph_manager.before_backward(loss)
        return due

    def defer_backward(self) -> None:
        """The backward just run did not reach this model (its output fed nothing the loss depends on): its
        micro-batch waits for the next backward (:meth:`before_backward` then reports it due)."""
        self._deferred = True

    def after_backward(self, completes_step: Optional[bool] = None) -> None:
        """Right after autograd, before anything reads the gradients (clipping, the optimizer, user hooks).

        Waits for every bucket's all-reduce unless under :meth:`no_sync`, then points ``param.grad`` at
        ``main_grad``: always on the micro-batch that completes an optimizer step; on the others (the local sum
        so far, as plain PyTorch holds it) when that is the tensor itself (``ddp.grad_dtype`` unset or equal
        to the parameters'), since a cast copy could not be carried back exactly.

        Args:
            completes_step: this micro-batch completes an optimizer step (counted in
                :attr:`completed_steps`); ``None``: whether gradient sync is on.

        Raises:
            GradSyncError: a parameter did not report its gradient (on some rank).
        """
        engine = self.engine
        if engine is None:
            return
        if completes_step is None:
            completes_step = engine.sync_enabled
        if engine.sync_enabled:
            engine.finish_grad_sync()
        engine.expose_after_backward(completes_step)
        if completes_step:
            self.completed_steps += 1

    def replayed_backward(self) -> None:
        """A graph of the whole step ran this micro-batch's backward and gradient sync (``graphs.whole_step``): the
        gradients are exposed again (``param.grad`` is ``main_grad``) and the step counted, as
        :meth:`after_backward` does after autograd."""
        self.end_forward()
        self._backward_due = self._deferred = False
        if self.engine is not None:
            self.engine.expose_after_backward(True)
        self.completed_steps += 1

    # ------------------------------------------------------------------------------------ optimizer
    @contextlib.contextmanager
    def stepping(self, optimizer: torch.optim.Optimizer, refusal: Optional[str] = None,
                 updated: Optional[Callable[[], bool]] = None) -> Iterator[None]:
        """Inside, ``optimizer.step(closure)`` is, where it applies: the captured step graph
        (``graphs.capture_optimizer``, once the layers replay: a fused Adam/AdamW step recorded and replayed while
        its values hold), else the cached fused Adam step (``graphs.cached_optimizer_step``), else the
        optimizer's own ``step`` (:mod:`.optimizer_steps`).

        Args:
            optimizer: the torch optimizer (not a front-end's wrapper).
            refusal: a reason of the front-end's why the step must not be captured (a GradScaler that checks
                the gradients on the host), or ``None``; read when the optimizer is first seen after capture.
            updated: asked after the step's closure ran: ``True`` when a graph of the whole iteration updated the
                weights already (the update is then skipped; :mod:`cg_lightning.trainer.step_update`).
        """
        step = self._optimizer_steps.step_for(optimizer, refusal)
        if step is None and updated is None:
            yield
            return
        with step_replaced(optimizer, step, updated):
            yield

    def shard_optimizer(self, optimizer: torch.optim.Optimizer):
        """Under ``ddp.distributed_optimizer``: ``optimizer``'s sharded step, made now (call it before a checkpoint's
        optimizer state is loaded: from then on ``optimizer.state_dict()`` and ``load_state_dict()`` handle shards,
        :mod:`cg_lightning.optim.sharded_state`); ``None`` without the option.

        Raises:
            ValueError: the optimizer cannot be sharded (not elementwise, or over other parameters).
        """
        return self._optimizer_steps.shard(optimizer)

    def sharded_optimizer(self, optimizer: torch.optim.Optimizer):
        """``optimizer``'s sharded step if :meth:`shard_optimizer` made one, else ``None``."""
        return self._optimizer_steps.sharded(optimizer)

    def after_optimizer_step(self, zero_grad: bool = True) -> None:
        """After ``optimizer.step()``: a micro-batch that a forward opened after the backward is closed (the
        next forward starts a new one); with ``zero_grad``, every ``main_grad`` is zeroed and ``param.grad``
        dropped (a loop that zeroes through its optimizer's ``zero_grad`` passes ``False``)."""
        self.end_forward()
        self._backward_due = False
        if zero_grad and self.engine is not None:
            self.engine.zero_grad_buffer()

    @property
    def cached_optimizer_steps(self) -> int:
        """Optimizer steps taken on cached tensor lists so far (``graphs.cached_optimizer_step``)."""
        return self._optimizer_steps.cached_steps

    @property
    def optimizer_replays(self) -> int:
        """Optimizer steps replayed from a graph so far (``graphs.capture_optimizer``)."""
        return self._optimizer_steps.replays

    # ------------------------------------------------------------------------------------ capture summary
    def capture_summary(self) -> Optional[CaptureSummary]:
        """A :class:`CaptureSummary` when graphs were captured since the last call, else ``None``."""
        manager = self.graph_manager
        if manager is None or manager.stats.captures == self._captures_seen:
            return None
        self._captures_seen = manager.stats.captures
        return CaptureSummary.of(manager)

    def wait_for_params(self) -> None:
        """Wait for the parameters' all-gathers still pending after a sharded step (``ddp.overlap_param_gather``):
        before code outside the model's forward reads or writes parameter values. Nothing to do otherwise."""
        if self.engine is not None:
            self.engine.wait_for_params()

    # ------------------------------------------------------------------------------------ teardown
    def close(self) -> None:
        """End of training: the optimizers get back the ``capturable`` setting the user gave them, the layers
        their own ``forward`` (graphs dropped), the parameters no engine hooks. Counters stay readable in
        ``last_graph_stats``, ``last_optimizer_replays`` and ``last_cached_optimizer_steps``."""
        self.wait_for_params()
        self.last_optimizer_replays = self.optimizer_replays
        self.last_cached_optimizer_steps = self.cached_optimizer_steps
        self._optimizer_steps.close()
        if self.graph_manager is not None:
            self.last_graph_stats = self.graph_manager.stats
            self.graph_manager.remove()
            self.graph_manager = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.micro_batch_open = self._backward_due = self._deferred = False
