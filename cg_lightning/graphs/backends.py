"""Graph backends: how a body of work is captured once and replayed.

A *body* is a Python callable that runs some kernels and returns a flat list of tensors (or ``None``).
``backend.capture(body, pool)`` runs it once and returns a :class:`CapturedGraph` whose ``outputs`` are
the static tensors of that run; ``graph.replay()`` recomputes them in place.

* :class:`CudaBackend`: ``torch.cuda.CUDAGraph`` captured on a dedicated side stream (never the default
  stream, never a stream with pending work of its own), all graphs of a manager sharing one memory pool;
  graph-safe Philox RNG, so dropout masks change on every replay. A capture that fails leaves the process as
  it was before it (:func:`guarded_capture`).
* :class:`EagerBackend`: the body is simply run again at replay and its results copied into the static
  outputs. Same static-buffer semantics and the same bookkeeping, no CUDA needed: how CPU CI exercises
  the engine. It never replaces running the CUDA tests on a GPU.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterator, List, Optional

import torch

from .capture.capture_guard import guarded_capture

Body = Callable[[], List[Optional[torch.Tensor]]]


def _detached(outs: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
    return [o.detach() if isinstance(o, torch.Tensor) else None for o in outs]


class CapturedGraph:
    """A captured body: ``outputs`` are its static tensors, ``replay()`` refreshes them."""

    outputs: List[Optional[torch.Tensor]]
    #: the :mod:`.segments` state this graph is a member of, or ``None`` (a graph of its own; segment members
    #: also say whether replaying their handle launches the segment's graph: ``launcher``)
    segment = None

    def replay(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class _EagerGraph(CapturedGraph):
    def __init__(self, body: Body, outputs: List[Optional[torch.Tensor]]) -> None:
        self._body = body
        self.outputs = outputs

    def replay(self) -> None:
        new = self._body()
        with torch.no_grad():
            for static, fresh in zip(self.outputs, new):
                if static is not None and fresh is not None:
                    if static.data_ptr() == fresh.data_ptr() and static.stride() == fresh.stride():
                        continue  # an output that is (a view of) a static input: already in place
                    static.copy_(fresh)
                elif static is not None:
                    static.zero_()


class EagerBackend:
    """Runs bodies eagerly at every replay (CPU, debugging)."""

    name = "eager"

    def new_pool(self) -> None:
        return None

    def warmup_stream(self) -> contextlib.AbstractContextManager:
        """Context for eager warmup passes (nothing to do without CUDA)."""
        return contextlib.nullcontext()

    def capture(self, body: Body, pool=None) -> CapturedGraph:
        return _EagerGraph(body, _detached(body()))


class _CudaGraph(CapturedGraph):
    def __init__(self, graph: "torch.cuda.CUDAGraph", outputs: List[Optional[torch.Tensor]]) -> None:
        self._graph = graph
        self.outputs = outputs

    def replay(self) -> None:
        self._graph.replay()


class CudaBackend:
    """Captures bodies into ``torch.cuda.CUDAGraph`` on a side stream of ``device``.

    Raises:
        RuntimeError: if CUDA is not available.
    """

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("graphs.backend='cuda' needs a CUDA device; use backend='eager' on CPU")
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def new_pool(self):
        """A graph memory pool: a ``torch.cuda.MemPool``, whose object holds a reference to the pool in the device
        allocator for as long as it lives, so the pool never runs out of users while graphs are dropped and captured
        again (the allocator refuses a capture into a pool whose count fell to zero while its memory is still in
        use: ``create_or_incref_pool`` in ``c10/cuda/CUDACachingAllocator.cpp``)."""
        with torch.cuda.device(self.device):
            return torch.cuda.MemPool()

    @contextlib.contextmanager
    def warmup_stream(self) -> Iterator[None]:
        """Run warmup passes on the capture stream, ordered after the current stream's work (and the current
        stream after them, also when a pass raises).

        Libraries initialise per-stream state lazily (cuBLAS binds a workspace to each handle and stream on
        first use); that must happen before capture, not inside it, or the captured GEMM fails with
        ``CUBLAS_STATUS_EXECUTION_FAILED``. The torch documentation asks for side-stream warmup for the
        same reason.
        """
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            current.wait_stream(self.stream)

    @contextlib.contextmanager
    def capture_region(self, pool=None) -> Iterator["torch.cuda.CUDAGraph"]:
        """Capture everything run inside into one ``CUDAGraph`` on the capture stream, ordered after the
        current stream's work (and the current stream after it). A failure inside leaves no capture behind
        (:func:`guarded_capture`)."""
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with collector_paused(), torch.cuda.device(self.device), guarded_capture(graph, self.stream, pool):
                yield graph
        finally:
            current.wait_stream(self.stream)

    def capture(self, body: Body, pool=None) -> CapturedGraph:
        with self.capture_region(pool) as graph:
            outs = body()
        return _CudaGraph(graph, _detached(outs))


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector does not run inside the block.

    A collection inside a capture runs the destructors of whatever unrelated objects happen to be dead then
    (CUDA graphs, memory pools and tensors of earlier work); a CUDA call among them that is not permitted while
    a stream captures makes the capture fail later, at whichever kernel comes next, with "operation failed due
    to a previous error during capture". Dead objects are collected after the block instead.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def make_backend(name: str, device: torch.device):
    """``"cuda"``, ``"eager"`` or ``"auto"`` (``cuda`` when ``device`` is a CUDA device)."""
    if name == "auto":
        name = "cuda" if device.type == "cuda" else "eager"
    if name == "cuda":
        return CudaBackend(device)
    if name == "eager":
        return EagerBackend()
    raise ValueError(f"unknown graph backend {name!r}; expected 'auto', 'cuda' or 'eager'")
