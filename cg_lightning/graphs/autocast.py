"""Autocast settings of graphed calls: recorded per call, re-entered for warmup, capture and recomputation,
and switched off for every backward pass (as Lightning, Accelerate and torch's AMP recipe run them)."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch


_device_types: Optional[tuple] = None


def autocast_state() -> tuple:
    """The autocast settings in force now, per device type: ``((device_type, enabled, dtype), ...)``.

    Read at every graphed call (a replay must match its capture's settings), so the device types are
    looked up once per process."""
    global _device_types
    if _device_types is None:
        _device_types = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    return tuple((dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)) for dt in _device_types)


@contextlib.contextmanager
def autocast_as(state: Optional[tuple]):
    """Enter the autocast settings ``state`` (from :func:`autocast_state`), weight-cast cache off; ``None``:
    leave the surrounding settings as they are. A layer call recorded under its own autocast settings (a
    block run with autocast disabled, say) is warmed up, captured and, on the eager backend, replayed
    under them, not under those of the step's first graphed call where capture happens."""
    if state is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        for dt, enabled, dtype in state:
            stack.enter_context(torch.autocast(dt, dtype=dtype, enabled=enabled, cache_enabled=False))
        yield


@contextlib.contextmanager
def autocast_off():
    """Autocast disabled for every device type: the context of every backward pass we run or capture.

    Lightning, Accelerate and torch's AMP recipe run ``backward()`` outside autocast, and so the backward
    kernels of an autocast forward see the dtypes the forward saved, nothing more. Graphs are captured
    inside a layer call, under the step's autocast; autograd passes its thread-local state to the
    backward, so without this a layer run with autocast disabled (an fp32 block in a bf16-mixed model)
    would get its weight gradients from bf16-cast GEMMs (measured on an H200: losses off by 2e-3 from the
    step after capture on).
    """
    with autocast_as(tuple((dt, False, dtype) for dt, _, dtype in autocast_state())):
        yield


@contextlib.contextmanager
def uncached_autocast():
    """Keep the surrounding autocast (dtype, enabled) but with its weight-cast cache off.

    A cached cast made before capture would be baked into the graph and never see updated weights;
    capture must not depend on how a Lightning version configures the cache.
    """
    enabled = tuple(s for s in autocast_state() if s[1])
    if enabled:
        torch.clear_autocast_cache()
    with autocast_as(enabled):
        yield
