"""The optimizer step replayed from a graph, bit for bit the eager step: a fused ``torch.optim.Adam``/``AdamW``
update recorded with the values it runs with, replayed while those values hold.

A fused AdamW over ~150 tensors costs the host tens of microseconds per step even on cached lists
(:mod:`.fused_adam_step`): a graph replay is one launch. What makes a recorded step exact is what the fused
kernels read: each parameter's step count is a device tensor, and the bias corrections are computed from it
inside the kernel, the same under capture and eagerly; the learning rate, betas, weight decay and eps are kernel
arguments in double precision. torch's ``capturable`` path reads the learning rate from a float32 device tensor
instead (``lr_ptr`` in ``aten/src/ATen/native/cuda/fused_adam_utils.cuh``), which rounds it: not exact. So this
class records the cached lists' own calls (``torch._foreach_add_`` on the step counts, ``torch._fused_adamw_``)
with the groups' Python values as arguments, and replays the graph only while every group's values equal the
recorded ones (the idea of replaying the optimizer with the step: the PyTorch CUDA-graphs notes, "whole-network
capture"; the exactness argument is this package's).

Checked before every replay; where a check fails the step is recorded anew if its values equal the previous
step's, else it runs eagerly on the cached lists (the same kernels with the current values: exact either way, and
no warning):

* the cached lists still describe the optimizer (:meth:`CachedFusedAdamStep.usable`: the same groups, state
  tensors and ``.grad`` tensors, no step hooks, no GradScaler) and were not rebuilt since the recording;
* every group's ``lr``, ``betas``, ``weight_decay``, ``eps``, ``amsgrad``, ``maximize`` and
  ``decoupled_weight_decay`` equal the recorded values;
* every updated parameter's, gradient's and Adam state tensor's storage is where the graph reads and writes
  (``param.data = ...`` moves it, as does an offloaded state brought back).

A step whose values differ from the recording runs eagerly; the step is recorded again once the values held for
two steps in a row (a constant learning rate, or a scheduler between changes), so a scheduler that changes the
learning rate every step keeps the step eager, at the cached step's speed.

State, all on this object: ``refused`` once :func:`optimizer_refusal` (or the front-end) gave a reason (one
warning; the step is then not this object's).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional

import torch

from ..torch_compat import mark_optimizer_stepped, optimizer_has_step_hooks
from .fused_adam_step import CachedFusedAdamStep, fused_adam_refusal

#: the group values the fused kernels take as arguments (``decoupled_weight_decay``: Adam since torch 2.6)
KERNEL_KEYS = ("lr", "betas", "weight_decay", "eps", "amsgrad", "maximize", "decoupled_weight_decay")

def optimizer_refusal(optimizer: torch.optim.Optimizer, backend_name: str) -> Optional[str]:
    """Why ``optimizer``'s step cannot be replayed from a graph exactly by ``backend_name``, or ``None`` if it can.

    It can for ``torch.optim.Adam`` or ``AdamW`` built with ``fused=True``, not ``differentiable``, without step
    hooks, and (CUDA) every parameter on a CUDA device.
    """
    name = type(optimizer).__name__
    fused = fused_adam_refusal(optimizer)
    if fused is not None:
        return (f"{fused}; only a fused torch.optim.Adam/AdamW step is replayed bit for bit (its kernels read the "
                "step count on the device and the learning rate as the eager step passes it); build it with "
                "fused=True")
    if any(g.get("differentiable", False) for g in optimizer.param_groups):
        return f"{name} was built with differentiable=True"
    if has_step_hooks(optimizer):
        return f"{name} has step pre/post hooks, which a replayed step would skip"
    if backend_name == "cuda":
        off = {str(p.device) for g in optimizer.param_groups for p in g["params"] if p.device.type != "cuda"}
        if off:
            return f"{name} holds parameters on {sorted(off)}; a CUDA graph needs them all on the GPU"
    return None


def has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` has step pre/post hooks (its own or global ones), which a replayed step skips."""
    return optimizer_has_step_hooks(optimizer)


def kernel_values(optimizer: torch.optim.Optimizer) -> Optional[tuple]:
    """Every group's :data:`KERNEL_KEYS` values, or ``None`` if one is a tensor (read on the device: not
    recorded by value)."""
    values = tuple(tuple(g.get(k) for k in KERNEL_KEYS) for g in optimizer.param_groups)
    for group in values:
        for v in group:
            if isinstance(v, torch.Tensor) or (isinstance(v, tuple) and any(isinstance(x, torch.Tensor) for x in v)):
                return None
    return values


class OptimizerStepGraph:
    """Records and replays one fused Adam/AdamW optimizer's step through a graph backend, exactly.

    Args:
        optimizer: a fused ``torch.optim.Adam``/``AdamW`` whose parameters get their gradients in ``param.grad``
            (for the strategy: views of the DDP engine's ``main_grad`` buffer, the same tensors every step).
        backend: a :mod:`cg_lightning.graphs.backends` backend (``cuda``: real capture on its side stream;
            ``eager``: the step runs again at every "replay", for CPU tests of the bookkeeping).
        cached: the optimizer's cached fused step (shared with the strategy's), or ``None``: one of its own.

    Attributes:
        replays: steps replayed from the graph; ``captures``: recordings made (one per stretch of constant values).

    Errors: none raised for a refusal (:meth:`give_up`: one ``UserWarning``); capture errors propagate.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, backend, cached: Optional[CachedFusedAdamStep] = None) -> None:
        self.optimizer = optimizer
        self.backend = backend
        self.cached = cached if cached is not None else CachedFusedAdamStep(optimizer)
        self.refused = False
        self.replays = 0
        self.captures = 0
        self.reason: Optional[str] = None
        self._graph = None
        self._values: Optional[tuple] = None  # the kernel values the graph was recorded with
        self._generation = -1  # the cached lists' generation it was recorded from
        self._tensors: List[torch.Tensor] = []
        self._ptrs: List[int] = []
        self._previous: Optional[tuple] = None  # the kernel values of the previous step

    def give_up(self, reason: str) -> None:
        """Run the step eagerly from now on; warn once with ``reason``."""
        self.reason = reason
        self.refused = True
        self.close()
        warnings.warn(f"cg_lightning: the optimizer step runs eagerly from now on: {reason}.", stacklevel=3)

    def close(self) -> None:
        """Drop the graph (its pool is freed with it)."""
        self._graph, self._values, self._tensors, self._ptrs = None, None, [], []

    def step(self, closure: Optional[Callable[[], Any]]) -> Any:
        """What ``optimizer.step(closure)`` does now: run ``closure`` (forward, backward, clipping), then replay the
        graph, record it, or run the step eagerly (module docstring)."""
        loss = closure() if closure is not None else None
        cached = self.cached
        if not cached.usable():
            cached.own_step()  # the lists are rebuilt after it (a new generation)
            self._previous = None
            return loss
        values = kernel_values(self.optimizer)
        if self._graph is not None and values == self._values and cached.generation == self._generation \
                and list(map(torch.Tensor.data_ptr, self._tensors)) == self._ptrs:
            self._graph.replay()
            self.replays += 1
        elif values is not None and values == self._previous:
            self._capture(values)
        else:
            cached.step_on_lists()
        self._previous = values
        return loss

    def _capture(self, values: tuple) -> None:
        cached = self.cached
        self.close()
        graph = self.backend.capture(_body(cached), self.backend.new_pool())
        self._graph, self._values, self._generation = graph, values, cached.generation
        self._tensors = cached.tensors()
        self._ptrs = list(map(torch.Tensor.data_ptr, self._tensors))
        self.captures += 1
        if self.backend.name == "cuda":
            graph.replay()  # a CUDA capture records the step without running it


def _body(cached: CachedFusedAdamStep) -> Callable[[], list]:
    def body() -> list:
        cached.launch()
        return []

    return body


@contextmanager
def step_replaced(optimizer: torch.optim.Optimizer, step: Optional[Callable[[Optional[Callable[[], Any]]], Any]],
                  updated: Optional[Callable[[], bool]] = None) -> Iterator[None]:
    """Within the block, ``optimizer.step(closure=None, **kwargs)`` calls ``step(closure)`` instead (an instance
    attribute over the class method; whatever instance attribute was there, e.g. an LR scheduler's
    wrapper, is put back afterwards). Marks the step as taken for LR schedulers (``torch_compat.mark_optimizer_stepped``).

    ``updated``: asked after the closure ran (with grad enabled, as torch's steps run it); ``True`` means the
    closure's replayed graph updated the weights already, so ``step`` is skipped. ``step=None``: the optimizer's
    own ``step`` as it was before the block."""
    had = "step" in optimizer.__dict__
    saved = optimizer.__dict__.get("step")
    own = optimizer.step

    def replaced(closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        mark_optimizer_stepped(optimizer)
        if updated is None:
            return step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not updated():
            if step is not None:
                step(None)
            else:
                own(**kwargs)
        return loss

    optimizer.step = replaced
    try:
        yield
    finally:
        if had:
            optimizer.step = saved
        else:
            del optimizer.step
