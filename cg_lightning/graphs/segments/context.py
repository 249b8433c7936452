"""A segment's shared context: the arguments after the chained one that every member is called with.

Hugging Face decoder layers are called as ``layer(h, attention_mask=m, position_embeddings=(cos, sin),
position_ids=p, use_cache=False, ...)``, every argument but ``h`` the same for all layers of a forward. Such calls
chain (:func:`.chains.shares_context` decides from the recorded steps). At capture each following member's static
inputs for those tensors become the first member's (:func:`share_context_inputs`), so the segment's launch copies
them in once, with the first member's own arguments. At replay the launch keeps what the first call was given
(:meth:`SharedContext.start`) and each following member's call is checked against it (:meth:`SharedContext.check`):
the same tensors, unchanged since the launch and requiring no gradient, and equal constants.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ... import torch_compat
from ...torch_compat import tree_flatten
from ..signature import _same_value
from .chains import CONSTANTS, _same_tensor
from ..errors import SegmentError

_MISSING = object()


def has_context(runner) -> bool:
    """``runner``'s call has arguments besides its first positional tensor (it is not ``layer(x)``)."""
    signature = runner.signature
    return not (signature.positional_tensors and len(signature.metas) == 1)


def share_context_inputs(first, runner) -> None:
    """Make ``runner``'s static inputs after its first the first member's (``first``): a member called with the
    segment's shared context reads the tensors the launch copied in. Call before ``runner.capture_forward()``."""
    for j in range(1, runner.num_inputs):
        runner.static_inputs[j] = first.static_inputs[j]


def version(t: torch.Tensor) -> Optional[int]:
    """``t``'s version counter; ``None`` for an inference tensor (it has none, and cannot change in training)."""
    return None if t.is_inference() else torch_compat.version(t)


def _frozen(x) -> bool:
    """``x`` stays what it is while it is the same object: a tensor (its version counter tells changes in place),
    a constant, or a tuple of such."""
    return isinstance(x, torch.Tensor) or type(x) in CONSTANTS or (type(x) is tuple and all(map(_frozen, x)))


class SharedContext:
    """The first call's arguments after the first, for the current pass of one segment."""

    def __init__(self) -> None:
        self._rest: tuple = ()
        self._kwargs: dict = {}
        self._spec = None
        self._leaves: list = []
        self._tensors: list = []  # (tensor, version at the launch)
        self._by_identity = False

    def start(self, args: tuple, kwargs: dict) -> None:
        """At the segment's launch: keep the first call's arguments after its first (until :meth:`release`)."""
        leaves, self._spec = tree_flatten((args, kwargs))
        self._leaves = leaves[1:]
        self._tensors = [(x, version(x)) for x in self._leaves if isinstance(x, torch.Tensor)]
        self._rest, self._kwargs = args[1:], kwargs
        self._by_identity = all(map(_frozen, self._rest)) and all(map(_frozen, kwargs.values()))

    def release(self) -> None:
        """Drop the kept arguments (an attention mask can be large): after the last member's call."""
        self._rest, self._kwargs, self._leaves, self._tensors = (), {}, [], []

    def check(self, runner, args: tuple, kwargs: dict) -> None:
        """Raise unless a following member's call (``runner``'s) has, after its first argument, the arguments of the
        segment's first call in this pass: the same objects (fast path), or the same tensors and equal constants.

        Raises:
            SegmentError: naming the layer and each differing argument.
        """
        if self._by_identity and len(args) == len(self._rest) + 1 and len(kwargs) == len(self._kwargs) \
                and all(a is b for a, b in zip(args[1:], self._rest)) \
                and all(self._kwargs.get(k, _MISSING) is v for k, v in kwargs.items()) \
                and all(version(t) == v and not t.requires_grad for t, v in self._tensors):
            return
        problems = self.mismatches(runner.signature.names, args, kwargs)
        if problems:
            raise SegmentError(
                f"graphed {runner.name!r} is inside a segment (graphs.segments=true) whose graphs already ran for this "
                "pass with the arguments of the segment's first call, but it was called with other ones:\n  "
                + "\n  ".join(problems)
                + "\nA segment replays all or none of its layers. Pass every layer the same mask, position "
                "embeddings and flags (the same tensors, unchanged), or set graphs.segments=false for this model."
            )

    def mismatches(self, names: List[str], args: tuple, kwargs: dict) -> List[str]:
        """One line per argument after the first that differs from the first call's (``names``: the captured
        signature's argument names)."""
        leaves, spec = tree_flatten((args, kwargs))
        if spec != self._spec:
            return [f"argument structure: the segment's first call had {self._spec}, got {spec}"]
        versions = iter(v for _, v in self._tensors)
        out = []
        for i, (x, y) in enumerate(zip(leaves[1:], self._leaves), 1):
            name = names[i] if i < len(names) else f"argument {i}"
            if isinstance(y, torch.Tensor):
                launched = next(versions)
                if not isinstance(x, torch.Tensor) or not (x is y or _same_tensor(x, y)):
                    out.append(f"{name}: another tensor than the segment's first call's")
                elif x.requires_grad:
                    out.append(f"{name}: requires grad (shared context must not)")
                elif version(x) != launched:
                    out.append(f"{name}: changed in place since the segment's first call")
            elif isinstance(x, torch.Tensor) or not _same_value(x, y):
                out.append(f"{name}: {x!r}, the segment's first call had {y!r}")
        return out
