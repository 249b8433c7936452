"""Replaying a training step's calls from its graph set (the graph manager's ``StepMode.REPLAY``).

:class:`SetReplay` is the graph manager's replay half, as :class:`~..capture.set_capture.SetCapture` is its capture
half. The i-th call of a layer in a step replays runner (layer, i) of the step's graph set through a
:class:`~.replay.ReplayFunction` node; a call whose runner belongs to a segment goes through
:mod:`.segments.dispatch`. A call for which no runner was captured, or whose arguments, autocast settings or
submodule train/eval modes differ from its runner's, follows ``graphs.shape_policy``: ``"error"`` raises
:class:`~.signature.GraphSignatureError`, otherwise it runs eagerly, with one warning per layer.

``graphs.direct_grad_ready`` (:mod:`.direct_ready`): while the graph set has candidates to confirm, the runners
that replay in a step are remembered; the step's first backward confirms candidates among theirs, and the
confirmed parameters are switched to direct reports when the next step begins.
"""

from __future__ import annotations

import warnings
from typing import List, Optional, Set, Tuple

import torch
import torch.nn as nn

from . import direct_ready
from ..capture import guards
from ..capture.recording import StepRecord
from ..graph_sets import GraphSet, GraphSetCache, GraphStats, describe
from ..options import GraphOptions
from .replay_node import ReplayFunction
from ..segments import dispatch as segment_calls
from ..errors import GraphSignatureError
from ..schedule import StepMode
from ..signature import CallSignature


def _members_match(segment) -> bool:
    """The following members of a segment have their captured parameters' ``requires_grad`` and train/eval
    modes (a segment launches all of its members: one frozen by ``toggle_optimizer`` since capture makes the
    whole segment run eagerly). Autocast is a property of each call and is checked at the member's call."""
    members = segment.member_runners
    return members is None or all(m.settings.params_match() and m.settings.modes_match() for m in members[1:])


class SetReplay:
    """Replays calls from the graph set of the current training step.

    Args:
        options: :class:`GraphOptions` (``shape_policy`` is read at every mismatching call).
        stats: the manager's :class:`~.graph_sets.GraphStats` (``forward_replays``, ``fallback_calls``,
            ``direct_ready_params`` are counted here).
        device: the training device (random-state checks of segments).

    Raises:
        GraphSignatureError: from :meth:`call` under ``shape_policy="error"``.
        SegmentError: from :meth:`call` and :meth:`refuse_pending_member` (:mod:`.segments.dispatch`).
    """

    def __init__(self, options: GraphOptions, stats: GraphStats, device: torch.device) -> None:
        self.options = options
        self.stats = stats
        self.device = device
        #: the current step's graph set; ``None`` in a step that does not replay
        self.graph_set: Optional[GraphSet] = None
        #: id(runner) of the runners replayed in this step, while the set has direct-ready candidates
        self.replayed: Set[int] = set()
        self._direct_switch: List[Tuple[object, List[nn.Parameter]]] = []  # confirmed, applied at begin_step
        #: the manager's ``param_reads`` callback (``GraphManager.bind_param_reads``): called with every member's
        #: module before a segment launches, or ``None``
        self.param_reads = None
        self._unmatched_warned = False
        self._cache_full_warned = False

    def begin_step(self) -> None:
        """A training micro-batch starts: the parameters confirmed at the last backward are reported by their
        runners' replays from now on; no graph set is chosen yet."""
        for runner, params in self._direct_switch:  # confirmed during the last step's backward
            runner.report_directly(params)
            self.stats.direct_ready_params += len(params)
        self._direct_switch = []
        self.replayed = set()
        self.graph_set = None

    def step_without_set(self, cache: GraphSetCache, args: tuple,
                         kwargs: dict) -> Tuple[StepMode, Optional[StepRecord]]:
        """What a micro-batch after warmup does when its first graphed call (``args``, ``kwargs``) matches no graph
        set of ``cache`` and none of its pending records. Under a ``shape_policy`` other than ``"recapture"`` it
        replays the first graph set, whose calls then follow the policy, or runs eagerly when there is none (every
        layer failed to capture, or no warmup kind matched: warned once). Under ``"recapture"`` it is recorded as
        a new pending record (returned with ``RECORD``), or runs eagerly when the cache is full (warned once)."""
        if self.options.shape_policy != "recapture":
            if cache.sets:
                self.graph_set = cache.sets[0]
                return StepMode.REPLAY, None
            if cache.pending and not self._unmatched_warned:
                self._unmatched_warned = True
                warnings.warn(guards.unmatched_warmup(cache.pending[-1].lead.mismatches(args, kwargs)), stacklevel=5)
            return StepMode.EAGER, None
        if not cache.full:
            record = StepRecord(CallSignature(args, kwargs))
            cache.pending.append(record)
            return StepMode.RECORD, record
        if not self._cache_full_warned:
            self._cache_full_warned = True
            warnings.warn(guards.cache_full(cache.limit, describe(CallSignature(args, kwargs))), stacklevel=5)
        return StepMode.EAGER, None

    def before_backward(self, loss: torch.Tensor) -> None:
        """Before the backward of a step that replays :attr:`graph_set`: confirm direct-ready candidates
        (:func:`.direct_ready.confirm_at_backward`)."""
        if self.graph_set is not None:
            self._direct_switch.extend(direct_ready.confirm_at_backward(loss, self.graph_set, self.replayed))

    def call(self, layer, index: int, args: tuple, kwargs: dict):
        """Call ``index`` of ``layer`` (a :class:`~.selection.GraphedLayer`) in this step: its runner's replay
        (a segment's first call launches the segment, a following member takes its output), or
        ``shape_policy``."""
        runner = self.graph_set.runners.get((id(layer), index))
        follows = runner is not None and runner.segment is not None and not runner.segment_launcher
        if follows:
            out = segment_calls.follow(self, layer, runner, args, kwargs)
            if out is not segment_calls.NOT_HANDED:
                return out
        if (runner is None or not runner.signature.matches(args, kwargs) or not runner.settings.match()
                or (runner.segment is not None and not follows and not _members_match(runner.segment))):
            if follows:
                segment_calls.refuse_other_arguments(layer, runner, args, kwargs)
            return self._fallback(layer, index, runner, args, kwargs)
        tensors = runner.signature.tensor_leaves(args, kwargs)
        segment = runner.segment
        if segment is not None and not follows and self.param_reads is not None:
            for member in segment.member_runners or ():  # the launch runs every member's forward
                self.param_reads(member.module)
        if segment is not None and not follows:
            if segment.node_runners is not None:
                return segment_calls.launch(self, segment, tensors, args, kwargs)
            segment_calls.start(segment, args, kwargs)  # launches the segment's forward graph below
        flat = ReplayFunction.apply(runner, *runner.node_inputs(tensors))
        self.count_replay(runner)
        return runner.output_structure(flat)

    def count_replay(self, runner) -> None:
        """Count one forward replay; remember ``runner`` while the set has direct-ready candidates."""
        self.stats.forward_replays += 1
        if self.graph_set.direct_pending:
            self.replayed.add(id(runner))

    def eager(self, layer, args: tuple, kwargs: dict):
        """Run the call eagerly, counted as a fallback."""
        self.stats.fallback_calls += 1
        return layer.forward(*args, **kwargs)

    def refuse_pending_member(self, layer, index: int) -> None:
        """Raise if call ``index`` of ``layer``, made in eval mode or without autograd, is a following member of
        a segment that already ran it for this pass (:func:`.segments.dispatch.refuse_pending_member`)."""
        if self.graph_set is not None:
            segment_calls.refuse_pending_member(layer, self.graph_set.runners.get((id(layer), index)))

    def _fallback(self, layer, index: int, runner, args: tuple, kwargs: dict):
        if runner is None:
            why = [f"call #{index} of this layer in a step was never captured (captured calls: "
                   f"{sum(1 for k in self.graph_set.runners if k[0] == id(layer))})"]
        else:
            why = runner.mismatches(args, kwargs)
            if runner.segment is not None and runner.segment.member_runners:
                why += [f"segment member {m.name!r}: {line}" for m in runner.segment.member_runners[1:]
                        for line in m.settings.mismatches(autocast=False)]
        if self.options.shape_policy == "error":
            raise GraphSignatureError(
                f"layer {layer.name!r} was called with arguments its graph was not captured for:\n  "
                + "\n  ".join(why)
                + "\nUse fixed shapes and layouts (e.g. drop_last=True, .contiguous() arguments), "
                "graphs.shape_policy='eager' to run such calls eagerly, or 'recapture' to capture graphs for them."
            )
        if not layer.warned:
            layer.warned = True
            warnings.warn(
                f"cg_lightning: layer {layer.name!r} runs eagerly for a call its graph was not captured for ("
                + "; ".join(why) + "). Shapes that change every step (text padded to its longest row) never "
                "replay: pad to a few lengths (cg_lightning.pad_to_multiple) with graphs.shape_policy='recapture', "
                "or use fixed shapes (drop_last=True). Further such calls of this layer are not reported.",
                stacklevel=4,
            )
        return self.eager(layer, args, kwargs)
