"""Refusing what a CUDA graph cannot hold, with a message that says where it happened.

A captured graph replays device work only. Three things in a graphed layer break that silently or loudly:

* **host synchronizations**: ``.item()``, ``bool(tensor)`` (data-dependent ``if``), printing a tensor,
  ``.tolist()``, ``.nonzero()``, ``torch.unique``, ``masked_select``: the host waits for a value that a
  replay would never recompute. CUDA refuses them during capture with an opaque error; the eager backend
  would not notice at all. :class:`RefuseHostSync` (a ``TorchDispatchMode`` active while a forward or
  backward is captured, on every backend) raises :class:`HostSyncError` naming the operation and the
  user's source line instead, so CPU CI sees the same failure as a GPU;
* **hooks on submodules** of a graphed layer (and global module hooks): they run once, at capture, and
  never at replay. Hooks on the graphed layer itself are fine (they run around every replay).
  :func:`hooks_inside` lists them.

Raises are turned into :class:`~cg_lightning.graphs.replay.runner.GraphCaptureError` by the runner.
"""

from __future__ import annotations

import os
import traceback
from typing import List, Optional

import torch
from torch.overrides import TorchFunctionMode

from ..errors import HostSyncError
from ..observer_hooks import is_observer
from ...torch_compat import (
    TorchDispatchMode,
    global_module_hooks,
    grad_hooks,
    module_hooks,
    post_accumulate_grad_hooks,
)

_aten = torch.ops.aten

#: Operations whose result the host must read (or whose output shape depends on data).
_SYNC_OP_NAMES = {
    "_local_scalar_dense": ".item() / bool(tensor) / float(tensor) / printing a tensor",
    "nonzero": ".nonzero() (output shape depends on the data)",
    "masked_select": "masked_select / boolean-mask indexing (output shape depends on the data)",
    "_unique2": "torch.unique (output shape depends on the data)",
    "unique_consecutive": "torch.unique_consecutive (output shape depends on the data)",
    "unique_dim": "torch.unique(dim=...) (output shape depends on the data)",
    "equal": "torch.equal (returns a Python bool)",
    "is_nonzero": "bool(tensor) (data-dependent control flow)",
}
SYNC_OPS = {
    # aten operators by name: the set present differs between torch versions
    getattr(_aten, name).default: what for name, what in _SYNC_OP_NAMES.items() if hasattr(_aten, name)
}

# torch and this package's graphs/ (the frames of capture, replay and the whole step)
_SKIP_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



def _user_frame() -> Optional[str]:
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_SKIP_DIRS) and "/lightning/" not in path:
            return f'File "{frame.filename}", line {frame.lineno}, in {frame.name}: {frame.line}'
    return None


class RefuseHostSync(TorchDispatchMode):
    """Raise :class:`HostSyncError` on any operation of :data:`SYNC_OPS`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        what = SYNC_OPS.get(func)
        if what is not None:
            where = _user_frame()
            raise HostSyncError(
                f"host synchronization {func.__name__.split('.')[0]} ({what})"
                + (f" at {where}" if where else "")
            )
        return func(*args, **(kwargs or {}))


#: Tensor methods that hand tensor data to Python (on a CPU tensor they never reach the dispatcher).
_HOST_READS = {
    torch.Tensor.__repr__: "printing a tensor",
    torch.Tensor.__str__: "printing a tensor",
    torch.Tensor.__format__: "formatting a tensor into a string",
    torch.Tensor.tolist: ".tolist()",
    torch.Tensor.numpy: ".numpy()",
    torch.Tensor.item: ".item()",
    torch.Tensor.__bool__: "bool(tensor) (data-dependent control flow)",
    torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__float__: "float(tensor)",
}


class RefuseHostReads(TorchFunctionMode):
    """Raise :class:`HostSyncError` when a tensor's data is read by Python (printing, ``.tolist()``, ...)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = _HOST_READS.get(func)
        if what is not None:
            where = _user_frame()
            raise HostSyncError(f"host read of tensor data: {what}" + (f" at {where}" if where else ""))
        return func(*args, **(kwargs or {}))


class refuse_host_sync:
    """Both refusals together (context manager): active while a forward or backward is captured.

    ``enabled=False`` (a compiled forward, ``torch.compile``): nothing is refused here, since dynamo runs no
    compiled code while a dispatch mode is active (it falls back to the uncompiled frame, and may keep doing
    so); a host sync then fails the stream capture itself, without the user's source line."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def __enter__(self):
        self._modes = [RefuseHostReads(), RefuseHostSync()] if self.enabled else []
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        return False


def hook_dicts(layer: torch.nn.Module) -> List[dict]:
    """The hook dictionaries :func:`hooks_inside` reads (submodules' and the global ones), for a cheap
    ``any(dicts)`` re-check after capture: a hook added later lands in one of these same dictionaries."""
    found = [hooks for name, m in layer.named_modules() if m is not layer for hooks in module_hooks(m).values()]
    found += list(global_module_hooks().values())
    return found


def hooks_inside(layer: torch.nn.Module) -> List[str]:
    """Descriptions of the hooks that would run only at capture: module hooks on submodules (except
    transformers' output observers, :mod:`.observer_hooks`), global module hooks, and gradient hooks on the layer's parameters (``Tensor.register_hook``,
    ``register_post_accumulate_grad_hook``: a replay computes those gradients inside the graph)."""
    found = []
    for name, p in layer.named_parameters():
        if grad_hooks(p):
            found.append(f"gradient hook (register_hook) on parameter {name!r}")
        if post_accumulate_grad_hooks(p):
            found.append(f"post-accumulate-grad hook on parameter {name!r}")
    for name, module in layer.named_modules():
        if module is layer:
            continue
        for kind, hooks in module_hooks(module).items():
            if any(not (kind == "forward_hooks" and is_observer(hook)) for hook in hooks.values()):
                found.append(f"{kind.replace('_', ' ')[:-1]} on submodule {name!r}")
    for kind, hooks in global_module_hooks().items():
        if hooks:
            found.append(f"global module hook ({kind.replace('_', ' ')})")
    return found
