"""Call signatures: what a captured graph was built for, and how a later call differs from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

import torch
from .. import torch_compat
from .errors import GraphSignatureError


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype, device, ``requires_grad`` and memory layout of one tensor argument.

    ``strides`` keeps the strides of the dimensions longer than 1 (the others do not change the layout).
    A graph's kernels were chosen for the captured layout; an argument with another layout is copied into
    the static buffer and would run those kernels on data eager execution would have read differently
    (measured: 6e-8 off), so it counts as another signature.
    """

    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    strides: Tuple[int, ...] = ()

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        return cls(tuple(t.shape), t.dtype, t.device, t.requires_grad, _layout(t))

    def __str__(self) -> str:
        grad = ", requires_grad" if self.requires_grad else ""
        layout = "" if self.strides == _contiguous_layout(self.shape) else f", strides {list(self.strides)}"
        return f"Tensor{list(self.shape)} {str(self.dtype).replace('torch.', '')} on {self.device}{grad}{layout}"


def _layout(t: torch.Tensor) -> Tuple[int, ...]:
    return tuple(st for st, n in zip(t.stride(), t.shape) if n > 1)


def _contiguous_layout(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc if n > 1 else None)
        acc *= n
    return tuple(s for s in reversed(strides) if s is not None)


def _leaf_names(args: tuple, kwargs: dict) -> List[str]:
    with_path, _ = torch_compat.tree_flatten_with_path((args, kwargs))
    names = []
    for path, _ in with_path:
        top = path[0].idx if hasattr(path[0], "idx") else 0
        rest = torch_compat.keystr(path[1:])
        names.append(f"args{rest}" if top == 0 else f"kwargs{rest}")
    return names


class CallSignature:
    """The structure and argument metadata of one call ``layer(*args, **kwargs)``.

    Tensors are compared by :class:`TensorMeta`; every other leaf (ints, flags, ``None``) by value.
    """

    def __init__(self, args: tuple, kwargs: dict) -> None:
        leaves, self.spec = torch_compat.tree_flatten((args, kwargs))
        self.is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        self.metas = [TensorMeta.of(x) if t else x for x, t in zip(leaves, self.is_tensor)]
        # The common call ``layer(x)`` / ``layer(x, mask)``: positional tensors only. Its checks skip torch_compat.
        self.positional_tensors = not kwargs and all(isinstance(x, torch.Tensor) for x in args)
        self._names = None
        self._names_src = (args, kwargs)

    @property
    def names(self) -> List[str]:
        if self._names is None:
            self._names = _leaf_names(*self._names_src)
            self._names_src = None
        return self._names

    def tensor_leaves(self, args: tuple, kwargs: dict) -> List[torch.Tensor]:
        if self.positional_tensors and not kwargs and len(args) == len(self.metas):
            return list(args)
        leaves, _ = torch_compat.tree_flatten((args, kwargs))
        return [x for x, t in zip(leaves, self.is_tensor) if t]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Tuple[tuple, dict]:
        """Arguments of this signature with the given tensors in the tensor slots."""
        if self.positional_tensors:
            return tuple(tensors), {}
        it = iter(tensors)
        leaves = [next(it) if t else m for m, t in zip(self.metas, self.is_tensor)]
        return torch_compat.tree_unflatten(leaves, self.spec)

    def mismatches(self, args: tuple, kwargs: dict) -> List[str]:
        """One line per differing argument: ``name: captured X, got Y``; empty when the call matches."""
        leaves, spec = torch_compat.tree_flatten((args, kwargs))
        if spec != self.spec:
            return [f"argument structure: captured {self.spec}, got {spec}"]
        out = []
        for i, (x, meta, is_t) in enumerate(zip(leaves, self.metas, self.is_tensor)):
            if is_t:
                got = TensorMeta.of(x) if isinstance(x, torch.Tensor) else x
                if isinstance(got, TensorMeta) and got != meta and got == dataclasses.replace(meta, strides=got.strides):
                    out.append(f"{self.names[i]}: another memory layout, same {got}: captured strides "
                               f"{list(meta.strides)}, got {list(got.strides)} (dims longer than 1); pass the "
                               "same view every step, e.g. .contiguous()")
                elif got != meta:
                    out.append(f"{self.names[i]}: captured {meta}, got {got}")
            elif isinstance(x, torch.Tensor) or not _same_value(x, meta):
                out.append(f"{self.names[i]}: captured {meta!r}, got {x!r}")
        return out

    def matches(self, args: tuple, kwargs: dict) -> bool:
        if self.positional_tensors:
            if kwargs or len(args) != len(self.metas):
                return False
            return all(_meta_matches(x, meta) for x, meta in zip(args, self.metas))
        leaves, spec = torch_compat.tree_flatten((args, kwargs))
        if spec != self.spec:
            return False
        for x, meta, is_t in zip(leaves, self.metas, self.is_tensor):
            if is_t:
                if not _meta_matches(x, meta):
                    return False
            elif isinstance(x, torch.Tensor) or not _same_value(x, meta):
                return False
        return True


def _meta_matches(x: Any, meta: TensorMeta) -> bool:
    """``x`` is a tensor with ``meta``'s shape, dtype, device, ``requires_grad`` and layout."""
    return (
        isinstance(x, torch.Tensor)
        and x.shape == meta.shape
        and x.dtype == meta.dtype
        and x.device == meta.device
        and x.requires_grad == meta.requires_grad
        and _layout(x) == meta.strides
    )


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False
