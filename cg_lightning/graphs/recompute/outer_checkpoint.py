"""Layers that checkpoint around their own ``__call__``: the checkpoint moves inside ``forward``.

transformers' ``GradientCheckpointingLayer`` (decoder layers of Llama, Mistral, Qwen, GPT-2, ...) checkpoints
itself when ``gradient_checkpointing_enable()`` set ``gradient_checkpointing`` and ``_gradient_checkpointing_func``
on it. Up to transformers 5.17 at least, its class overrides ``__call__`` and runs
``self._gradient_checkpointing_func(partial(nn.Module.__call__, **kwargs), *args)``: the checkpoint wraps the
``forward`` that the graph manager replaces. A reentrant checkpoint then makes every training call arrive under
``no_grad`` (nothing could be graphed) and a non-reentrant one under saved-tensor hooks (capture refuses). Later
transformers versions checkpoint inside ``forward`` instead, so that module hooks stay outside the recomputation.

For a selected layer of the first kind, :func:`checkpointed_forward` applies the layer's own checkpoint function
inside the forward (exactly what the later versions do) and :func:`hold` swaps the function the class calls
around ``__call__`` for a pass-through, so the call reaches the graph manager with autograd on. Turning
checkpointing off or on again (``gradient_checkpointing_disable``/``_enable``) keeps working: the flag is read at
every call, and a new checkpoint function is held at the next step (:func:`hold`).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn as nn


#: the attribute transformers sets on each checkpointing layer (the library's, not torch's)
FUNCTION = "_gradient_checkpointing_func"


class PassThrough:
    """Stands in for a layer's ``_gradient_checkpointing_func`` around ``__call__``: calls straight through.
    ``inner`` is the layer's checkpoint function, applied inside ``forward`` by :func:`checkpointed_forward`."""

    def __init__(self, inner: Callable) -> None:
        self.inner = inner

    def __call__(self, function: Callable, *args):
        return function(*args)


def checkpoints_around_call(module: nn.Module) -> bool:
    """Whether ``module``'s class overrides ``__call__`` and carries a ``gradient_checkpointing`` flag (the
    convention above)."""
    cls = type(module)
    return cls.__call__ is not nn.Module.__call__ and isinstance(getattr(cls, "gradient_checkpointing", None), bool)


def hold(module: nn.Module) -> None:
    """Swap the checkpoint function set on ``module`` (if any, and not yet swapped) for a :class:`PassThrough`."""
    function = module.__dict__.get(FUNCTION)
    if function is not None and not isinstance(function, PassThrough):
        setattr(module, FUNCTION, PassThrough(function))


def release(module: nn.Module) -> None:
    """Give ``module`` its own checkpoint function back."""
    function = module.__dict__.get(FUNCTION)
    if isinstance(function, PassThrough):
        setattr(module, FUNCTION, function.inner)


def checkpointed_forward(module: nn.Module, forward: Callable) -> Callable:
    """``forward`` run through the layer's checkpoint function when the class's ``__call__`` would have
    checkpointed it (flag on, training mode, autograd on) and that function is held (:func:`hold`)."""

    def call(*args, **kwargs):
        function = module.__dict__.get(FUNCTION)
        if (isinstance(function, PassThrough) and module.gradient_checkpointing and module.training
                and torch.is_grad_enabled()):
            return function.inner(functools.partial(forward, **kwargs), *args)
        return forward(*args, **kwargs)

    return call
