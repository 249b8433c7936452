"""Every private torch API the package uses, in one place, each with what it is and a version gate.

The lowest torch the package supports is :data:`TORCH_FLOOR`. Each entry below names the feature that needs
it. Where a public path exists, a torch without the private API falls back to it; where none exists, the
first use raises :class:`TorchAPIMissing` naming the feature, the installed torch and what to do. Nothing
else in ``cg_lightning`` touches ``torch._*``, ``torch._C``, ``torch.utils._*``, private attributes of
tensors, modules or optimizers, or private ``torch.distributed`` functions (a test greps the package).
The ``torch.distributed`` ones are in :mod:`.distributed`, those of the device and host allocators in
:mod:`.memory`, both re-exported here.

Imports only torch.
"""

from __future__ import annotations

import contextlib
import operator
import re
from typing import Callable, Dict, Iterator, List, Sequence

import torch
import torch.utils.hooks
import torch.utils.checkpoint as _torch_checkpoint
from torch.nn.modules import module as _module
from torch.optim import optimizer as _optimizer_module
from torch.utils import _pytree
from torch.utils import _python_dispatch

#: the lowest torch version the package supports (the GPU image's)
TORCH_FLOOR = (2, 11)


def torch_version() -> tuple:
    """``(major, minor)`` of the installed torch."""
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    return int(major), int(minor)


class TorchAPIMissing(RuntimeError):
    """A private torch API a feature needs is not in the installed torch."""


def _missing(api: str, feature: str, remedy: str) -> TorchAPIMissing:
    floor = ".".join(map(str, TORCH_FLOOR))
    return TorchAPIMissing(
        f"cg_lightning: {feature} needs {api}, which torch {torch.__version__} does not have (cg_lightning supports "
        f"torch >= {floor} and is tested there). {remedy}"
    )


# ------------------------------------------------------------------------- pytrees
#: ``torch.utils._pytree``: flattening nested call arguments and layer outputs (signatures, replays). Present in
#: every supported torch; torch.compile and torch.export use it too.
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_map = _pytree.tree_map
tree_flatten_with_path = _pytree.tree_flatten_with_path
keystr = _pytree.keystr

# ------------------------------------------------------------------------- dispatch modes
#: ``torch.utils._python_dispatch.TorchDispatchMode``: sees every aten operation, to refuse host syncs inside a
#: captured layer with the user's source line (graphs.host_sync).
TorchDispatchMode = _python_dispatch.TorchDispatchMode

# ------------------------------------------------------------------------- tensors
#: ``Tensor._version``: the in-place version counter; segments and graph-buffer reuse catch a tensor changed in
#: place between two graphed calls. C-level getter for the hot paths.
VERSION = operator.attrgetter("_version")


def version(t: torch.Tensor) -> int:
    """``t._version`` (see :data:`VERSION`)."""
    return t._version


def grad_hooks(t: torch.Tensor):
    """``Tensor._backward_hooks``: the gradient hooks registered with ``register_hook`` (``None`` or a dict), to
    refuse hooks a replay would skip."""
    return t._backward_hooks


def post_accumulate_grad_hooks(t: torch.Tensor):
    """``Tensor._post_accumulate_grad_hooks`` (``None`` or a dict): hooks a replay would skip."""
    return getattr(t, "_post_accumulate_grad_hooks", None)  # a plain tensor may lack the slot


# ------------------------------------------------------------------------- module and optimizer hooks
_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_MODULE_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                        "_global_backward_hooks")


def module_hooks(module: torch.nn.Module) -> Dict[str, dict]:
    """``nn.Module``'s per-module hook dictionaries by kind (``forward_pre_hooks``, ``forward_hooks``,
    ``backward_pre_hooks``, ``backward_hooks``): hooks that would run at capture only, or between two calls that a
    segment's graph runs together. Read each time: a hook added later lands in the same dictionaries."""
    return {kind.strip("_"): getattr(module, kind) for kind in _MODULE_HOOKS if hasattr(module, kind)}


def hook_handles_created() -> int:
    """``torch.utils.hooks.RemovableHandle.next_id``: how many hook handles (module, tensor, optimizer hooks) were
    created in this process; it changes when any hook is added, so a changed value means "look again"."""
    return torch.utils.hooks.RemovableHandle.next_id


def global_module_hooks() -> Dict[str, dict]:
    """``torch.nn.modules.module``'s global hook dictionaries by kind (``global_forward_pre_hooks``, ...)."""
    return {kind.strip("_"): getattr(_module, kind) for kind in _GLOBAL_MODULE_HOOKS if hasattr(_module, kind)}


def optimizer_has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` has step pre/post hooks of its own or global ones (``Optimizer._optimizer_step_pre_hooks``
    and ``torch.optim.optimizer._global_optimizer_pre_hooks``, their post counterparts): a replayed step skips them."""
    return bool(
        getattr(optimizer, "_optimizer_step_pre_hooks", None)
        or getattr(optimizer, "_optimizer_step_post_hooks", None)
        or getattr(_optimizer_module, "_global_optimizer_pre_hooks", None)
        or getattr(_optimizer_module, "_global_optimizer_post_hooks", None)
    )


# ------------------------------------------------------------------------- autograd
def will_engine_execute_node(node) -> bool:
    """``torch._C._will_engine_execute_node``: whether the running backward pass will execute ``node`` (a replay
    node asks it of its parameters' ``AccumulateGrad`` nodes, to refuse ``torch.autograd.grad`` that leaves them
    out). Raises ``RuntimeError`` when called on a leaf node during ``autograd.grad``, as torch does."""
    check = getattr(torch._C, "_will_engine_execute_node", None)
    if check is None:
        raise _missing("torch._C._will_engine_execute_node", "refusing torch.autograd.grad through a graphed layer",
                       "Use the supported torch, or call loss.backward() only.")
    return check(node)


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are active (``torch._C._autograd._top_saved_tensors_default_hooks``): a graphed
    layer inside a non-reentrant ``torch.utils.checkpoint`` is refused at capture. Without the API (no public
    equivalent) nothing is detected and capture proceeds, as the layer would then fail at its recomputation."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


@contextlib.contextmanager
def reentrant_checkpoint_calls(direct: Callable) -> Iterator[None]:
    """Within the block, ``torch.utils.checkpoint.CheckpointFunction.apply(function, preserve_rng_state, *args)``
    (the reentrant path of ``torch.utils.checkpoint.checkpoint``, a class outside its public API) calls
    ``direct(function, preserve_rng_state, *args)`` instead; restored afterwards. Graph warmup and capture bypass
    reentrant recomputation this way."""
    cls = getattr(_torch_checkpoint, "CheckpointFunction", None)
    if cls is None:
        raise _missing("torch.utils.checkpoint.CheckpointFunction", "graphing a layer that uses reentrant "
                       "torch.utils.checkpoint", "Use cg_lightning.checkpoint or use_reentrant=False in the layer.")
    had_own = "apply" in cls.__dict__
    original = cls.__dict__.get("apply")
    cls.apply = staticmethod(direct)
    try:
        yield
    finally:
        if had_own:
            cls.apply = original
        else:
            del cls.apply


# ------------------------------------------------------------------------- torch.compile
def is_compiled(fn: Callable) -> bool:
    """Whether ``fn`` is a ``torch.compile`` wrapper: dynamo marks the functions it wraps with
    ``_torchdynamo_orig_callable`` (graphs.compile keeps a forward the user compiled as it is)."""
    return hasattr(fn, "_torchdynamo_orig_callable")


#: the types of aten operators as Python sees them (``torch.ops.aten.add``, ``torch.ops.aten.add.Tensor``)
OP_TYPES = (torch._ops.OpOverloadPacket, torch._ops.OpOverload)


def contains_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` or a submodule is compiled: a ``torch.compile(module)`` wrapper (``OptimizedModule``, in
    ``torch._dynamo.eval_frame``), or a ``forward`` replaced by a compiled function (:func:`is_compiled`)."""
    return any(_compiled_here(m) for m in module.modules())


def _compiled_here(m: torch.nn.Module) -> bool:
    """``m`` is a ``torch.compile`` wrapper or has a compiled ``forward`` of its own."""
    forward = m.__dict__.get("forward")
    return (type(m).__name__ == "OptimizedModule" and hasattr(m, "_orig_mod")) or (
        forward is not None and is_compiled(forward))


def compiled_around(module: torch.nn.Module, inner: Sequence[torch.nn.Module]) -> bool:
    """Whether compiled code runs any of ``inner`` from outside it: a ``torch.compile`` wrapper, or a compiled
    ``forward``, of ``module`` or a submodule that holds one of ``inner`` below itself (a layer compiled on its
    own does not count)."""
    wanted = {id(m) for m in inner}
    return any(_compiled_here(m) and any(id(sub) in wanted for sub in m.modules() if sub is not m)
               for m in module.modules())


# ------------------------------------------------------------------------- memory
def non_owning_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor viewing ``t``'s memory without keeping it allocated (``torch._C._construct_storage_from_data_pointer``):
    make_graphed_callables' ``reuse_graph_buffers`` gives cloned gradient outputs back to the graph pool."""
    construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if construct is None:
        raise _missing("torch._C._construct_storage_from_data_pointer", "make_graphed_callables(reuse_graph_buffers=True)",
                       "Use the supported torch, or reuse_graph_buffers=False.")
    storage = construct(t.untyped_storage().data_ptr(), t.device, t.untyped_storage().nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())


# ------------------------------------------------------------------------- kernels
def _foreach_add_fallback(tensors: Sequence[torch.Tensor], others) -> None:
    if isinstance(others, (int, float)):
        for t in tensors:
            t.add_(others)
        return
    for t, o in zip(tensors, others):
        t.add_(o)


def foreach_add_(tensors: Sequence[torch.Tensor], others) -> None:
    """``torch._foreach_add_(tensors, others_or_scalar)``: the multi-tensor add behind ``main_grad`` additions and
    optimizer step counts; the same elementwise additions as ``add_`` one tensor at a time (the fallback).
    Looked up at each call, so that a profiler or test that wraps the torch function sees these calls."""
    getattr(torch, "_foreach_add_", _foreach_add_fallback)(tensors, others)


def foreach_copy_(tensors: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``torch._foreach_copy_(tensors, sources)``: one multi-tensor kernel for ``tensors[i].copy_(sources[i])``."""
    copy = getattr(torch, "_foreach_copy_", None)
    if copy is None:
        for t, s in zip(tensors, sources):
            t.copy_(s)
        return
    copy(tensors, sources)


def foreach_zero_(tensors: Sequence[torch.Tensor]) -> None:
    """``torch._foreach_zero_(tensors)``: one multi-tensor fill with zeros."""
    zero = getattr(torch, "_foreach_zero_", None)
    if zero is None:
        for t in tensors:
            t.zero_()
        return
    zero(tensors)


def group_tensors_by_device_and_dtype(lists: List[List[torch.Tensor]]) -> dict:
    """``torch.optim.Optimizer._group_tensors_by_device_and_dtype``: the grouping the fused and foreach optimizer
    steps use (the cached fused Adam step groups its lists once, the same way)."""
    group = getattr(torch.optim.Optimizer, "_group_tensors_by_device_and_dtype", None)
    if group is None:
        raise _missing("torch.optim.Optimizer._group_tensors_by_device_and_dtype", "graphs.cached_optimizer_step",
                       "Set graphs.cached_optimizer_step=False.")
    return group(lists)


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Set ``optimizer._opt_called``, what torch's LR-scheduler wrapper of ``step()`` records, so that a scheduler
    stepped after a replaced ``step()`` does not warn that the optimizer never stepped."""
    optimizer._opt_called = True


#: ``aten._to_copy``: the operator a dtype or device conversion (``.to``, autocast's casts) dispatches to
TO_COPY = torch.ops.aten._to_copy.default


def fused_adam_kernel(decoupled_weight_decay: bool) -> Callable:
    """``torch._fused_adamw_`` (``decoupled_weight_decay``) or ``torch._fused_adam_``: the kernels behind
    ``Adam(fused=True)``, called directly by the cached fused Adam step (``optim.fused_adam_step``)."""
    name = "_fused_adamw_" if decoupled_weight_decay else "_fused_adam_"
    kernel = getattr(torch, name, None)
    if kernel is None:
        raise _missing(f"torch.{name}", "the cached fused Adam step", "Use the supported torch, or an optimizer "
                       "built without fused=True (the step then runs through torch.optim).")
    return kernel


# ------------------------------------------------------------------------- device memory (re-exported)
from .memory import clear_cublas_workspaces, empty_host_cache, end_allocate_to_pool  # noqa: E402,F401

# ------------------------------------------------------------------------- distributed (re-exported)
from .distributed import (  # noqa: E402,F401
    bounded_store_client,
    broadcast_coalesced,
    default_store,
    set_group_timeout,
)
