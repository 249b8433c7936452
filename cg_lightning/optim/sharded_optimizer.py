"""The distributed optimizer's step: the user's optimizer applied to this rank's shard only.

Under ``ddp.distributed_optimizer`` (:mod:`cg_lightning.ddp.shards`) a rank holds the averaged gradient of its shard
of every bucket. :class:`ShardedOptimizer` wraps the user's optimizer (which keeps its param groups, the
hyperparameters that schedulers change, and stays empty of state) and steps an *inner* optimizer of the same class
over *runs*: each parameter's part of this rank's shard as one flat tensor (a view into the parameter buffer, or
its fp32 master copy for parameters of lower precision) with the matching view of ``main_grad`` as its gradient (or
an fp32 copy). The optimizer state, so, is that of the shard: 1/N of the
elements. After the inner step, low-precision parameters take their masters' values and every bucket's parameters are
all-gathered (:class:`~cg_lightning.ddp.param_gather.ParamGather`: with ``ddp.overlap_param_gather`` the all-gathers
are left running, to be waited for by the next forward; the next step, the state dicts and clipping wait for all of
them first). Only optimizers whose update is elementwise qualify (a per-tensor norm, as in LAMB, would see pieces,
not parameters). Clipping by norm (:func:`clip_grad_norm_`) combines the ranks' norms of their pieces.

The design follows Megatron-LM's distributed optimizer (``megatron/core/optimizer/distrib_optimizer.py``: shard
ranges over the gradient buffer, fp32 main parameters of the shard, all-gather of the parameters) and torch's
``ZeroRedundancyOptimizer`` (one optimizer of the user's class over the local partition).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..ddp.param_gather import ParamGather
from ..ddp.shards import Piece, ShardLayout
from .fused_adam_step import CachedFusedAdamStep, fused_adam_refusal
from .sharded_state import load_state, shard_state_dict

#: torch optimizers whose update of an element reads only that element's gradient and state
ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad,
               torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta)


def sharded_refusal(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why ``optimizer`` cannot be sharded, or ``None``."""
    if type(optimizer) not in ELEMENTWISE:
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        return (f"{type(optimizer).__name__} is not one of the elementwise torch optimizers the distributed optimizer "
                f"shards ({names})")
    if any(g.get("differentiable") for g in optimizer.param_groups):
        return f"{type(optimizer).__name__} was built with differentiable=True"
    return None


class Run:
    """One tensor of the inner optimizer: one piece, so that a parameter's elements on this rank stay one tensor and a
    kernel that treats a tensor's last elements apart from the rest (the CPU's vectorized loops) computes what it
    computes under ``"ddp"``: one process is bit-exact. (Merging adjacent pieces of a param group would make fewer,
    larger tensors and lose that.)

    Attributes:
        group: index of the param group.
        pieces: the :class:`~cg_lightning.ddp.shards.Piece` s, in buffer order.
        param_view, grad_view: the run's elements of the parameter and gradient buffers (1-D views).
        param: what the inner optimizer updates: ``param_view``, or an fp32 master copy of it.
        grad: ``param.grad``: ``grad_view``, or an fp32 copy refreshed before every step.
    """

    def __init__(self, group: int, pieces: List[Piece], layout: ShardLayout) -> None:
        self.group = group
        self.pieces = pieces
        first, last = pieces[0], pieces[-1]
        span = Piece(first.param, 0, last.offset + last.end - last.start - first.offset, first.buffer, first.offset)
        self.param_view = layout.param_shard(span)
        self.grad_view = layout.grad_shard(span)
        self.master = self.param_view.dtype in (torch.float16, torch.bfloat16)
        self.param = self.param_view.detach().float().clone() if self.master else self.param_view
        self.grad = (self.grad_view if self.grad_view.dtype is self.param.dtype
                     else torch.zeros_like(self.param))
        self.param.grad = self.grad

    @property
    def numel(self) -> int:
        return self.param.numel()


class ShardedOptimizer:
    """``optimizer`` stepped on this rank's shard (see the module docstring).

    Args:
        optimizer: the user's optimizer over (some of) the engine's parameters; one of :data:`ELEMENTWISE`.
        layout: the engine's :class:`~cg_lightning.ddp.shards.ShardLayout`.
        cached_step: step a fused ``Adam``/``AdamW`` on cached tensor lists (:mod:`.fused_adam_step`).
        gather: the engine's :class:`~cg_lightning.ddp.param_gather.ParamGather` (shared by every optimizer of the
            engine); ``None``: a gather of ``layout`` that waits at the step.

    While it lives, ``optimizer.state_dict()`` returns this rank's shard of the state and
    ``optimizer.load_state_dict()`` takes such shards from any world size, or an ordinary full state dict
    (:mod:`.sharded_state`); :meth:`close` gives the optimizer its own methods back.

    Raises:
        ValueError: ``optimizer`` is not elementwise (:func:`sharded_refusal`), or holds parameters that are not the
            engine's trainable ones.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, layout: ShardLayout, cached_step: bool = True,
                 gather: Optional[ParamGather] = None) -> None:
        reason = sharded_refusal(optimizer)
        if reason is not None:
            raise ValueError(f"cg_lightning: ddp.distributed_optimizer cannot shard this optimizer: {reason}.")
        self.optimizer = optimizer
        self.layout = layout
        self.gather = gather if gather is not None else ParamGather(layout, overlap=False)
        group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        owned = {p for b in layout.buffers for p, _ in b.offsets}
        foreign = [p for p in group_of if p not in owned]
        if foreign:
            raise ValueError(
                f"cg_lightning: ddp.distributed_optimizer: the optimizer holds {len(foreign)} parameter(s) that are not "
                "trainable parameters of the model the engine wraps (shape "
                f"{tuple(foreign[0].shape)}); give the optimizer the model's trainable parameters only."
            )
        #: the parameters in the numbering of ``optimizer.state_dict()`` (group by group)
        self.params: List[torch.nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"]]
        self.runs: List[Run] = [Run(group_of[q.param], [q], layout) for q in layout.pieces if q.param in group_of]
        self.inner: Optional[torch.optim.Optimizer] = self._inner() if self.runs else None
        self.cached = (CachedFusedAdamStep(self.inner) if cached_step and self.inner is not None
                       and fused_adam_refusal(self.inner) is None else None)
        self._saved_methods = {k: optimizer.__dict__[k] for k in ("state_dict", "load_state_dict")
                               if k in optimizer.__dict__}
        optimizer.state_dict = self.state_dict
        optimizer.load_state_dict = self.load_state_dict

    def _inner(self) -> torch.optim.Optimizer:
        opt = self.optimizer
        groups = [{**_hyper(g), "params": [r.param for r in self.runs if r.group == i]}
                  for i, g in enumerate(opt.param_groups)]
        accepted = inspect.signature(type(opt).__init__).parameters
        kwargs = {k: v for k, v in opt.defaults.items() if k in accepted and k != "params"}
        return type(opt)(groups, **kwargs)

    @property
    def shard_numel(self) -> int:
        """Elements this rank's optimizer state covers (the sum over runs)."""
        return sum(r.numel for r in self.runs)

    # ------------------------------------------------------------------ step
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Run ``closure`` (grad enabled), then update this rank's shard and start the all-gather of the parameters
        (:meth:`ParamGather.start <cg_lightning.ddp.param_gather.ParamGather.start>`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self.gather.wait_all()  # the last step's all-gathers read the shard this step writes
            for run in self.runs:
                if run.grad is not run.grad_view:
                    run.grad.copy_(run.grad_view)
            if self.inner is not None:
                for mine, theirs in zip(self.inner.param_groups, self.optimizer.param_groups):
                    mine.update(_hyper(theirs))
                if self.cached is not None:
                    self.cached.step()
                else:
                    self.inner.step()
            for run in self.runs:
                if run.master:
                    run.param_view.copy_(run.param)
            self.gather.start()
        return loss

    @property
    def cached_steps(self) -> int:
        return self.cached.cached_steps if self.cached is not None else 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """This rank's shard of the optimizer state (:func:`.sharded_state.shard_state_dict`)."""
        self.gather.wait_all()
        return shard_state_dict(self)

    def load_state_dict(self, state: Any) -> None:
        """Load shards (one dict, or a list from any world size) or an ordinary full state dict
        (:func:`.sharded_state.load_state`)."""
        self.gather.wait_all()
        load_state(self, state)

    def close(self) -> None:
        """Give the optimizer its own ``state_dict``/``load_state_dict`` back."""
        for key in ("state_dict", "load_state_dict"):
            self.optimizer.__dict__.pop(key, None)
        self.optimizer.__dict__.update(self._saved_methods)


def _hyper(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def clip_grad_norm_(optimizers: Sequence[ShardedOptimizer], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of ``optimizers`` (one engine's) by their total norm over every rank's shard, as
    ``torch.nn.utils.clip_grad_norm_`` over all their parameters would: scale by ``max_norm / (norm + 1e-6)`` when
    that is below 1. Each rank takes the norm of its pieces' gradients (``torch.nn.utils.get_total_norm``, in the
    optimizer's parameter order: in one process that is torch's own computation, bit for bit); the ranks' norms are
    combined by one all-reduce. A collective: every rank of the engine's group calls it. Returns the total norm
    (0-dim tensor on the buffers' device).

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the total norm is ``nan`` or ``inf`` (the gradients are left as they
            were, as torch's own function does).
    """
    layout = optimizers[0].layout
    for o in optimizers:
        o.gather.wait_all()
    pieces = []
    for k, o in enumerate(optimizers):
        number = {p: i for i, p in enumerate(o.params)}
        pieces += [(k, number[piece.param], piece.start, layout.grad_shard(piece)) for r in o.runs for piece in r.pieces]
    grads = [g for *_, g in sorted(pieces, key=lambda t: t[:3])]
    norm_type = float(norm_type)
    device = layout.buffers[0].data.device
    local = (torch.nn.utils.get_total_norm(grads, norm_type) if grads
             else torch.zeros((), dtype=torch.float32, device=device))
    total = local
    if layout.world_size > 1:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=layout.group)
        else:
            total = local.float() ** norm_type
            dist.all_reduce(total, group=layout.group)
            total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"cg_lightning: the total norm of order {norm_type} of the gradients is non-finite "
                           f"({total.item()}), so it cannot be clipped; pass error_if_nonfinite=False to clip anyway.")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total
