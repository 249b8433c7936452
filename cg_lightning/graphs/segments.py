"""Segments: consecutive graphed calls that feed each other, captured as one forward and one backward graph.

Per-layer graphs cost one graph launch per layer call and direction (24 launches for 12 blocks) plus a
copy of each input into its static buffer. When call k+1's only tensor argument is call k's output (the
plain ``for block in blocks: x = block(x)``), the calls form a *segment*: their static buffers are chained
as in :mod:`.buffer_reuse` (input of k+1 = output of k; grad-output of k = grad-input buffer of k+1) and
their forward bodies are captured into one graph, their backward bodies (in reverse) into another. The
segment's first call applies one autograd node for all members (:mod:`.segment_node`): it launches the
forward graph and returns every member's static output; the following calls get theirs handed over after
checking they were called with the previous member's output.
That node's backward launches the backward graph once and replays the members' grad-ready notifications in
reverse member order, as their own nodes would have. (When a member's output needs no gradient, the
backward stays one graph per member and each call keeps its own replay node.)

What must hold, and is checked at every replay (``SegmentError`` otherwise, naming the layer): a following
member is called with the previous member's output itself (not a view or a detached copy), unchanged (the
same version counter: an in-place change between the two calls is caught), with no other arguments; no
intermediate output gets a gradient from outside the chain (an intermediate output used elsewhere would add
gradient the graph never saw), a gradient hook or ``retain_grad()`` (which would see no gradient); and no
following member got a forward pre-hook. A segment replays all or none of its calls: when its first call
runs eagerly (shape policy), so do the others in that pass.

Found at capture, from the recorded (eager) steps (:func:`find_segments`): two calls chain only if the
second's argument is the first's output (storage, version counter), the recorded backward reached that
output through the second call alone (:func:`mark_outside_uses`, in any recorded micro-batch, when the
strategy hands the loss in), no gradient hook was added on it in between, no random draw happened in
between (the segment's graph reserves every member's draws at launch), and neither a forward pre-hook of
the second layer nor a forward hook of the first would run between them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Sequence

import torch

from ..torch_compat import global_module_hooks, module_hooks
from .backends import CapturedGraph, _detached, _EagerGraph
from .discovery import autograd_edges


class SegmentError(RuntimeError):
    """A call inside a segment was not handed the chained tensor it was captured with."""


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
    out = prev.output
    if out is None or call.kwargs or len(call.args) != 1 or not isinstance(call.args[0], torch.Tensor):
        return False
    if not call.signature.positional_tensors:
        return False
    if call.input_version is None or call.input_version != prev.output_version:
        return False  # changed in place between the two calls
    if prev.ends_segment or breaks_between(prev, call):
        return False
    if _module_hooks_between(prev.layer.module, call.layer.module):
        return False  # a hook between the two calls would run when the segment already computed both
    return _same_tensor(call.args[0], out)


def breaks_between(prev, call) -> bool:
    """What one recorded micro-batch shows between two consecutive calls that rules out chaining them: the
    backward reached ``prev``'s output from elsewhere, a gradient hook was added on it, or a random draw
    happened in between (the segment's graph reserves every member's draws at launch)."""
    return prev.output_used_elsewhere or call.input_hooks != prev.output_hooks or _random_draw_between(prev, call)


def _module_hooks_between(first: torch.nn.Module, second: torch.nn.Module) -> bool:
    a, b = module_hooks(first), module_hooks(second)
    return bool(
        b.get("forward_pre_hooks") or a.get("forward_hooks")
        or a.get("backward_hooks") or a.get("backward_pre_hooks")
        or b.get("backward_hooks") or b.get("backward_pre_hooks")
        or any(global_module_hooks().values())
    )


def _random_draw_between(prev, call) -> bool:
    return rng_moved(prev.rng_after, call.rng_before)


def draws(call) -> bool:
    """The recorded call drew random numbers from the device's default generator (dropout inside it)."""
    return rng_moved(call.rng_before, call.rng_after)


def rng_moved(a, b) -> bool:
    """Two :func:`rng_state` snapshots differ (``None``: not taken, nothing to tell)."""
    return a is not None and b is not None and not torch.equal(a, b)


def rng_state(device: torch.device) -> torch.Tensor:
    """The state of the default random generator of ``device`` (CUDA: seed and offset; CPU: the whole
    Mersenne state), to compare around recorded calls."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def mark_outside_uses(loss: torch.Tensor, calls: Sequence) -> int:
    """Evidence from a recorded (eager) step, before its backward: sets ``output_used_elsewhere`` on each
    call whose output chains into the next call (:func:`find_segments`) but also reaches ``loss`` by another
    path (an auxiliary loss, a list of hidden states, a skip connection over several blocks), so that
    :func:`find_segments` ends the segment there instead of the first replayed backward raising
    ``SegmentError``. Returns how many calls were marked.

    ``calls``: the step's ``CallRecord`` list, each with ``output`` and ``output_node`` (the output's
    ``grad_fn``) kept. One walk over the loss's autograd graph, plus one over each next call's own nodes;
    every visited node wrapper is kept alive so that ``id`` stays an identity (torch creates wrappers on
    access, and a new one may reuse a freed one's address).
    """
    root = loss.grad_fn
    if root is None:
        return 0
    targets = {}  # id(output node of call k) -> (call k, nodes of call k+1's own graph)
    for prev, call in zip(calls, calls[1:]):
        if prev.output_node is not None and call.output_node is not None and _chains(prev, call):
            targets[id(prev.output_node)] = (prev, _nodes_between(call.output_node, prev.output_node))
    if not targets:
        return 0
    marked = 0
    for node, nxt in autograd_edges(root):
        target = targets.get(id(nxt))
        if target is not None and id(node) not in target[1] and not target[0].output_used_elsewhere:
            target[0].output_used_elsewhere = True
            marked += 1
    return marked


def _nodes_between(start, stop) -> dict:
    """``id -> node`` for the nodes reachable from ``start`` without passing through ``stop`` (a call's own
    autograd graph, from its output node back to its input's), wrappers kept alive."""
    found = {id(start): start}
    for _, nxt in autograd_edges(start, stop=stop):
        if nxt is not stop:
            found[id(nxt)] = nxt
    return found


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
        #: the segment then replays through one autograd node (:mod:`.segment_node`)
        self.node_runners = None
        self.handed = None  # this pass's :class:`~.segment_node.HandedOutputs`
        self.members_draw = False  # a member drew random numbers in the recorded step

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
    saved = [r.backend for r in runners]
    for r in runners:
        r.backend = _MemberBackend(r.backend, segment)
    try:
        yield
    finally:
        for r, b in zip(runners, saved):
            r.backend = b
