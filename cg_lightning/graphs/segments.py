"""Segments: consecutive graphed calls that feed each other, captured as one forward and one backward graph.

Per-layer graphs cost one graph launch per layer call and direction (24 launches for 12 blocks) plus a
copy of each input into its static buffer. When call k+1's only tensor argument is call k's output (the
plain ``for block in blocks: x = block(x)``), the calls form a *segment*: their static buffers are chained
as in :mod:`.buffer_reuse` (input of k+1 = output of k; grad-output of k = grad-input buffer of k+1) and
their forward bodies are captured into one graph, their backward bodies (in reverse) into another. The first
call of a segment launches the forward graph, the last call's backward node launches the backward graph;
the other calls only check that they are handed exactly the chained tensors and return their static
results. Grad-ready notifications still come from every call's own replay node, as before.

What must hold, and is checked at every replay (``SegmentError`` otherwise, naming the layer): a member's
input is the previous member's output tensor (not a copy, not a modified tensor), and the gradient that
reaches a member's backward is exactly the tensor the next member's backward produced (an intermediate
output also used elsewhere would add gradient the graph never saw). Found at capture: which recorded calls
chain (:func:`find_segments`, by storage of the recorded tensors).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence

import torch


class SegmentError(RuntimeError):
    """A call inside a segment was not handed the chained tensor it was captured with."""


def _single_tensor(x) -> Optional[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and len(x) == 1 and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def find_segments(calls: Sequence) -> List[List[int]]:
    """Split recorded calls (``CallRecord`` with ``output`` kept) into runs where each call's only argument
    is the previous call's output; returns lists of indices into ``calls``, singletons included, in order."""
    segments: List[List[int]] = []
    for i, call in enumerate(calls):
        if segments and i > 0 and _chains(calls[i - 1], call):
            segments[-1].append(i)
        else:
            segments.append([i])
    return segments


def _chains(prev, call) -> bool:
    out = getattr(prev, "output", None)
    if out is None or call.kwargs or len(call.args) != 1 or not isinstance(call.args[0], torch.Tensor):
        return False
    if not call.signature.positional_tensors:
        return False
    return _same_tensor(call.args[0], out)


class _Member:
    """A member's graph handle: its static ``outputs``; ``replay()`` launches the segment (launcher only)."""

    def __init__(self, segment, outputs, launcher: bool) -> None:
        self.segment = segment
        self.outputs = outputs
        self.launcher = launcher

    def replay(self) -> None:
        if self.launcher:
            self.segment.replay()


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


def _detached(outs):
    return [o.detach() if isinstance(o, torch.Tensor) else None for o in outs]


class _EagerSegment:
    """Eager backend: the launching member re-runs every member body in capture order."""

    def __init__(self) -> None:
        self.members: List[tuple] = []  # (body, static outputs)

    def add(self, body) -> _Member:
        outs = _detached(body())
        member = _Member(self, outs, launcher=not self.members)
        self.members.append((body, outs))
        return member

    def replay(self) -> None:
        for body, statics in self.members:
            fresh = body()
            with torch.no_grad():
                for static, new in zip(statics, fresh):
                    if static is None:
                        continue
                    if new is None:
                        static.zero_()
                    elif not (static.data_ptr() == new.data_ptr() and static.stride() == new.stride()):
                        static.copy_(new)


class _CudaSegment:
    def __init__(self, graph: "torch.cuda.CUDAGraph") -> None:
        self.graph = graph
        self.count = 0

    def add(self, body) -> _Member:
        outs = _detached(body())
        member = _Member(self, outs, launcher=self.count == 0)
        self.count += 1
        return member

    def replay(self) -> None:
        self.graph.replay()


@contextlib.contextmanager
def segment_capture(backend, pool) -> Iterator[object]:
    """One capture region for several bodies (CUDA: one ``CUDAGraph`` on the backend's stream and pool)."""
    if backend.name != "cuda":
        yield _EagerSegment()
        return
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream(backend.device)
    backend.stream.wait_stream(current)
    with torch.cuda.graph(graph, pool=pool, stream=backend.stream):
        yield _CudaSegment(graph)
    current.wait_stream(backend.stream)


@contextlib.contextmanager
def members_capturing(runners: Sequence, segment) -> Iterator[None]:
    """Within the block the runners capture into ``segment`` (their backends swapped, then put back)."""
    saved = [r.backend for r in runners]
    for r in runners:
        r.backend = _MemberBackend(r.backend, segment)
    try:
        yield
    finally:
        for r, b in zip(runners, saved):
            r.backend = b


def check_segment_grad(runner, grad_outputs) -> None:
    """Raise if a non-launching member's backward is handed a gradient other than the chained buffer."""
    for static, g in zip(runner.static_grad_outputs, grad_outputs):
        if static is None:
            continue
        if g is None or g.data_ptr() != static.data_ptr():
            raise SegmentError(
                f"graphed {runner.name!r} is inside a segment (graphs.segments=true): its output's gradient was "
                "computed by the segment's backward graph from the next layer alone, but autograd handed it "
                f"{'no gradient' if g is None else 'another tensor'} (the output is also used outside the chain, "
                "e.g. kept for an auxiliary loss). Set graphs.segments=false for this model."
            )
