"""A fused Adam/AdamW step on tensor lists kept from one step to the next: the same kernels, with the same
arguments, as ``optimizer.step()``, without torch's Python over every parameter.

``torch.optim.Adam(fused=True).step()`` spends most of its host time building lists: ``_init_group`` visits
every parameter (its ``.grad``, its state dict, three appends), then the lists are grouped by device and
dtype, and only then do two calls launch the work (``torch._foreach_add_`` on the step counts and
``torch._fused_adam_``/``torch._fused_adamw_``). Under this project's DDP engine the gradients are views of
``main_grad`` and the optimizer state tensors never move, so those lists are the same every step. This class
builds them once, after one ordinary step, and from then on makes only the two calls per device/dtype group,
reading the learning rate, betas, eps, weight decay, ``amsgrad`` and ``maximize`` from the groups at every
step as ``step()`` does. The result is bit-identical to ``optimizer.step()`` (same kernels, same scalar
arguments, same per-tensor math; grouping does not change any element's arithmetic). A graph records the same calls
(``graphs.capture_optimizer``, :mod:`.step_graph`), not torch's ``capturable`` path, which reads the learning rate
as a float32 tensor.

Before every step it checks, by identity, that nothing it cached changed; if anything did, that step is an
ordinary ``optimizer.step()`` and the lists are rebuilt after it:

* ``optimizer.param_groups``, each group dict, each group's ``params`` list and ``optimizer.state`` are the
  same objects (``add_param_group`` and ``load_state_dict`` replace them), and so are every parameter's state
  dict and the tensors in it (``state.clear()``, ``state[p] = {}`` or a new ``step`` tensor), and each
  group's ``amsgrad``;
* every parameter's ``.grad`` is the tensor seen when the lists were built (or still ``None``);
* the step is plain: no step hooks, no GradScaler attributes (``grad_scale``/``found_inf``), every group
  ``fused`` and not ``differentiable``, ``lr`` and ``betas`` Python numbers.

Only ``torch.optim.Adam`` and ``torch.optim.AdamW`` themselves qualify (a subclass may override ``step``).
Idea: what Apex's and Megatron-LM's fused optimizers do by keeping flat parameter lists across steps; here
the lists feed torch's own fused kernels (``torch._fused_adamw_``, pytorch/pytorch#115970 for the tensor-list
API).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, List, Optional, Tuple

import torch

from ..torch_compat import foreach_add_, fused_adam_kernel, group_tensors_by_device_and_dtype
from ..torch_compat import optimizer_has_step_hooks as has_step_hooks

_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_GRAD = operator.attrgetter("grad")


def fused_adam_refusal(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why ``optimizer``'s step cannot take the cached path at all, or ``None`` if it can (per-step conditions
    are checked by :meth:`CachedFusedAdamStep.step`)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"{type(optimizer).__name__} is not torch.optim.Adam or AdamW"
    if not all(g.get("fused") for g in optimizer.param_groups):
        return "the optimizer was not built with fused=True"
    return None


class _Group:
    """One param group's cached lists, grouped by (device, dtype) as ``torch.optim.adam._fused_adam`` does."""

    __slots__ = ("group", "params", "grads", "buckets", "amsgrad")

    def __init__(self, optimizer: torch.optim.Optimizer, group: dict) -> None:
        self.group = group
        self.amsgrad = group["amsgrad"]  # decides which state tensors the lists hold
        self.params = group["params"]
        self.grads = [p.grad for p in self.params]
        with_grad = [p for p in self.params if p.grad is not None]
        state = optimizer.state
        lists: List[List[torch.Tensor]] = [
            with_grad,
            [p.grad for p in with_grad],
            [state[p]["exp_avg"] for p in with_grad],
            [state[p]["exp_avg_sq"] for p in with_grad],
            [state[p]["max_exp_avg_sq"] for p in with_grad] if group["amsgrad"] else [],
            [state[p]["step"] for p in with_grad],
        ]
        if not with_grad:
            self.buckets: List[Tuple[List[torch.Tensor], ...]] = []
            return
        grouped = group_tensors_by_device_and_dtype(lists)
        self.buckets = [tuple(tensors) for (_, (tensors, _)) in grouped.items()]

    def unchanged(self, grads: bool = True) -> bool:
        params = self.group["params"]
        return params is self.params and len(params) == len(self.grads) and self.group["amsgrad"] == self.amsgrad \
            and (not grads or all(map(operator.is_, map(_GRAD, params), self.grads)))


class CachedFusedAdamStep:
    """``optimizer.step(closure)`` for a fused ``torch.optim.Adam``/``AdamW``, on cached tensor lists.

    Args:
        optimizer: ``torch.optim.Adam`` or ``torch.optim.AdamW`` with ``fused=True`` (CUDA or CPU tensors);
            see :func:`fused_adam_refusal`.

    Attributes:
        cached_steps: steps taken on the cached lists (the others were ordinary ``optimizer.step()`` calls).
        generation: how many times the lists were dropped or rebuilt; what was recorded from one set of lists (a
            captured step) is valid while this number is unchanged.

    Errors: none of its own; a step that does not meet the conditions in the module docstring is an
    ordinary ``optimizer.step()``, which raises what torch raises.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.cached_steps = 0
        self.generation = 0
        self._groups: Optional[List[_Group]] = None
        self._param_groups: Optional[list] = None
        self._state: Any = None
        self._state_dicts: List[dict] = []  # the per-parameter state dicts, in state order
        self._state_items: Tuple[list, list, list] = ([], [], [])  # (dict, key, tensor) of every state entry

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Run ``closure`` (with grad enabled, as ``Adam.step`` does), then the update: on the cached lists
        when they still describe the optimizer, else an ordinary step after which the lists are rebuilt."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.usable():
            self.step_on_lists()
        else:
            self.own_step()
        return loss

    def step_on_lists(self) -> None:
        """The update on the cached lists, counted (the caller checked :meth:`usable`)."""
        self.launch()
        self.cached_steps += 1

    def own_step(self) -> None:
        """The optimizer's own ``step()`` (hooks, lazy state, GradScaler arguments: torch's path), after which the
        lists are rebuilt if the step is plain (a new :attr:`generation`)."""
        opt = self.optimizer
        type(opt).step(opt)
        self.rebuild()

    def rebuild(self) -> bool:
        """Build the lists anew from the optimizer as it is now (a new :attr:`generation`), without a step: whether
        they could be (the step is plain and every parameter with a gradient has its Adam state: one step taken)."""
        opt = self.optimizer
        self._groups = None
        self.generation += 1
        if not self.plain() or not self.has_state():
            return False
        self._groups = [_Group(opt, g) for g in opt.param_groups]
        self._param_groups, self._state = opt.param_groups, opt.state
        self._state_dicts = list(opt.state.values())
        pairs = [(d, k) for d in self._state_dicts for k in _STATE_KEYS if k in d]  # amsgrad: checked per group
        self._state_items = ([d for d, _ in pairs], [k for _, k in pairs], [d.get(k) for d, k in pairs])
        return True

    def has_state(self) -> bool:
        """Every parameter with a gradient has the state an Adam step reads (``step``, ``exp_avg``, ``exp_avg_sq``,
        and ``max_exp_avg_sq`` under ``amsgrad``): the optimizer has stepped since it got it."""
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            keys = _STATE_KEYS if group["amsgrad"] else _STATE_KEYS[:3]
            for p in group["params"]:
                if p.grad is not None and not all(k in state.get(p, ()) for k in keys):
                    return False
        return True

    def launch(self) -> None:
        """The update on the cached lists, without any check (the caller checked :meth:`usable`): per group and
        device/dtype bucket, the step counts + 1, then one fused kernel."""
        opt = self.optimizer
        with torch.no_grad():
            for cached in self._groups:
                _fused_update(opt, cached.group, cached.buckets)

    def tensors(self, grads: bool = True) -> List[torch.Tensor]:
        """Every tensor the cached lists hold: the parameters they update (those that had a gradient when the lists
        were built), their gradients (unless ``grads=False``) and their Adam state (step counts, moments)."""
        return [t for cached in self._groups or () for bucket in cached.buckets
                for i, tensors in enumerate(bucket) if grads or i != 1 for t in tensors]

    def plain(self) -> bool:
        """Conditions on the optimizer as a whole and on each group's settings (cheap: no per-parameter work)."""
        opt = self.optimizer
        if has_step_hooks(opt) or getattr(opt, "grad_scale", None) is not None \
                or getattr(opt, "found_inf", None) is not None:
            return False
        for g in opt.param_groups:
            if not g.get("fused") or g.get("differentiable") or isinstance(g["lr"], torch.Tensor) \
                    or any(isinstance(b, torch.Tensor) for b in g["betas"]):
                return False
        return True

    def usable(self, grads: bool = True) -> bool:
        """Whether the cached lists still describe the optimizer (the conditions of the module docstring);
        ``grads=False`` leaves out the gradients' identity (a graph that writes the gradients it then reads)."""
        opt = self.optimizer
        groups = self._groups
        if groups is None or opt.param_groups is not self._param_groups or opt.state is not self._state:
            return False
        if len(groups) != len(opt.param_groups) or not self.plain() or not self._state_unchanged():
            return False
        return all(c.group is g and c.unchanged(grads) for c, g in zip(groups, opt.param_groups))

    def _state_unchanged(self) -> bool:
        """Every per-parameter state dict, and every tensor in it, is the one the lists hold (a state cleared,
        a parameter's dict replaced or its ``step`` reset to a new tensor makes an ordinary step, which
        initializes or reads the state as torch does). Iterates ``state.values()`` (no tensor hashing), with
        ``map`` rather than a Python loop: about 15 us for 150 parameters on a CPU core where the loop took 60."""
        state = self._state
        if len(state) != len(self._state_dicts) or not all(map(operator.is_, state.values(), self._state_dicts)):
            return False
        dicts, keys, tensors = self._state_items
        return all(map(operator.is_, map(dict.get, dicts, keys), tensors))


def _fused_update(opt: torch.optim.Optimizer, group: dict, buckets) -> None:
    """What ``torch.optim.adam._fused_adam`` does for one group without a GradScaler: per device/dtype
    bucket, step counts + 1, then one fused kernel."""
    beta1, beta2 = group["betas"]
    decoupled = group.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW))
    func = fused_adam_kernel(decoupled)
    for params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps in buckets:
        foreach_add_(steps, 1)
        func(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=group["amsgrad"],
             lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
             maximize=group["maximize"], grad_scale=None, found_inf=None)
