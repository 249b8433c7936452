"""One CUDA graph capture that, when it fails, leaves the process usable as before it.

What torch does, in ``aten/src/ATen/cuda/CUDAGraph.cpp`` (torch 2.11; later releases keep the allocator steps):

* ``capture_begin`` puts the default CUDA generator in capture mode (up to 2.11), then makes both caching
  allocators route the capture's allocations into the pool: the device allocator (``beginAllocateToPool``,
  taking a pool reference) and the pinned-host allocator (``begin_allocate_to_pool``, which also takes one,
  ``aten/src/ATen/core/CachingHostAllocator.h``), then ``cudaStreamBeginCapture``.
* ``capture_end`` calls ``cudaStreamEndCapture`` first. When CUDA invalidated the capture (a synchronization, a
  copy to the host), that call ends the stream's capture but raises, so nothing after it runs: both allocators
  keep routing into the pool and the generator stays in capture mode (every later random draw outside capture
  raises "Offset increment outside graph capture encountered unexpectedly"; torch later keeps that state per
  capture, pytorch/pytorch#176752).
* ``reset`` gives both pool references back, but only after a ``capture_end`` that got to its last line.
* Both allocators refuse to share a pool whose count fell to zero while it is still listed (``use_count > 0``
  internal assert). A host pool is listed until ``torch._C._host_emptyCache`` drops it, which ``torch.cuda.graph``
  calls before every capture (``torch/cuda/graphs.py``), and so does :func:`guarded_capture`.

So after a capture that stopped half-way, :func:`guarded_capture` ends the device routing
(``_cuda_endAllocateToPool``, the device allocator only), takes the generator out of capture mode, and never
captures into that pool again: no torch API ends the pinned-host allocator's routing, and a new capture into the
pool would be refused by it after the device allocator had already started routing. Later captures that ask for
the pool get a replacement pool instead (:func:`capture_pool`). No pool count is changed by hand: the half-way
capture's references are never given back, so the retired pool's memory stays reserved until the process ends.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Dict, Iterator, List, Optional

import torch

from ... import torch_compat

#: pool id -> the ``torch.cuda.MemPool`` that captures asking for it get instead (created at the first such
#: capture); an id is here once a capture into it stopped half-way
_replacements: Dict[tuple, Optional["torch.cuda.MemPool"]] = {}
#: graphs whose capture stopped half-way, kept alive: the pinned-host allocator's routing entry that nothing ends
#: refers to its graph object (``CUDAGraph::create_allocate_filter`` captures ``this``)
_abandoned: List["torch.cuda.CUDAGraph"] = []


def _key(handle) -> tuple:
    return tuple(handle)


def capture_pool(pool) -> tuple:
    """The allocator pool id to capture into for ``pool``: a ``torch.cuda.MemPool``'s id, a handle
    (``torch.cuda.graph_pool_handle()``, ``graph.pool()``) as it is, a fresh handle for ``None``; for a pool that a
    capture stopped half-way in, its replacement pool's id. Call it on the capture's device, outside capture."""
    if pool is None:
        return torch.cuda.graph_pool_handle()
    handle = pool.id if isinstance(pool, torch.cuda.MemPool) else pool
    while _key(handle) in _replacements:
        replacement = _replacements[_key(handle)]
        if replacement is None:
            replacement = _replacements[_key(handle)] = torch.cuda.MemPool()
        handle = replacement.id
    return handle


def _retire(handle, pool) -> None:
    """Captures asking for ``handle`` go to a replacement pool from now on. When ``pool`` (what the capture asked
    for) is a ``torch.cuda.MemPool``, that entry goes with it: nothing can ask for ``handle`` any more then."""
    key = _key(handle)
    if key in _replacements:
        return
    _replacements[key] = None
    if isinstance(pool, torch.cuda.MemPool):
        try:
            weakref.finalize(pool, _replacements.pop, key, None)
        except TypeError:  # not weakly referenceable: the replacement lives as long as the process
            pass


@contextlib.contextmanager
def guarded_capture(graph: "torch.cuda.CUDAGraph", stream: "torch.cuda.Stream", pool=None) -> Iterator[None]:
    """Capture the block's work on ``stream`` (not the default stream) into ``graph``, as ``torch.cuda.graph``
    does: synchronize, empty both allocators' caches, ``capture_begin``, the block, ``capture_end``. ``pool``: a
    ``torch.cuda.MemPool``, a pool handle or ``None`` (a pool of its own); see :func:`capture_pool`.

    Unlike ``torch.cuda.graph``, an exception in the block or in ``capture_end`` leaves no capture behind
    (:func:`abandon_capture`): ``stream`` capturing nothing, the previous current stream restored, the device
    allocator routing nothing, the CUDA generator usable outside capture, ``graph`` reset. The exception
    propagates unchanged.

    Raises:
        RuntimeError: if ``stream`` is already capturing (nothing is begun then).
    """
    handle = capture_pool(pool)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch_compat.empty_host_cache()  # drops host pools whose count fell to zero, so that they can be made again
    with torch.cuda.stream(stream):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("cg_lightning: the capture stream is already capturing; no new capture was begun")
        try:
            graph.capture_begin(pool=handle)
        except BaseException:
            # capture_begin may have stopped after the allocators started routing into the pool: never use it again
            _retire(handle, pool)
            _end_rng_capture_mode()
            raise
        try:
            yield
            graph.capture_end()
        except BaseException:
            with torch.cuda.stream(stream):  # the block may have left another stream current
                abandon_capture(graph, handle, pool)
            raise


def abandon_capture(graph: "torch.cuda.CUDAGraph", handle, pool=None) -> None:
    """End, on its stream and device, a capture whose block or ``capture_end`` raised; undo what it left.

    A capture still intact (the error was raised before CUDA saw anything illegal) ends normally and is reset, so
    the allocators and the generator are as after any capture. One whose ``capture_end`` stopped before its last
    line (CUDA invalidated it, or it failed later) is handled once, here: the device allocator's routing into
    ``handle`` is ended if it is still there, the pool is retired (:func:`capture_pool`), the generator taken out of
    capture mode, ``graph`` reset and kept alive.
    """
    if torch.cuda.is_current_stream_capturing():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "The CUDA Graph is empty" when it failed before any kernel
                graph.capture_end()
        except Exception:  # noqa: BLE001 - cudaStreamEndCapture ended the capture and raised: handled below
            pass
    if torch.cuda.is_current_stream_capturing():
        warnings.warn("cg_lightning: a failed CUDA graph capture could not be ended; later CUDA work in this "
                      "process may fail", stacklevel=3)
        return
    if _capture_ended(graph):
        graph.reset()  # gives back the pool references capture_begin took, in both allocators
        return
    torch_compat.end_allocate_to_pool(torch.cuda.current_device(), handle)
    _retire(handle, pool)
    _abandoned.append(graph)
    graph.reset()
    _end_rng_capture_mode()


def _capture_ended(graph: "torch.cuda.CUDAGraph") -> bool:
    """Whether ``capture_end`` got to its last line (``graph.pool()`` refuses otherwise)."""
    try:
        graph.pool()
    except RuntimeError:
        return False
    return True


def _end_rng_capture_mode() -> None:
    """Take the current device's default CUDA generator out of capture mode, which torch up to 2.11 enters in
    ``capture_begin`` and leaves only in a ``capture_end`` that gets past ``cudaStreamEndCapture``: one empty
    capture into a fresh pool that ends normally (its ``capture_begin`` registers the same generator state, its
    ``capture_end`` clears the mode; graphs captured earlier keep sharing that state). Harmless where the state is
    kept per capture. Call it on a non-default stream that is not capturing."""
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
