"""A segment's graphs: its members' bodies captured into one region per direction, and the per-segment state."""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Sequence

import torch

from ..backends import CapturedGraph, _detached, _EagerGraph


class _Member(CapturedGraph):
    """A member's graph handle: its static ``outputs``; ``replay()`` launches the segment (launcher only)."""

    def __init__(self, segment, outputs, launcher: bool) -> None:
        self.segment = segment
        self.outputs = outputs
        self.launcher = launcher

    def replay(self) -> None:
        if self.launcher:
            self.segment.replay()
            self.segment.launches += 1


class SegmentState:
    """Which forward launch of its segment each following member consumed (one launch per pass; used when
    only the forward is one graph), and, once both directions are segment graphs, the runners and the outputs
    handed to the following calls of the current pass."""

    def __init__(self) -> None:
        self.launches = 0
        self._consumed = {}
        #: the members' runners, in call order, once forward and backward were both captured as segment graphs:
        #: the segment then replays through one autograd node (:mod:`.node`)
        self.node_runners = None
        #: the members' runners, in call order (set when the forward is captured)
        self.member_runners = None
        self.handed = None  # this pass's :class:`~.node.HandedOutputs`
        self.members_draw = False  # a member drew random numbers in the recorded step
        #: a :class:`~.context.SharedContext` when following members take arguments besides the chained one
        self.context = None

    def launched_for(self, runner) -> bool:
        """True when the segment's forward launched since ``runner`` last replayed."""
        return self._consumed.get(id(runner), 0) != self.launches

    def consume(self, runner) -> None:
        self._consumed[id(runner)] = self.launches


class _MemberBackend:
    """What a member runner sees as its backend during segment capture: ``capture`` runs the body inside the
    segment's capture region (CUDA) or keeps it for replay (eager)."""

    def __init__(self, real, segment) -> None:
        self._real = real
        self._segment = segment
        self.name = real.name

    def __getattr__(self, name):
        return getattr(self._real, name)

    def capture(self, body, pool=None) -> _Member:
        return self._segment.add(body)


class _EagerSegment(SegmentState):
    """Eager backend: the launching member replays every member's body in capture order."""

    def __init__(self) -> None:
        super().__init__()
        self.members: List[_EagerGraph] = []

    def add(self, body) -> _Member:
        graph = _EagerGraph(body, _detached(body()))
        self.members.append(graph)
        return _Member(self, graph.outputs, launcher=len(self.members) == 1)

    def replay(self) -> None:
        for graph in self.members:
            graph.replay()


class _CudaSegment(SegmentState):
    def __init__(self, graph: "torch.cuda.CUDAGraph") -> None:
        super().__init__()
        self.graph = graph
        self.count = 0

    def add(self, body) -> _Member:
        outs = _detached(body())
        self.count += 1
        return _Member(self, outs, launcher=self.count == 1)

    def replay(self) -> None:
        self.graph.replay()


@contextlib.contextmanager
def segment_capture(backend, pool) -> Iterator[object]:
    """One capture region for several bodies (CUDA: one ``CUDAGraph`` on the backend's stream and pool)."""
    if backend.name != "cuda":
        yield _EagerSegment()
        return
    with backend.capture_region(pool) as graph:
        yield _CudaSegment(graph)


@contextlib.contextmanager
def members_capturing(runners: Sequence, segment) -> Iterator[None]:
    """Within the block the runners capture into ``segment`` (their backends swapped, then put back)."""
    with contextlib.ExitStack() as stack:
        for r in runners:
            stack.enter_context(r.using_backend(_MemberBackend(r.backend, segment)))
        yield
