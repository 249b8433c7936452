"""Capturing the recorded calls of one step as a graph set, dropping layers whose capture fails.

:class:`SetCapture` is the graph manager's capture half (:class:`~..replay.set_replay.SetReplay` its replay half): it
owns the memory pool the graph sets share, builds one :class:`LayerGraphRunner` per recorded call, captures them
(:func:`capture_calls`) and adds the resulting :class:`~.graph_sets.GraphSet` to the cache. All calls are captured
together by :func:`~.capture_order.capture_in_order` (forwards in order, backwards in reverse, one pool). When one
runner raises :class:`GraphCaptureError` and the policy is ``"eager"`` or ``"split"``, its layer is reported
through ``on_failed`` and every remaining call is captured again from scratch: the failed attempt's runners are
dropped and ``capture_in_order`` has restored the training state, so nothing of it survives. With ``"raise"``
the error propagates, naming the layer. A layer that ``on_failed`` split into its parts (``"split"``) leaves the
set uncaptured: the recorded calls hold none of the parts' calls (the graph manager records a step again).
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn

from ... import protocol
from ..replay import direct_ready
from .capture_order import capture_in_order
from ..graph_sets import GraphSet, GraphSetCache, GraphStats
from ..errors import GraphCaptureError
from ..options import GraphOptions
from .recording import CallRecord, StepRecord
from ..replay.runner import LayerGraphRunner
from ..segments import draws, find_segments


def capture_calls(
    calls: Sequence[CallRecord],
    make_runner: Callable[[CallRecord], LayerGraphRunner],
    model: nn.Module,
    on_capture_error: str,
    on_failed: Callable[[object, GraphCaptureError], None],
    segments_of: Optional[Callable[[List[CallRecord]], List[List[int]]]] = None,
) -> Tuple[List[CallRecord], List[LayerGraphRunner]]:
    """Capture ``calls``; returns the calls captured and their runners (both empty if all failed).
    ``segments_of(calls)``: the runs of calls to capture as segments (recomputed after a failed layer is
    dropped)."""
    calls = list(calls)
    while calls:
        runners = [make_runner(c) for c in calls]
        blamed: List[LayerGraphRunner] = []
        try:
            capture_in_order(runners, model, [c.layer.module for c in calls],
                             segments=segments_of(calls) if segments_of is not None else None,
                             on_failure=blamed.append)
            return calls, runners
        except GraphCaptureError as exc:
            if not blamed:
                raise
            layer = calls[runners.index(blamed[0])].layer
            if on_capture_error == "raise":
                if layer.name not in str(exc):  # the same error, naming the layer: not a copy chained to itself
                    exc.args = (f"layer {layer.name!r}: {exc}", *exc.args[1:])
                raise
            on_failed(layer, exc)
            calls = [c for c in calls if c.layer is not layer]
    return [], []


def _segments_without_parts(calls: List[CallRecord]) -> List[List[int]]:
    """:func:`~.segments.find_segments`, with every call of a part of a split layer, and every call whose input
    is used outside it, on its own: its input gradients go back piece by piece (:mod:`..replay.input_pieces`), which a segment's shared buffers do not do."""
    out: List[List[int]] = []
    for run in find_segments(calls):
        if len(run) > 1 and any(calls[i].layer.parent is not None or calls[i].input_used_elsewhere for i in run):
            out += [[i] for i in run]
        else:
            out.append(run)
    return out


class SetCapture:
    """Builds the graph sets of one :class:`~.manager.GraphManager`: its runners, their shared pool and the
    capture counters of ``stats``. ``on_failed(layer, exc)``: what becomes of a layer whose capture failed under
    ``on_capture_error`` ``"eager"`` or ``"split"`` (:class:`~..split.failures.CaptureFailures`); returns whether the
    layer was split."""

    def __init__(self, model: nn.Module, options: GraphOptions, backend, device: torch.device,
                 cache: GraphSetCache, stats: GraphStats, accumulate_into_main_grad: bool,
                 on_failed: Callable[[object, GraphCaptureError], bool]) -> None:
        self.model = model
        self.options = options
        self.backend = backend
        self.device = device
        self.cache = cache
        self.stats = stats
        self.accumulate_into_main_grad = accumulate_into_main_grad
        self.on_failed = on_failed
        self.pool = None

    def capture(self, record: StepRecord, grad_ready, segment_ends: Set[Tuple[int, int]]) -> Optional[GraphSet]:
        """Capture every call of ``record`` as one graph set and add it to the cache; ``None`` if none was.
        ``grad_ready``: the engine's reporter handed to every runner; ``segment_ends``: ``(id(layer), index)``
        of recorded calls after which no segment may continue. ``None`` also when a layer was split (``on_failed``
        returned true): no set is added then."""
        start = time.perf_counter()
        allocated = self._allocated()
        if self.pool is None:
            self.pool = self.backend.new_pool()
        calls = [c for c in record.calls if c.layer.failure is None]
        self._require_grad_ready(calls, grad_ready)
        for call in calls:
            call.ends_segment = (id(call.layer), call.index) in segment_ends
        split: List[object] = []

        def failed(layer, exc: GraphCaptureError) -> None:
            if self.on_failed(layer, exc):
                split.append(layer)

        try:
            calls, runners = capture_calls(calls, lambda call: self._runner(call, grad_ready), self.model,
                                           self.options.capture_error_policy, failed,
                                           segments_of=_segments_without_parts if self.options.segments else None)
            for call, runner in zip(calls, runners):
                segment = runner.segment
                if segment is not None and segment.node_runners is not None and draws(call):
                    segment.members_draw = True  # draws between its calls must then be refused (segments.node.follow)
        finally:  # the recorded step's tensors are not kept, also when the capture raised
            for call in record.calls:
                call.output = call.output_node = call.rng_before = call.rng_after = None
        self.stats.capture_seconds += time.perf_counter() - start
        self.stats.pool_bytes += max(0, self._allocated() - allocated)
        if not runners or split:
            return None
        graph_set = GraphSet(record.lead, {(id(c.layer), c.index): r for c, r in zip(calls, runners)})
        if self.options.direct_grad_ready and self.accumulate_into_main_grad:
            graph_set.direct_pending = direct_ready.candidates(runners)
        self.cache.sets.append(graph_set)
        self.stats.captures += 1
        self.count()
        return graph_set

    def count(self) -> None:
        """Set the counters of what the cache holds: graph sets, runners, segments."""
        self.stats.graph_sets = len(self.cache.sets)
        self.stats.captured_runners = len(self.cache.all_runners())
        self.stats.segments = len({id(r.segment) for r in self.cache.all_runners() if r.segment is not None})

    def _runner(self, call: CallRecord, grad_ready) -> LayerGraphRunner:
        return LayerGraphRunner(
            call.layer.name,
            call.layer.module,
            call.layer.forward,
            call.signature,
            call.args,
            call.kwargs,
            self.backend,
            self.pool,
            accumulate_into_main_grad=self.accumulate_into_main_grad,
            clone_param_grads_on_return=False,
            num_warmup_iters=self.options.num_warmup_iters,
            autocast=call.autocast,
            grad_output_layouts=call.grad_output_layouts,
            grad_ready=grad_ready,
            # a part's inputs are used outside it too; so were these, in the recorded step
            input_pieces=call.layer.parent is not None or call.input_used_elsewhere,
            compiled=call.layer.compiled,
        )

    def _require_grad_ready(self, calls, grad_ready) -> None:
        """Raise if graphs would add into ``main_grad`` but no engine's grad-ready reporter was bound: their
        replays could not report the parameters they finalize, and the engine would miss them."""
        if grad_ready is not None or not self.accumulate_into_main_grad:
            return
        if any(protocol.has_main_grad(p) for c in calls for p in c.layer.module.parameters()):
            raise RuntimeError(
                "GraphManager: the graphed layers' parameters have main_grad (a DataParallelEngine owns them) but "
                "no grad-ready reporter was bound; call manager.bind_grad_ready(engine.grad_ready) right after "
                "building the engine, before the first capture."
            )

    def _allocated(self) -> int:
        if self.backend is not None and self.backend.name == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return 0
