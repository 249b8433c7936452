"""One training lifecycle for every front-end: per-layer graphs, the data-parallel engine, the optimizer step.

The Lightning strategy, the Accelerate integration and a hand-written PyTorch loop all drive the same
objects through the same events; this module holds them, so each front-end only maps its own hooks onto
them. Torch only: it imports :mod:`cg_lightning.graphs` and :mod:`cg_lightning.ddp`, never Lightning,
Accelerate or OmegaConf.

Building: one function per feature, applied to the model in turn (graphs on its layers, then the engine
around it), and a driver over what they return::

    manager = apply_graphs(model, GraphOptions(warmup_steps=2), device)   # None when graphs are off
    engine = apply_data_parallel(model, DDPOptions(), graph_manager=manager)
    driver = TrainingDriver(GraphOptions(...), manager, engine)            # or: build_driver(model, ...)

A loop over optimizer steps, each made of one or more micro-batches (all but the last under ``no_sync``)::

    for step, window in enumerate(windows):
        for i, batch in enumerate(window):
            last = i == len(window) - 1
            with contextlib.nullcontext() if last else driver.no_sync():
                driver.begin_micro_batch(step)
                loss = loss_fn(engine(batch))
                driver.end_forward()
                driver.before_backward(loss)
                loss.backward()
                driver.after_backward(completes_step=last)
            summary = driver.capture_summary()
            if summary is not None:
                print(summary)
        with driver.stepping(optimizer):
            optimizer.step()
        driver.after_optimizer_step()
        optimizer.zero_grad()
    driver.close()

The events and what they guarantee:

* :meth:`~TrainingDriver.begin_micro_batch`: the graphed layers' calls from here on belong to one
  micro-batch (call indices, the warmup / capture / replay schedule keyed by the optimizer step).
* :meth:`~TrainingDriver.end_forward`: that micro-batch makes no further layer calls.
* :meth:`~TrainingDriver.before_backward`: right before autograd, after everything that reads or edits the
  sum so far in ``param.grad`` (clipping, scaling, ``zero_grad``): that sum goes back into ``main_grad`` and
  ``param.grad`` is dropped; the graph manager looks at the loss's autograd graph.
* :meth:`~TrainingDriver.after_backward`: right after autograd, before anything reads the gradients: the
  buckets' all-reduce is waited for (unless under :meth:`~TrainingDriver.no_sync`) and ``param.grad`` points at
  ``main_grad``.
* :meth:`~TrainingDriver.stepping`: inside, ``optimizer.step()`` is the captured step graph
  (``graphs.capture_optimizer``) or the cached fused Adam step (``graphs.cached_optimizer_step``) where they
  apply, else the optimizer's own.
* :meth:`~TrainingDriver.after_optimizer_step`: closes a micro-batch a forward opened after the backward and
  (unless told otherwise) zeroes ``main_grad``.
* :meth:`~TrainingDriver.capture_summary`: what was captured since the last call, as a value to print.
* :meth:`~TrainingDriver.close`: graphs removed, the optimizers as the user built them, the engine's hooks
  gone; the counters stay readable (``last_graph_stats``, ``last_optimizer_replays``, ...).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple, Type

import torch
import torch.nn as nn

from .ddp import DataParallelEngine, DDPOptions
from .graphs import GraphManager, GraphOptions, GraphStats
from .graphs.selection import default_layers, no_default_layers_message
from .optim.fused_adam_step import CachedFusedAdamStep, fused_adam_refusal
from .optim.step_graph import ACTIVE as OPTIMIZER_GRAPH_ACTIVE
from .optim.step_graph import OptimizerStepGraph, optimizer_refusal, step_replaced
from .protocol import main_grad

__all__ = [
    "CaptureSummary",
    "TrainingDriver",
    "apply_data_parallel",
    "apply_graphs",
    "build_driver",
    "capture_stream",
]


# ------------------------------------------------------------------------------------------------ building
def apply_graphs(
    model: nn.Module,
    options: GraphOptions,
    device: torch.device,
    *,
    accumulate_into_main_grad: bool = True,
) -> Optional[GraphManager]:
    """Install a :class:`~cg_lightning.graphs.GraphManager` on ``model``'s selected layers.

    Args:
        model: the module whose layers (``options.layers``) get graphed; their ``forward`` is replaced until
            the manager's ``remove``.
        options: :class:`~cg_lightning.graphs.GraphOptions`.
        device: the training device (picks the backend for ``backend="auto"``).
        accumulate_into_main_grad: captured backwards add weight gradients into ``param.main_grad`` (the
            data-parallel engine's buffer); ``False`` for eval-only graphs without an engine.

    Returns:
        the manager, or ``None`` when ``options.enabled`` is false or when ``options.layers`` is unset and the
        model has no repeated layers to graph (:func:`~cg_lightning.graphs.selection.default_layers`; a
        warning then says how to choose layers).

    Raises:
        ValueError: from ``GraphManager`` when ``options.layers`` is set and matches no module.
    """
    if not options.enabled:
        return None
    if options.layers is None and not default_layers(model):
        warnings.warn(no_default_layers_message(model), UserWarning, stacklevel=2)
        return None
    return GraphManager(model, options, device, accumulate_into_main_grad=accumulate_into_main_grad)


def capture_stream(graph_manager: Optional[GraphManager]) -> Optional["torch.cuda.Stream"]:
    """The stream the manager captures on (CUDA backend), or ``None``. The engine creates the parameters'
    gradient accumulators on it: a captured backward that feeds an accumulator bound to another stream fails."""
    if graph_manager is None:
        return None
    return getattr(graph_manager.backend, "stream", None)


def apply_data_parallel(
    model: nn.Module,
    options: Optional[DDPOptions] = None,
    *,
    graph_manager: Optional[GraphManager] = None,
    process_group: Any = None,
    engine_type: Type[DataParallelEngine] = DataParallelEngine,
) -> DataParallelEngine:
    """Wrap ``model`` in a :class:`~cg_lightning.ddp.DataParallelEngine`.

    Args:
        model: the module, already on its device (and with ``graph_manager`` installed, if any).
        options: :class:`~cg_lightning.ddp.DDPOptions` (``None``: the defaults).
        graph_manager: the manager from :func:`apply_graphs`, whose capture stream the engine's gradient
            accumulators must be bound to.
        process_group: the group to reduce over (default: the world, when initialized).
        engine_type: :class:`~cg_lightning.ddp.DataParallelEngine` or a subclass taking its arguments.

    Returns:
        the engine (call it as the model).
    """
    return engine_type(model, options, process_group=process_group,
                              grad_accumulator_stream=capture_stream(graph_manager))


def build_driver(
    model: nn.Module,
    graphs: GraphOptions,
    ddp: Optional[DDPOptions],
    device: torch.device,
    *,
    process_group: Any = None,
    engine_type: Type[DataParallelEngine] = DataParallelEngine,
) -> "TrainingDriver":
    """:func:`apply_graphs`, then :func:`apply_data_parallel`, then a :class:`TrainingDriver` over both."""
    manager = apply_graphs(model, graphs, device)
    engine = apply_data_parallel(model, ddp, graph_manager=manager, process_group=process_group,
                                 engine_type=engine_type)
    return TrainingDriver(graphs, manager, engine)


# ------------------------------------------------------------------------------------------------ summary
@dataclass(frozen=True)
class CaptureSummary:
    """What a capture produced, for the front-ends to print (``str(summary)``)."""

    layer_calls: int  #: graphed layer calls captured so far, over every graph set
    layers: Tuple[str, ...]  #: qualified names of the graphed layers
    backend: str  #: graph backend, ``"cuda"`` or ``"eager"``
    seconds: float  #: time spent capturing so far
    graph_sets: int  #: graph sets captured (more than one under ``shape_policy="recapture"``)
    segments: int  #: chains of calls captured as one forward and one backward graph

    @classmethod
    def of(cls, manager: GraphManager) -> "CaptureSummary":
        stats = manager.stats
        return cls(stats.captured_runners, tuple(layer.name for layer in manager.layers), stats.backend,
                   stats.capture_seconds, stats.graph_sets, stats.segments)

    def __str__(self) -> str:
        return (
            f"cg_lightning: captured {self.layer_calls} layer calls ({', '.join(self.layers)}) with the "
            f"{self.backend} backend in {self.seconds:.2f} s"
            + (f" ({self.graph_sets} graph sets)" if self.graph_sets > 1 else "")
            + (f", chained into {self.segments} segment(s)" if self.segments else "")
        )


# ------------------------------------------------------------------------------------------------ driver
class TrainingDriver:
    """Drives a graph manager, a data-parallel engine and the optimizer-step pieces through one training.

    Args:
        graph_options: the :class:`~cg_lightning.graphs.GraphOptions` the manager was built with (its
            ``capture_optimizer`` and ``cached_optimizer_step`` are read at every step, so a callback may
            change them before training); ``None``: the defaults.
        graph_manager: from :func:`apply_graphs`, or ``None`` (eager layers).
        engine: from :func:`apply_data_parallel` (or a subclass), or ``None`` (eval-only graphs: nothing to
            reduce).

    Attributes:
        graph_manager, engine: as given, ``None`` after :meth:`close`.
        completed_steps: micro-batches whose backward completed an optimizer step
            (:meth:`after_backward`); the default step index of :meth:`begin_micro_batch`.
        micro_batch_open: a micro-batch began and its forward calls are not over (:meth:`end_forward`).
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
        self._backward_due = False  # a micro-batch began since the last backward
        self._deferred = False  # a backward did not reach the model: its micro-batch waits for the next one
        self._captures_seen = 0
        self._optimizer_graphs: Dict[int, OptimizerStepGraph] = {}  # id(optimizer) -> its step graph
        self._cached_steps: Dict[int, Optional[CachedFusedAdamStep]] = {}  # id(optimizer) -> cached fused step
        self.last_graph_stats: Optional[GraphStats] = None
        self.last_optimizer_replays = 0
        self.last_cached_optimizer_steps = 0
        if graph_manager is not None and engine is not None:
            self._connect(graph_manager, engine)

    @staticmethod
    def _connect(graph_manager: GraphManager, engine: DataParallelEngine) -> None:
        """The one place where a graph manager and the engine that reduces its gradients are joined (the engine
        was built on the manager's capture stream, :func:`apply_data_parallel`): replays report grad-ready to
        this engine's reporter."""
        graph_manager.bind_grad_ready(engine.grad_ready)

    # ------------------------------------------------------------------------------------ micro-batch
    def begin_micro_batch(self, step: Optional[int] = None) -> None:
        """A training micro-batch starts: the graphed layers' calls from here on belong to it.

        Args:
            step: optimizer steps taken so far (Lightning's ``global_step``); the capture schedule counts
                ``graphs.warmup_steps`` in it. ``None``: :attr:`completed_steps`.
        """
        self.micro_batch_open = True
        self._backward_due = True
        if self.graph_manager is not None:
            self.graph_manager.begin_step(self.completed_steps if step is None else step)

    def end_forward(self) -> None:
        """The micro-batch's forward calls are over (its backward comes next, or none at all)."""
        if self.micro_batch_open:
            self.micro_batch_open = False
            if self.graph_manager is not None:
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
            self.engine.take_back_grads()
        if due and self.graph_manager is not None:
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

    # ------------------------------------------------------------------------------------ optimizer
    @contextlib.contextmanager
    def stepping(self, optimizer: torch.optim.Optimizer, refusal: Optional[str] = None) -> Iterator[None]:
        """Inside, ``optimizer.step(closure)`` is, where it applies: the captured step graph
        (``graphs.capture_optimizer``, once the layers replay: one eager step prepared for capture, then the
        capture, then replays), else the cached fused Adam step (``graphs.cached_optimizer_step``), else the
        optimizer's own ``step``.

        Args:
            optimizer: the torch optimizer (not a front-end's wrapper).
            refusal: a reason of the front-end's why the step must not be captured (a GradScaler that checks
                the gradients on the host), or ``None``; read when the optimizer is first seen after capture.
        """
        graph = self._optimizer_graph(optimizer, refusal)
        cached = self._cached_step(optimizer)
        if graph is not None and graph.phase in OPTIMIZER_GRAPH_ACTIVE:
            with step_replaced(optimizer, graph.step):
                yield
        elif cached is not None and (graph is None or graph.phase == "eager"):
            with step_replaced(optimizer, cached.step):
                yield
        else:
            yield

    def after_optimizer_step(self, zero_grad: bool = True) -> None:
        """After ``optimizer.step()``: a micro-batch that a forward opened after the backward is closed (the
        next forward starts a new one); with ``zero_grad``, every ``main_grad`` is zeroed and ``param.grad``
        dropped (a loop that zeroes through its optimizer's ``zero_grad`` passes ``False``)."""
        self.end_forward()
        self._backward_due = False
        if zero_grad and self.engine is not None:
            self.engine.zero_grad_buffer()

    def _optimizer_graph(self, optimizer: torch.optim.Optimizer,
                         refusal: Optional[str]) -> Optional[OptimizerStepGraph]:
        """The optimizer's step graph once the layers replay and ``graphs.capture_optimizer`` is on; its groups
        are prepared here, before the one eager step that precedes capture."""
        manager = self.graph_manager
        if manager is None or not self.graph_options.capture_optimizer:
            return None
        graph = self._optimizer_graphs.get(id(optimizer))
        if graph is None:
            if not manager.captured:
                return None
            graph = OptimizerStepGraph(optimizer, manager.backend)
            self._optimizer_graphs[id(optimizer)] = graph
            reason = optimizer_refusal(optimizer, manager.backend.name) or refusal
            if reason is None and self.engine is not None and any(
                main_grad(p).dtype != p.dtype for p in self.engine.params
            ):
                reason = ("ddp.grad_dtype differs from the parameters' dtype, so the optimizer gets a new cast copy "
                          "of main_grad every step; leave ddp.grad_dtype unset to capture the step")
            if reason is not None:
                graph.give_up(reason)
            else:
                graph.prepare()
        return graph

    def _cached_step(self, optimizer: torch.optim.Optimizer) -> Optional[CachedFusedAdamStep]:
        """The cached fused Adam/AdamW step for ``optimizer``, or ``None`` where it does not apply (option off,
        graphs off, another optimizer)."""
        if self.graph_manager is None or not self.graph_options.cached_optimizer_step:
            return None
        key = id(optimizer)
        if key not in self._cached_steps:
            self._cached_steps[key] = None if fused_adam_refusal(optimizer) else CachedFusedAdamStep(optimizer)
        return self._cached_steps[key]

    @property
    def cached_optimizer_steps(self) -> int:
        """Optimizer steps taken on cached tensor lists so far (``graphs.cached_optimizer_step``)."""
        return sum(c.cached_steps for c in self._cached_steps.values() if c is not None)

    @property
    def optimizer_replays(self) -> int:
        """Optimizer steps replayed from a graph so far (``graphs.capture_optimizer``)."""
        return sum(graph.replays for graph in self._optimizer_graphs.values())

    def optimizer_state_view(self, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> Dict[str, Any]:
        """``optimizer.state_dict()`` output ``state`` with ``capturable`` as the user set it (a captured step
        sets it on every group), so a checkpoint loads anywhere."""
        graph = self._optimizer_graphs.get(id(optimizer))
        return graph.state_dict_view(state) if graph is not None else state

    # ------------------------------------------------------------------------------------ capture summary
    def capture_summary(self) -> Optional[CaptureSummary]:
        """A :class:`CaptureSummary` when graphs were captured since the last call, else ``None``."""
        manager = self.graph_manager
        if manager is None or manager.stats.captures == self._captures_seen:
            return None
        self._captures_seen = manager.stats.captures
        return CaptureSummary.of(manager)

    # ------------------------------------------------------------------------------------ teardown
    def close(self) -> None:
        """End of training: the optimizers get back the ``capturable`` setting the user gave them, the layers
        their own ``forward`` (graphs dropped), the parameters no engine hooks. Counters stay readable in
        ``last_graph_stats``, ``last_optimizer_replays`` and ``last_cached_optimizer_steps``."""
        self.last_optimizer_replays = self.optimizer_replays
        self.last_cached_optimizer_steps = self.cached_optimizer_steps
        self._cached_steps = {}
        for graph in self._optimizer_graphs.values():
            if graph.phase in OPTIMIZER_GRAPH_ACTIVE:
                graph.restore()
        self._optimizer_graphs = {}
        if self.graph_manager is not None:
            self.last_graph_stats = self.graph_manager.stats
            self.graph_manager.remove()
            self.graph_manager = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.micro_batch_open = self._backward_due = self._deferred = False
