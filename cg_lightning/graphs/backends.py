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
import warnings
from typing import Callable, Iterator, List, Optional

import torch

from .. import torch_compat

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
        """A graph memory pool: a ``torch.cuda.MemPool``, whose object holds a reference to the pool for as long as
        it lives, so the pool never runs out of users while graphs are dropped and captured again (the allocator
        refuses a new capture into a pool whose count fell to zero while its memory is still in use), and a failed
        capture's reference can be given back (:func:`abandon_capture`)."""
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
def guarded_capture(graph: "torch.cuda.CUDAGraph", stream: "torch.cuda.Stream", pool=None) -> Iterator[None]:
    """Capture the block's work on ``stream`` (not the default stream) into ``graph``, as ``torch.cuda.graph``
    does: synchronize, empty the allocator's cache, ``capture_begin``, the block, ``capture_end``. ``pool``: a
    ``torch.cuda.MemPool``, a pool handle (``torch.cuda.graph_pool_handle()``, ``other_graph.pool()``) or ``None``
    (a pool of its own).

    Unlike ``torch.cuda.graph``, an exception in the block or in ``capture_end`` leaves the process as it was
    before the capture (:func:`abandon_capture`): the capture ended, ``stream`` capturing nothing, the previous
    current stream restored, the CUDA generator usable outside capture, the allocator no longer routing into
    ``pool``, and ``graph`` reset. The exception propagates unchanged.
    """
    handle = pool_handle(pool)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with torch.cuda.stream(stream):
        try:
            graph.capture_begin(pool=handle)
        except BaseException:
            _end_rng_capture_mode()
            raise
        try:
            yield
            graph.capture_end()
        except BaseException:
            with torch.cuda.stream(stream):  # the block may have left another stream current
                abandon_capture(graph, pool, handle)
            raise


def pool_handle(pool):
    """The allocator's id of ``pool`` (a ``torch.cuda.MemPool`` or a handle); a fresh handle for ``None``, so
    that a failed capture's pool is always known."""
    if pool is None:
        return torch.cuda.graph_pool_handle()
    return pool.id if isinstance(pool, torch.cuda.MemPool) else pool


def abandon_capture(graph: "torch.cuda.CUDAGraph", pool, handle) -> None:
    """End a capture whose block or ``capture_end`` raised, on its stream and device, and undo what it left.

    An intact capture (the error was raised before CUDA saw anything illegal) ends normally, so the allocator and
    the generator are left as after any capture. An invalidated one (a host synchronization reached CUDA) makes
    ``capture_end`` stop at ``cudaStreamEndCapture``, which still ends the stream's capture but skips the rest of
    torch's bookkeeping (``aten/src/ATen/cuda/CUDAGraph.cpp``, ``CUDAGraph::capture_end``): the allocator keeps
    routing into the pool (a later capture into it is refused: "beginAllocateToPool: already recording to
    mempool_id"), the pool keeps the capture's reference (its memory is never freed), and up to torch 2.11 the
    default CUDA generator stays in capture mode (every later random draw outside capture raises "Offset
    increment outside graph capture encountered unexpectedly"; torch later keeps that state per capture,
    pytorch/pytorch#176752). Each is undone here; the graph is reset in both cases.
    """
    if torch.cuda.is_current_stream_capturing():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "The CUDA Graph is empty" when it failed before any kernel
                graph.capture_end()
        except Exception:  # noqa: BLE001 - an invalidated capture: handled below
            pass
    if not _capture_ended(graph):
        device = torch.cuda.current_device()
        torch_compat.end_allocate_to_pool(device, handle)
        use_count = getattr(pool, "use_count", None)
        if isinstance(pool, torch.cuda.MemPool) and use_count is not None and use_count() > 1:
            # the capture's reference; the MemPool object's own keeps the count above zero
            torch_compat.release_pool(device, handle)
        _end_rng_capture_mode()
    graph.reset()


def _capture_ended(graph: "torch.cuda.CUDAGraph") -> bool:
    """Whether ``capture_end`` got as far as owning the pool reference (``graph.pool()`` refuses otherwise)."""
    try:
        graph.pool()
    except RuntimeError:
        return False
    return True


def _end_rng_capture_mode() -> None:
    """Take the current device's default CUDA generator out of capture mode, which torch up to 2.11 enters in
    ``capture_begin`` and leaves only in a ``capture_end`` that succeeds: one empty capture that ends normally (its
    ``capture_begin`` registers the same generator state, its ``capture_end`` clears the mode, and graphs captured
    earlier keep sharing that state). Harmless where the state is kept per capture. Call it on a non-default
    stream, outside any capture."""
    try:
        repair = torch.cuda.CUDAGraph()
        repair.capture_begin(pool=torch.cuda.graph_pool_handle())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
            repair.capture_end()
        repair.reset()
    except Exception as exc:  # noqa: BLE001 - never hide the capture's own error
        warnings.warn(f"cg_lightning: could not take the CUDA generator out of capture mode after a failed "
                      f"capture ({type(exc).__name__}: {exc}); random draws on the GPU may fail", stacklevel=3)


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
