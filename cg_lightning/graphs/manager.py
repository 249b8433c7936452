"""The per-layer graph manager: records eager calls, captures every graphed call of a step, replays.

The schedule (warmup records, capture at the first step after warmup, a graph set per step, ``shape_policy``,
``on_capture_error``) is described in :mod:`.schedule`; what a training step's graphed calls do is its
:class:`~.schedule.StepMode`, fixed at its first graphed call (``_start_of_step``). This module is that state
machine and the dispatch of each call by mode; capture is :class:`~.capture.set_capture.SetCapture`'s, replay
:class:`~.replay.set_replay.SetReplay`'s, failures :class:`~.split.failures.CaptureFailures`'.
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.nn as nn

from .capture import guards
from .recompute import outer_checkpoint
from .backends import make_backend
from .compiled import WarmupClock, compile_wrapper
from .eval_graphs import EvalGraphs
from .split.failures import CaptureFailures
from .graph_sets import GraphSetCache, GraphStats
from .options import GraphOptions
from .capture.recording import mark_inputs_used_elsewhere, record_call
from .replay.runner import LayerGraphRunner
from .segments import segment_ends
from .selection import GraphedLayer, select_layers
from .split.splitting import LayerSelection
from .capture.set_capture import SetCapture
from .replay.set_replay import SetReplay
from .schedule import MicroBatch, StepMode, Warmup


class GraphManager:
    """Graphs the selected layers of ``model`` and replays them during training.

    Args:
        model: the module whose layers are graphed (their ``forward`` is replaced until :meth:`remove`).
        options: :class:`GraphOptions` (read at every step: ``shape_policy`` and ``warmup_steps`` may be
            changed before capture).
        device: the training device (picks the backend for ``backend="auto"``).
        accumulate_into_main_grad: captured backwards add weight gradients into ``param.main_grad``
            (the DDP engine's buffer) instead of returning them.

    Raises:
        ValueError: if ``options.layers`` matches no module.
    """

    def __init__(
        self,
        model: nn.Module,
        options: GraphOptions,
        device: torch.device,
        *,
        accumulate_into_main_grad: bool = True,
    ) -> None:
        self.model = model
        self.options = options
        self.device = device
        self.accumulate_into_main_grad = accumulate_into_main_grad
        self.backend = make_backend(options.backend, device) if options.enabled else None
        self.stats = GraphStats(backend=self.backend.name if self.backend is not None else "")
        #: the selected layers and, after splits (on_capture_error="split"), their parts (:mod:`.split.splitting`)
        wrap = compile_wrapper(options) if options.enabled else None  # graphs.compile (:mod:`.compiled`)
        self.selection = LayerSelection(select_layers(model, options.layers), self._make_dispatch, wrap)
        self._clock = WarmupClock() if wrap is not None else None
        #: the layers dispatched, the selection's own list (a split inserts the parts; the split one runs eagerly)
        self.layers: List[GraphedLayer] = self.selection.layers
        self.cache = GraphSetCache(options.max_graph_sets)
        #: graphs.on_capture_error: layers run eagerly or split into their parts (:mod:`.split.failures`)
        self._failures = CaptureFailures(options, self.selection, self.cache, self.stats)
        #: the capture half: runners, their shared pool (:mod:`.capture.set_capture`)
        self._sets = SetCapture(model, options, self.backend, device, self.cache, self.stats,
                                accumulate_into_main_grad, on_failed=self._failures.failed)
        #: the replay half: the step's graph set, shape policy, direct-ready confirmation (:mod:`.replay.set_replay`)
        self._replay = SetReplay(options, self.stats, device)
        self.eval_graphs: Optional[EvalGraphs] = None  # built at the first eval call with capture_eval on
        #: when warmup ends and its records kept for capture (:mod:`.schedule`); ``warmup.multi_pass``: a step is made
        #: of passes of different kinds (a GAN's generator and discriminator passes), each captured as a graph set
        self.warmup = Warmup()
        #: called at a graphed training call outside a micro-batch (autograd on, module in training mode) to open
        #: one; a front-end sets it while several forward-backward passes share one training step (manual
        #: optimization), ``None`` otherwise (such a call then runs eagerly)
        self.open_on_call: Optional[Callable[[], None]] = None
        self._batch = MicroBatch()  # the current training micro-batch's graphed calls (:mod:`.schedule`)
        self._nothing_warned = False
        self._segment_ends: Set[Tuple[int, int]] = set()  # graphs.segments: (id(layer), index) of recorded calls
        # after which some recorded micro-batch showed a reason to end a segment (segments.segment_ends)
        #: the data-parallel engine's grad-ready reporter (:meth:`bind_grad_ready`), handed to every runner
        self.grad_ready = None
        #: called before graphed code reads parameters (:meth:`bind_param_reads`), or ``None``
        self.param_reads: Optional[Callable[[Optional[nn.Module]], None]] = None
        if self.backend is not None:  # refused before capture where it can be seen now (split.failures)
            for layer in list(self.layers):
                self._failures.refuse_early(layer, at_call=False)
        self._failures.reselected = False  # nothing was recorded yet

    def _split_since(self, last_recording_step: int) -> bool:
        """Whether a layer was split since the last look; the graph sets and recorded steps, which lack its parts'
        calls, are dropped then: steps up to ``last_recording_step`` record, a later one captures."""
        if not self._failures.take_split(last_recording_step):
            return False
        self.warmup.clear()
        self._batch.recording = None
        self._replay.graph_set = None
        self._sets.count()
        return True

    def bind_grad_ready(self, reporter) -> None:
        """Hand this manager the grad-ready reporter of the data-parallel engine that owns the model's
        parameters (``DataParallelEngine.grad_ready``, :mod:`cg_lightning.protocol`): replays report to it. Call
        it before the capture, right after building the engine."""
        self.grad_ready = reporter

    def bind_param_reads(self, callback: Optional[Callable[[Optional[nn.Module]], None]]) -> None:
        """Have ``callback(module)`` called before a graphed layer's call (eager, recorded or replayed) reads the
        parameters of ``module`` (the layer; at a segment's launch each member) and ``callback(None)`` before a
        capture, which reads every layer's: the data-parallel engine waits there for parameters still being
        gathered (``ddp.overlap_param_gather``). ``None`` removes it."""
        self.param_reads = callback
        self._replay.param_reads = callback

    # ----------------------------------------------------------------- state
    @property
    def captured(self) -> bool:
        return bool(self.cache.sets)

    @property
    def runners(self) -> Dict[Tuple[int, int], LayerGraphRunner]:
        """The first graph set's runners by (id(layer), call index); :meth:`all_runners` for every set."""
        return self.cache.sets[0].runners if self.cache.sets else {}

    def all_runners(self) -> List[LayerGraphRunner]:
        return self.cache.all_runners()

    def signatures(self) -> List[str]:
        """The lead signature of every captured graph set, as text (for checkpoints and logs)."""
        return self.cache.signatures()

    # ----------------------------------------------------------------- schedule
    def begin_step(self, global_step: int) -> None:
        """Start of a training micro-batch: reset call indices; the step's mode is set at its first call."""
        self.warmup.begin(global_step)
        self.cache.limit = self.options.max_graph_sets
        if self._clock is not None:
            self._clock.tick(warming_up=not self.capture_due)
            self.stats.compile_seconds = self._clock.compile_seconds
        for module in self.selection.held:
            outer_checkpoint.hold(module)
        self._replay.begin_step()
        self._batch = MicroBatch(open=True)

    def end_step(self) -> None:
        """End of a training micro-batch's forward calls. Warns once when warmup is over and still nothing is
        graphed because no call of this forward could be (:func:`.capture.guards.nothing_graphed`)."""
        self._batch.open = False
        if (self._batch.mode is StepMode.UNSTARTED and not self._nothing_warned and self.capture_due
                and not self.cache.sets and not self.cache.pending):
            self._nothing_warned = True
            warnings.warn(guards.nothing_graphed([layer.name for layer in self.layers], self.options.warmup_steps,
                                                 self._batch.no_grad_calls), stacklevel=3)

    def before_backward(self, loss: torch.Tensor) -> None:
        """Called with the loss before the backward of a training micro-batch. In a recorded step: mark the
        calls whose inputs the loss also reaches from outside them (their captures hand input gradients back
        piece by piece) and, with ``graphs.segments``, the recorded outputs that also reach the loss outside the
        next call, so no segment is built across them. At the first backward of a step that replayed a graph set
        (``graphs.direct_grad_ready``): confirm which candidate parameters only their own replay reaches;
        they are reported by the replay from the next step on."""
        if self._batch.mode is StepMode.RECORD and isinstance(loss, torch.Tensor):
            if self.options.segments:  # what any recorded micro-batch showed counts (the capture sees the last)
                self._segment_ends.update(segment_ends(loss, self._batch.recording.calls))
            mark_inputs_used_elsewhere(loss, self._batch.recording.calls)
        elif self._batch.mode is StepMode.REPLAY:
            self._replay.before_backward(loss)

    @property
    def capture_due(self) -> bool:
        """Warmup is over (the capture happens at the first graphed call of a step from then on)."""
        return (self.backend is not None and self.warmup.over(self.options.warmup_steps)
                and self.warmup.global_step > self._failures.capture_after)

    def remove(self) -> None:
        """Restore every layer's original ``forward`` (parts of split layers included) and drop the graphs."""
        self.selection.remove()
        self.cache.clear()
        self.warmup.clear()
        if self.eval_graphs is not None:
            self.eval_graphs.clear()

    def _start_of_step(self, args: tuple, kwargs: dict) -> None:
        """At the step's first graphed call: record, capture, pick a graph set, or run eagerly."""
        if all(layer.failure is not None for layer in self.layers):
            self._batch.mode = StepMode.EAGER  # nothing left to capture
            self._failures.report(pending_only=True)  # splits whose parts all run eagerly
            return
        if self._failures.observers.hooks_added():  # hooks added since: look at the layers again
            for layer in list(self.layers):
                self._failures.refuse_early(layer, at_call=False)
            self._split_since(self.warmup.global_step)  # a split here: this step records again
        if not self.capture_due or (not self.cache.sets and not self.cache.pending and self.warmup.last is None):
            self._batch.mode, self._batch.recording = StepMode.RECORD, self.warmup.start(args, kwargs)
            return
        if self._failures.observers.active():
            if self.options.capture_error_policy == "split":  # the hooked submodules become graphed parts
                self._failures.split_at_active_observers()
                if self._split_since(self.warmup.global_step):
                    self._start_of_step(args, kwargs)  # this step records the parts' calls, the next captures
                    return
            self._batch.mode = StepMode.EAGER  # transformers collects outputs from inside the layers in this step
            if not self._failures.observers.warned:
                self._failures.observers.warned = True
                warnings.warn(guards.observers_active(), stacklevel=4)
            return
        # the kept warmup records wait for the first micro-batch of their kind, captured under its own settings (a
        # parameter that toggle_optimizer froze for one pass of a manual-optimization step stays frozen in its graphs)
        self.warmup.hand_over(self.cache)
        self._batch.mode = StepMode.REPLAY
        replay = self._replay
        replay.graph_set = self.cache.find(args, kwargs)
        if replay.graph_set is not None:
            return
        pending = self.cache.pop_pending(args, kwargs)  # a kind seen in warmup, or recorded under "recapture"
        if pending is not None:
            if self.param_reads is not None:
                self.param_reads(None)
            replay.graph_set = self._sets.capture(pending, self.grad_ready, self._segment_ends)
            if self._split_since(self.warmup.global_step):  # this step records the parts' calls, the next captures
                self._start_of_step(args, kwargs)
                return
            self._failures.report()
            if replay.graph_set is None:
                self._batch.mode = StepMode.EAGER
            return
        self._batch.mode, self._batch.recording = replay.step_without_set(self.cache, args, kwargs)

    # ----------------------------------------------------------------- dispatch
    def _make_dispatch(self, layer: GraphedLayer):
        def forward(*args, **kwargs):
            return self._dispatch(layer, args, kwargs)

        return forward

    def _dispatch(self, layer: GraphedLayer, args: tuple, kwargs: dict):
        """One call of a graphed layer: outside a training step (or without autograd) it runs eagerly or replays
        an eval graph; inside one, the step's :class:`StepMode`, fixed at its first graphed call, decides."""
        if self.param_reads is not None:
            self.param_reads(layer.module)
        if not self._graphable(layer):
            return self._ungraphed_call(layer, args, kwargs)
        if self._batch.mode is StepMode.UNSTARTED:
            self._start_of_step(args, kwargs)
        if self._batch.mode is StepMode.RECORD:
            self._failures.refuse_early(layer, at_call=True)
            if self._split_since(self.warmup.global_step + 1):  # the record misses its parts' earlier calls
                self._batch.mode = StepMode.EAGER
        if layer.failure is not None:
            self.stats.eager_calls += 1
            return layer.forward(*args, **kwargs)
        index = self._batch.next_index(layer)
        if self._batch.mode is StepMode.RECORD:
            if self._batch.recording is self.warmup.last:
                self.stats.eager_calls += 1
            else:
                self.stats.fallback_calls += 1
            return record_call(self._batch.recording, layer, index, args, kwargs, self.options.segments, self.device)
        if self._batch.mode is StepMode.EAGER:
            self.stats.fallback_calls += 1
            return layer.forward(*args, **kwargs)
        return self._replay.call(layer, index, args, kwargs)

    def _graphable(self, layer: GraphedLayer) -> bool:
        if self.backend is None or not layer.module.training or not torch.is_grad_enabled():
            return False
        if not self._batch.open and self.open_on_call is not None:
            self.open_on_call()
        return self._batch.open

    def _ungraphed_call(self, layer: GraphedLayer, args: tuple, kwargs: dict):
        """A call in eval mode, without autograd or outside a training step."""
        if self._batch.open and layer.module.training and not torch.is_grad_enabled():
            self._batch.no_grad_calls += 1
        if self._batch.mode is StepMode.REPLAY and self._batch.open:
            self._replay.refuse_pending_member(layer, self._batch.calls.get(id(layer), 0))
        if (self.options.capture_eval and self.backend is not None and not layer.module.training
                and not torch.is_grad_enabled()):
            if self.eval_graphs is None:
                self.eval_graphs = EvalGraphs(self.backend, max_graphs=self.options.max_graph_sets)
            return self.eval_graphs.call(layer, args, kwargs, self.stats)
        self.stats.eager_calls += 1
        return layer.forward(*args, **kwargs)
