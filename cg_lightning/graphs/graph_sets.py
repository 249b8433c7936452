"""Graph sets: the runners captured for one kind of training step, and the bounded cache that holds them.

A training step's kind is the signature of its first call of a graphed layer (its *lead* signature):
with a fixed model, the shapes of that call (batch size, sequence length) determine those of every later
call in the step. A :class:`GraphSet` maps ``(layer, call index)`` to the runner captured for it; one set
replays per step (sets never mix within a step), so the sets can share one memory pool: a set only
needs its own buffers during the step it replays in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .capture.recording import StepRecord
from .signature import CallSignature


@dataclass
class GraphSet:
    lead: CallSignature
    runners: Dict[Tuple[int, int], object]  # (id(layer), call index) -> LayerGraphRunner
    #: graphs.direct_grad_ready: id(param) -> runner, candidates still to confirm (direct_ready.py)
    direct_pending: Dict[int, object] = field(default_factory=dict)


def describe(signature: CallSignature) -> str:
    """A short text of a signature, e.g. ``Tensor[4, 32, 64] float32 on cpu, requires_grad``."""
    parts = [str(m) if t else repr(m) for m, t in zip(signature.metas, signature.is_tensor)]
    return "(" + "; ".join(parts) + ")"


class GraphSetCache:
    """Captured sets and steps recorded for capture, at most ``limit`` of them together."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sets: List[GraphSet] = []
        self.pending: List[StepRecord] = []

    @property
    def full(self) -> bool:
        return len(self.sets) + len(self.pending) >= self.limit

    def find(self, args: tuple, kwargs: dict) -> Optional[GraphSet]:
        return next((s for s in self.sets if s.lead.matches(args, kwargs)), None)

    def pop_pending(self, args: tuple, kwargs: dict) -> Optional[StepRecord]:
        for i, record in enumerate(self.pending):
            if record.lead.matches(args, kwargs):
                return self.pending.pop(i)
        return None

    def all_runners(self) -> list:
        return [r for s in self.sets for r in s.runners.values()]

    def forget_layer(self, layer) -> None:
        """Drop a layer's runners and recorded calls (it runs eagerly from now on). A graph set in which the
        layer is a member of a segment is dropped whole: the segment's graphs include that layer's work."""
        self.sets = [
            s for s in self.sets
            if not any(k[0] == id(layer) and r.segment is not None for k, r in s.runners.items())
        ]
        for s in self.sets:
            for key in [k for k in s.runners if k[0] == id(layer)]:
                del s.runners[key]
        for record in self.pending:
            record.calls = [c for c in record.calls if c.layer is not layer]

    def signatures(self) -> List[str]:
        return [describe(s.lead) for s in self.sets]

    def clear(self) -> None:
        self.sets.clear()
        self.pending.clear()


@dataclass
class GraphStats:
    """Counters for monitoring: graphs captured, replays, eager fallbacks, capture time (seconds).

    ``captured_runners`` counts runners over all graph sets; ``graph_sets`` the sets, ``captures`` the
    capture events; ``pool_bytes`` the device memory allocated by captures (CUDA; 0 on CPU);
    ``failed_layers`` the layers that run eagerly because their capture failed; ``split_layers`` those replaced
    by their parts (``graphs.on_capture_error="split"``; their own forward runs eagerly) and ``graphed_parts``
    the parts of those that were captured (by qualified name); ``segments`` the chains
    captured as one forward and one backward graph (``graphs.segments``); ``eval_graphs`` and
    ``eval_replays`` the forward-only graphs of eval-mode calls and their replays (``graphs.capture_eval``;
    their pool is counted in ``pool_bytes``, their warmup calls in ``eager_calls``).
    """

    backend: str = ""
    captured_runners: int = 0
    forward_replays: int = 0
    eager_calls: int = 0
    fallback_calls: int = 0
    capture_seconds: float = 0.0
    #: graphs.compile: host seconds the first warmup micro-batch took beyond the last one (compilation)
    compile_seconds: float = 0.0
    graph_sets: int = 0
    captures: int = 0
    pool_bytes: int = 0
    failed_layers: List[str] = field(default_factory=list)
    split_layers: List[str] = field(default_factory=list)
    graphed_parts: List[str] = field(default_factory=list)
    segments: int = 0  # chains of two or more calls captured as one forward and one backward graph
    eval_graphs: int = 0  # forward-only graphs of eval-mode calls (graphs.capture_eval)
    direct_ready_params: int = 0  # parameters the replays report ready themselves (graphs.direct_grad_ready)
    eval_replays: int = 0
