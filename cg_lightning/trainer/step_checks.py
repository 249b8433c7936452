"""What keeps a Lightning training step from being replayed from one graph, found before and during its capture.

:func:`static_refusal` reads the fit's set-up (manual optimization, a GradScaler, the distributed optimizer,
hooks of the user's that would run only at capture or after the replayed backward, gradients that outlive
``zero_grad``); :class:`LogRecorder` stands in for ``self.log`` while the step
is captured and refuses values a replay could not log again; :func:`raised_at` names the user's line of a capture
that failed; :func:`step_output` is what a replayed step returns to Lightning. Used by
:mod:`cg_lightning.trainer.whole_step`.
"""

from __future__ import annotations

import copy
import os
import traceback
from collections.abc import Mapping
from typing import Any, List, Optional, Tuple

import torch

from .. import torch_compat

_USER_HOOKS = ("backward", "optimizer_zero_grad", "on_before_zero_grad")  # would run at capture only
#: hooks Lightning runs between the forward and the backward (they may set gradients the backward adds onto)
_BEFORE_BACKWARD_HOOKS = ("on_before_zero_grad", "on_before_backward")
#: packages whose properties and methods, read through ``self`` in a training step, reflect the loop's state
FRAMEWORK = ("lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics")


class StepCaptureRefused(RuntimeError):
    """The training step cannot be replayed from one graph; the message says why."""


def overridden(obj: Any, name: str, base_names: Tuple[str, ...]) -> bool:
    """``obj`` holds ``name`` as an attribute of its own (``LambdaCallback(on_after_backward=f)``, a method assigned
    to a module), or its class defines it below every class named in ``base_names`` (Lightning's own)."""
    if name in getattr(obj, "__dict__", {}):
        return True
    for klass in type(obj).__mro__:
        if name in klass.__dict__:
            return klass.__name__ not in base_names
    return False


def raised_at(exc: BaseException) -> Optional[str]:
    """The innermost frame of ``exc``'s traceback outside torch and this package: the code that made the call that
    failed (``file:line in function: source``), or ``None``."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # cg_lightning/
    skip = (os.path.dirname(torch.__file__), package)
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if not os.path.abspath(frame.filename).startswith(skip):
            found = frame
    if found is None:
        return None
    return f"{found.filename}:{found.lineno} in {found.name}: {(found.line or '').strip()}"


class LogRecorder:
    """Stands in for ``LightningModule.log`` while the step function runs: keeps each call for later."""

    def __init__(self, calls: List[Tuple[tuple, dict]]) -> None:
        self.calls = calls

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, bool) or isinstance(value, (int, float)):
            raise StepCaptureRefused(
                f"training_step logs {name!r} as a Python number ({value!r}), which a replayed step would log "
                "unchanged every step; log a tensor, or log the number from on_train_batch_end")
        if not isinstance(value, torch.Tensor):
            raise StepCaptureRefused(
                f"training_step logs {name!r} as a {type(value).__name__} (a torchmetrics Metric updates state the "
                "graph would keep writing after the metric is reset); log a tensor, or update the metric in "
                "on_train_batch_end")
        self.calls.append(((name, value.detach()) + args, kwargs))


#: Lightning's classes that define the hooks: a hook defined below them is the user's
LIGHTNING_BASES = ("LightningModule", "HooksMixin", "ModelHooks", "DataHooks", "CheckpointHooks", "Callback")


def static_refusal(strategy: Any) -> Optional[str]:
    """Why the fit of ``strategy`` (the Lightning strategy, set up) cannot replay its training step from one graph,
    or ``None``."""
    module = strategy.lightning_module
    if not module.automatic_optimization:
        return "manual optimization: training_step calls the optimizers itself"
    if getattr(strategy.precision_plugin, "scaler", None) is not None:
        return "the GradScaler of 16-mixed checks the gradients for inf/NaN on the host every step"
    if getattr(strategy.engine, "shards", None) is not None:
        return "ddp.distributed_optimizer is not supported with a graph of the whole step yet"
    for name in _USER_HOOKS:
        if overridden(module, name, LIGHTNING_BASES):
            return f"{type(module).__name__}.{name} is overridden and would run only when the step is captured"
    for hook in _BEFORE_BACKWARD_HOOKS:
        for owner in (module, *module.trainer.callbacks):
            if overridden(owner, hook, LIGHTNING_BASES):
                what = (f"{type(module).__name__}.{hook} is overridden" if owner is module
                        else f"the callback {type(owner).__name__} implements {hook}")
                return f"{what}, which would run after the replayed backward instead of before it"
    return _gradient_carried_over(strategy)


def _gradient_carried_over(strategy: Any) -> Optional[str]:
    """Why a gradient may outlive Lightning's ``zero_grad`` (a replayed step starts every gradient from zero), or
    ``None``: a trainable parameter in no optimizer (Lightning zeroes only the optimizers' parameters, so its
    gradient accumulates over steps), or an optimizer whose ``zero_grad`` is its own (it may keep gradients, or zero
    them in place after the replayed backward wrote them)."""
    in_optimizer = {id(p) for optimizer in strategy.optimizers for group in optimizer.param_groups
                    for p in group["params"]}
    module = strategy.lightning_module
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in in_optimizer:
            return (f"the parameter {name!r} requires grad but is in no optimizer: Lightning's zero_grad leaves its "
                    "gradient to accumulate over steps, which a replayed step (every gradient from zero) would not do")
    for optimizer in strategy.optimizers:
        if "zero_grad" in vars(optimizer) or type(optimizer).zero_grad is not torch.optim.Optimizer.zero_grad:
            return (f"{type(optimizer).__name__}.zero_grad is not torch.optim.Optimizer's: a replayed step assumes "
                    "that zero_grad sets every gradient to None")
    return None


def step_output(graph) -> Any:
    """A replayed step's output (a :class:`~cg_lightning.graphs.step.whole_step.StepGraph`'s): every tensor other than
    the loss (also in nested lists and dicts) is copied, since the next replay overwrites them and a callback may keep
    a step's outputs (Lightning copies the loss itself)."""
    out = graph.output()
    if isinstance(out, Mapping):
        out = copy.copy(out)
        for key in out:
            if key != "loss":
                out[key] = torch_compat.tree_map(_copied, out[key])
    return out


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
