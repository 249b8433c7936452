"""The graph manager's schedule: what a micro-batch's graphed calls do (:class:`StepMode`, :class:`MicroBatch`) and
warmup: when it ends and the records it keeps for capture (:class:`Warmup`).

Schedule (driven by :meth:`~.manager.GraphManager.begin_step`, called at the start of every training micro-batch):

* During the first ``warmup_steps`` steps the manager sees (counted from the first ``begin_step``, so a
  resumed run warms up again) layers run eagerly and each training call is recorded (layer, call index
  within the step, signature, arguments: :mod:`.capture.recording`); each step's record replaces the previous one.
* At the first graphed call of the first step after warmup, every recorded call gets a
  :class:`~.replay.runner.LayerGraphRunner`: all are warmed up, their forwards captured in call order, then their
  backwards in reverse order, into one memory pool, so replays in the same order are safe. ``main_grad``,
  module buffers and RNG states are restored afterwards: capture changes no training state. The runners
  form a *graph set*, keyed by the signature of the step's first graphed call (:mod:`.graph_sets`); building
  it is :class:`~.capture.set_capture.SetCapture`'s.
* Each later step picks its set at its first graphed call; the i-th call of a layer replays runner
  (layer, i) of that set, or, if its arguments differ from the runner's, follows ``shape_policy``
  (:class:`~.replay.set_replay.SetReplay`, the replay half; segments: :mod:`.segments.dispatch`).
  Under ``"recapture"`` a step whose first call matches no set runs eagerly and is recorded; the next
  step with that signature captures it as another set (same pool), up to ``max_graph_sets``.
* A layer whose capture raises :class:`~.errors.GraphCaptureError` follows ``on_capture_error``: ``"eager"``
  drops it from the set (it runs eagerly from then on) and captures the others without it; ``"split"``
  replaces it by its parts (:mod:`.split.splitting`), drops every graph set and recorded step (they hold no calls of
  the parts), records the rest of the step again and captures at the next one.

Calls in eval mode or under ``no_grad`` run eagerly, or, with ``capture_eval``, eval-mode calls without
autograd replay forward-only graphs kept apart from the training graphs (:mod:`.eval_graphs`).

What a training micro-batch's graphed calls do is its :class:`StepMode`, fixed at its first graphed call
(:class:`MicroBatch`); the graph manager (:mod:`.manager`) runs that state machine and dispatches each call by mode.

The records: only the last warmup micro-batch of each kind is kept, one kind normally, one per lead signature when
the step is made of passes of different kinds (:attr:`Warmup.multi_pass`: a GAN's generator and
discriminator passes). When warmup ends they become the graph-set cache's pending records.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Dict, List, Optional

from .capture.recording import StepRecord
from .graph_sets import GraphSetCache
from .signature import CallSignature


class StepMode(enum.Enum):
    """What the graphed calls of the current training step do; fixed at the step's first graphed call."""

    UNSTARTED = "unstarted"  #: no graphed call yet in this step
    RECORD = "record"  #: run eagerly and record the calls (warmup, or a new signature under "recapture")
    REPLAY = "replay"  #: replay the active graph set's runners
    EAGER = "eager"  #: run eagerly (every layer failed, or the graph-set cache is full)


@dataclasses.dataclass
class MicroBatch:
    """The graphed calls of the current training micro-batch (from ``begin_step`` on; :attr:`open` until
    ``end_step``, the rest until the next ``begin_step``: its backward still reads :attr:`mode`)."""

    open: bool = False  #: between ``begin_step`` and ``end_step``
    mode: StepMode = StepMode.UNSTARTED
    recording: Optional[StepRecord] = None  #: the record its calls go to, in :attr:`StepMode.RECORD`
    calls: Dict[int, int] = dataclasses.field(default_factory=dict)  #: id(layer) -> calls so far
    no_grad_calls: int = 0  #: training-mode calls without autograd (:func:`.capture.guards.nothing_graphed`)

    def next_index(self, layer: object) -> int:
        """The index of this call of ``layer`` within the micro-batch (0 for its first)."""
        index = self.calls.get(id(layer), 0)
        self.calls[id(layer)] = index + 1
        return index


class Warmup:
    """The warmup of one graph manager: the steps it counts (from the first ``begin`` on, so a resumed run warms up
    again) and its records: the latest (:attr:`last`) and, under :attr:`multi_pass`, the latest of each lead
    signature (:attr:`kinds`, oldest first)."""

    def __init__(self) -> None:
        self.start_step: Optional[int] = None
        self.global_step = 0
        self.last: Optional[StepRecord] = None
        self.kinds: List[StepRecord] = []
        #: the step is made of passes of different kinds: each kind's last warmup pass is captured as a graph set
        #: of its own; otherwise only the last warmup pass is, and other kinds follow ``shape_policy``
        self.multi_pass = False

    def begin(self, global_step: int) -> None:
        """A training micro-batch of ``global_step`` starts."""
        if self.start_step is None:
            self.start_step = global_step
        self.global_step = global_step

    def over(self, warmup_steps: int) -> bool:
        """Whether ``warmup_steps`` (at least 1) steps have been counted before the current one."""
        start = self.start_step if self.start_step is not None else 0
        return self.global_step >= start + max(1, warmup_steps)

    def start(self, args: tuple, kwargs: dict) -> StepRecord:
        """A new record for a warmup micro-batch whose first graphed call takes ``args``/``kwargs``; it replaces
        the last one (of the same lead signature, under :attr:`multi_pass`)."""
        record = StepRecord(CallSignature(args, kwargs))
        kinds = self.kinds if self.multi_pass else []
        self.kinds = [r for r in kinds if not r.lead.matches(args, kwargs)] + [record]
        self.last = record
        return record

    def hand_over(self, cache: GraphSetCache) -> None:
        """Warmup is over: the kept records become ``cache``'s pending ones, the latest first (the one captured
        when nothing else matches), as far as the cache has room."""
        kinds = self.kinds
        self.clear()
        for record in reversed(kinds):
            if not cache.full:
                cache.pending.append(record)

    def clear(self) -> None:
        self.last, self.kinds = None, []
