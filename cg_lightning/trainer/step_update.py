"""The optimizer's update as the last part of the whole step's graph: a training iteration replayed as one launch.

Under ``graphs.capture_optimizer`` a fused ``torch.optim.Adam``/``AdamW`` update is replayed from a graph bit for bit
(:mod:`cg_lightning.optim.step_graph`: its kernels take the groups' Python values as arguments and compute the bias
corrections from step counts on the device, as the eager step does). Where the training step is replayed from a
graph of its own (:mod:`.whole_step`) and nothing of Lightning's between the backward and the update could read or
change the gradients or the weights, the same kernels are recorded at the end of the step's graph, after the
gradient sync: forward, backward, sync and update are one replay, and Lightning's ``optimizer.step()`` only marks
the step taken. (The PyTorch CUDA-graphs notes capture the optimizer step with the rest in their whole-network
example; Megatron-LM's full-iteration graphs keep it outside.)

Refused for the fit by :func:`update_refusal` (the update is then a graph of its own, or the cached step): another
number of optimizers than one, an optimizer the step graph refuses, gradient clipping, a ``ddp.grad_dtype`` other
than the parameters', the module's ``on_after_backward``, ``on_before_optimizer_step``, ``configure_gradient_clipping``
or ``optimizer_step``, or a callback's ``on_after_backward`` or ``on_before_optimizer_step``.

Decided before every step by :meth:`StepUpdate.plan`. Graphs that hold the update replay while the optimizer is as
recorded (its param groups and state tensors: ``CachedFusedAdamStep.usable``; its parameters' storage) and every
group's kernel values equal the recorded ones. The update is recorded into the step's graph when its values equal
the previous step's (held two steps: a constant learning rate, a scheduler between changes); while they change every
step (warmup, cosine) the step's graph is recorded without it. A one-off change (an epoch's scheduler step) runs that
step eagerly and records again at the next. A recording is replaced only after its graphs replayed ``patience``
times, which grows fourfold each time a recording with the update served fewer: values that flip back and forth
cost a few captures, not one every other step.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from ..optim.fused_adam_step import CachedFusedAdamStep
from ..optim.step_graph import kernel_values, optimizer_refusal
from .. import protocol
from .step_checks import LIGHTNING_BASES, overridden

#: the module's hooks Lightning runs between the backward and the optimizer's update
_BETWEEN_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step")
#: the callbacks' hooks Lightning runs there
_CALLBACK_HOOKS = ("on_after_backward", "on_before_optimizer_step")
#: replays a recording serves before it may be replaced, at first
PATIENCE = 8

KEEP, RESET, EAGER = "keep", "reset", "eager"


def update_refusal(strategy: Any, backend_name: str) -> Optional[str]:
    """Why the optimizer's update of the fit of ``strategy`` (the Lightning strategy, set up) cannot be part of the
    step's graph, or ``None``."""
    optimizers = strategy.optimizers
    if len(optimizers) != 1:
        return f"the fit has {len(optimizers)} optimizers"
    optimizer = optimizers[0]
    reason = optimizer_refusal(optimizer, backend_name)
    if reason is not None:
        return reason
    trainer = strategy.lightning_module.trainer
    if trainer.gradient_clip_val:
        return (f"gradient clipping (gradient_clip_val={trainer.gradient_clip_val}) runs between the backward and "
                "the update")
    module = strategy.lightning_module
    for hook in _BETWEEN_HOOKS:
        if overridden(module, hook, LIGHTNING_BASES):
            return f"{type(module).__name__}.{hook} is overridden and runs between the backward and the update"
    for callback in trainer.callbacks:
        for hook in _CALLBACK_HOOKS:
            if overridden(callback, hook, LIGHTNING_BASES):
                return f"the callback {type(callback).__name__} implements {hook}, which runs before the update"
    engine = strategy.engine
    if any(protocol.main_grad(p).dtype != p.dtype for p in engine.params):
        return "ddp.grad_dtype differs from the parameters' dtype (the optimizer reads a cast copy of main_grad)"
    return None


def update_phrase(include: bool, joins: bool, capture_optimizer: bool, refusal: Optional[str]) -> str:
    """What a capture's announcement says of the optimizer step: ``include``: the graph holds the update; ``joins``:
    it will once the values hold; ``refusal``: why it cannot."""
    if include:
        return "; the update is replayed with it while the optimizer's values hold"
    if joins:
        return "; the optimizer step is beside it while its values change, and joins it once they hold"
    if capture_optimizer:
        return ("; the optimizer step is replayed from a graph of its own while its values hold"
                + (f" (not part of this graph: {refusal})" if refusal else ""))
    return "; the optimizer step runs eagerly"


class StepUpdate:
    """The optimizer's update inside the step's graphs of one fit (see the module docstring).

    Args:
        optimizer: a fused ``torch.optim.Adam``/``AdamW`` (:func:`update_refusal` found nothing).
        expose: points ``param.grad`` at the synced ``main_grad`` (the engine's ``expose_grads``), as the optimizer
            sees it in an eager step.

    Attributes:
        recorded: the kernel values the current graphs update with; ``None`` while they hold no update.
        patience: replays a recording must serve before it is replaced.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, expose: Callable[[], None]) -> None:
        self.optimizer = optimizer
        self.expose = expose
        self.cached = CachedFusedAdamStep(optimizer)
        self.recorded: Optional[tuple] = None
        self.patience = PATIENCE
        self._served = 0  # replays of the current recording
        self._previous: Optional[tuple] = None  # the kernel values of the previous step
        self._ptrs: List[int] = []
        self._eager_last = False

    def plan(self, has_graphs: bool) -> Tuple[str, bool]:
        """Before a step after warmup: ``(action, include)``; ``action`` is :data:`KEEP` (replay the graphs there
        are, or capture this batch's), :data:`RESET` (drop them and capture this step) or :data:`EAGER` (run this
        step eagerly); ``include``: a graph captured now holds the update. ``has_graphs``: step graphs exist."""
        values = kernel_values(self.optimizer)
        stable = values is not None and values == self._previous
        self._previous = values
        recordable = stable and self._recordable()
        eager_last, self._eager_last = self._eager_last, False
        if not has_graphs:
            return KEEP, recordable
        if self.recorded is None:  # graphs without the update
            return (RESET, True) if recordable and self._served >= self.patience else (KEEP, False)
        if values == self.recorded and self._holds():
            return KEEP, True
        if recordable and self._served >= self.patience:
            return RESET, True
        if not stable and not eager_last:  # a change: one eager step for the values to settle
            self._eager_last = True
            return EAGER, False
        if self._served < self.patience:  # the recording with the update served too few steps
            self.patience *= 4
        return RESET, False

    def observe(self) -> None:
        """A step that runs eagerly before capture: its values are the previous step's for the next :meth:`plan`."""
        self._previous = kernel_values(self.optimizer)

    def captured(self, include: bool, first: bool) -> None:
        """A graph was captured this step (after :meth:`plan`), with the update if ``include``; ``first``: no step
        graphs were there before it (a new recording)."""
        if first:
            self._served = 0
            self.recorded = kernel_values(self.optimizer) if include else None
            self._ptrs = [p.data_ptr() for g in self.optimizer.param_groups for p in g["params"]]

    def replayed(self) -> None:
        self._served += 1

    def tail(self) -> None:
        """The update, recorded at the end of the step's graph (and run at every replay of an eager backend):
        ``param.grad`` pointed at ``main_grad`` as for an eager step, the lists rebuilt for those gradients where
        they changed, then the step counts + 1 and the fused kernels.

        Raises:
            RuntimeError: the optimizer has no state for a parameter with a gradient (checked before capture).
        """
        self.expose()
        cached = self.cached
        if not cached.usable() and not cached.rebuild():
            raise RuntimeError("cg_lightning: the optimizer's update cannot be recorded: it is not plain or a "
                               "parameter with a gradient has no Adam state")
        cached.launch()

    def _recordable(self) -> bool:
        """The update can be recorded now: a plain step, every trainable parameter with its Adam state."""
        cached = self.cached
        if not cached.plain():
            return False
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            keys = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            for p in group["params"]:
                if p.requires_grad and not all(k in state.get(p, ()) for k in keys):
                    return False
        return True

    def _holds(self) -> bool:
        """The optimizer is as the graphs recorded it: the same groups and state tensors, the parameters' storage
        where it was."""
        return self.cached.usable(grads=False) and self._ptrs == [
            p.data_ptr() for g in self.optimizer.param_groups for p in g["params"]]
