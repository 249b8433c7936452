"""Private APIs of torch's device and host caching allocators (part of :mod:`cg_lightning.torch_compat`, which
re-exports every name here): ending a capture's routing into a graph pool, emptying the pinned-host cache, and
returning cuBLAS workspaces.

Imports only torch.
"""

from __future__ import annotations

import torch


def end_allocate_to_pool(device: int, pool) -> bool:
    """``torch._C._cuda_endAllocateToPool``: the device caching allocator stops routing a capture's allocations into
    ``pool`` (a pool id); the pinned-host allocator is not touched (no torch API reaches it). ``CUDAGraph.capture_end``
    does this, except when ``cudaStreamEndCapture`` raises (an invalidated capture). Returns ``False``, doing
    nothing, when nothing is routed into ``pool`` (``capture_end`` got that far) or the installed torch lacks the API
    (then a later ``torch.cuda.empty_cache()`` trips the allocator's ``captures_underway.empty()`` assert)."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return False
    try:
        end(device, pool)
    except RuntimeError:  # "not currently recording to mempool_id"
        return False
    return True


def empty_host_cache() -> None:
    """``torch._C._host_emptyCache``: the pinned-host caching allocator frees its unused blocks and forgets the graph
    pools whose count fell to zero, so that a later capture can make them again (its ``create_or_incref_pool``
    asserts ``use_count > 0`` on a pool still listed). ``torch.cuda.graph`` calls it before every capture
    (``torch/cuda/graphs.py``, torch 2.11 and later). Does nothing where torch lacks it (a CPU-only build)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def clear_cublas_workspaces() -> None:
    """``torch._C._cuda_clearCublasWorkspaces``: return the cuBLAS (and cuBLASLt) workspaces torch keeps per handle
    and stream (``CublasHandlePool.cpp``) to the caching allocator; the next GEMM on a stream allocates its own
    again. Inductor's CUDA-graph trees call it around warmup and recording (``clear_cublass_cache`` in
    ``torch/_inductor/cudagraph_trees.py``). Only safe where no captured graph still uses a workspace allocated
    outside its pool. Does nothing where torch lacks it (a CPU-only build)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_available():
        clear()
