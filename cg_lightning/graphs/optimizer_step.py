"""The optimizer step as one graph: ``optimizer.step()`` captured once and replayed every step after.

A fused or ``foreach`` AdamW over ~150 tensors costs the host about a millisecond per step in Python and
launches (``_init_group``, grouping tensors by device and dtype, the kernel launches); on a launch-bound model
that is a large share of the step. ``torch.optim`` supports capture for optimizers that take
``capturable=True``: the step count and the learning rate live on the device, so one captured step is right
for every later step (the PyTorch CUDA-graphs notes, "whole-network capture"; the learning rate as a tensor so
that schedulers still work: ``torch.optim.lr_scheduler`` writes into a tensor ``lr`` with ``fill_``).

What stays exact, and what this class checks before every replay (the step runs eagerly again, with one
warning that names the cause, as soon as one of them fails):

* the gradients are the tensors the graph read at capture (``param.grad is`` the captured tensor, for every
  parameter that had one);
* every hyperparameter except ``lr`` still has its captured value (a ``betas`` or ``weight_decay`` that
  changes would be ignored by the graph); ``lr`` itself may change: a float assigned to ``group["lr"]`` is
  copied into the captured device tensor;
* no step pre- or post-hooks are registered (the graph would skip them).

State, all on this object (nothing is stored on the optimizer besides the two group keys it must change):
``phase`` goes ``"off" -> "prepared" -> "warm" -> "captured"`` (or ``"eager"`` once refused or given up).
``prepared``: the groups were converted (``lr`` tensors, ``capturable=True`` on CUDA); the next step runs
eagerly in that form (``warm``: lazy state and the converted code path ran once outside capture); the step
after it is captured and then replayed, and every later step replays.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

_STEP_KEYS_IGNORED = ("params", "lr")


def optimizer_refusal(optimizer: torch.optim.Optimizer, backend_name: str) -> Optional[str]:
    """Why ``optimizer``'s step cannot be captured by ``backend_name``, or ``None`` if it can.

    Capturing needs an optimizer that takes ``capturable`` (Adam, AdamW, SGD with momentum in recent torch,
    ...), no ``differentiable`` step, no step hooks, and (CUDA) every parameter on a CUDA device.
    """
    name = type(optimizer).__name__
    if "capturable" not in optimizer.defaults:
        return f"{name} has no 'capturable' option, so its step cannot be replayed from a graph"
    if any(g.get("differentiable", False) for g in optimizer.param_groups):
        return f"{name} was built with differentiable=True"
    if _has_step_hooks(optimizer):
        return f"{name} has step pre/post hooks, which a replayed step would skip"
    if backend_name == "cuda":
        off = {str(p.device) for g in optimizer.param_groups for p in g["params"] if p.device.type != "cuda"}
        if off:
            return f"{name} holds parameters on {sorted(off)}; a CUDA graph needs them all on the GPU"
    return None


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    from torch.optim import optimizer as optim_mod

    return bool(
        getattr(optimizer, "_optimizer_step_pre_hooks", None)
        or getattr(optimizer, "_optimizer_step_post_hooks", None)
        or getattr(optim_mod, "_global_optimizer_pre_hooks", None)
        or getattr(optim_mod, "_global_optimizer_post_hooks", None)
    )


class OptimizerStepGraph:
    """Captures and replays one optimizer's ``step()`` through a graph backend.

    Args:
        optimizer: a ``torch.optim.Optimizer`` whose parameters get their gradients in ``param.grad``
            (for the strategy: views of the DDP engine's ``main_grad`` buffer, the same tensors every step).
        backend: a :mod:`cg_lightning.graphs.backends` backend (``cuda``: real capture on its side stream;
            ``eager``: the step runs again at every "replay", for CPU tests of the bookkeeping).

    Errors: none raised for a failed check; the step then runs eagerly (``phase == "eager"``) and one
    ``UserWarning`` says why. Capture errors (an optimizer doing host work inside ``step``) propagate.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, backend) -> None:
        self.optimizer = optimizer
        self.backend = backend
        self.phase = "off"
        self.replays = 0
        self.reason: Optional[str] = None
        self._graph = None
        self._pool = None
        self._lr: List[torch.Tensor] = []
        self._saved: List[Dict[str, Any]] = []  # per group: the original "lr" and "capturable" values
        self._hyper: List[Dict[str, Any]] = []
        self._grads: List[tuple] = []  # (param, grad tensor) read by the graph

    # ------------------------------------------------------------------ life cycle
    def prepare(self) -> None:
        """Convert the groups for capture: ``lr`` to 0-dim float32 tensors on the parameters' device and, on
        CUDA, ``capturable=True`` with each parameter's ``step`` moved to the device."""
        cuda = self.backend.name == "cuda"
        for group in self.optimizer.param_groups:
            device = group["params"][0].device if group["params"] else torch.device("cpu")
            self._saved.append({"lr": group["lr"], "capturable": group.get("capturable", False)})
            lr = group["lr"]
            t = lr if isinstance(lr, torch.Tensor) else torch.tensor(float(lr), dtype=torch.float32, device=device)
            group["lr"] = t
            self._lr.append(t)
            if cuda:
                group["capturable"] = True
                for p in group["params"]:
                    state = self.optimizer.state.get(p)
                    step = state.get("step") if state else None
                    if isinstance(step, torch.Tensor) and step.device != p.device:
                        state["step"] = step.to(device=p.device, dtype=torch.float32)
        self.phase = "prepared"

    def restore(self) -> None:
        """Undo :meth:`prepare`: ``lr`` back to a Python float (its current value) and ``capturable`` back
        to the user's setting. ``step`` tensors stay where they are (every optimizer accepts them)."""
        for group, saved, t in zip(self.optimizer.param_groups, self._saved, self._lr):
            lr = group["lr"]
            group["lr"] = float(lr) if isinstance(lr, torch.Tensor) and not isinstance(saved["lr"], torch.Tensor) else lr
            group["capturable"] = saved["capturable"]
        self._saved, self._lr = [], []
        self._graph = None

    def give_up(self, reason: str) -> None:
        """Run the step eagerly from now on; warn once with ``reason``."""
        self.reason = reason
        if self.phase in ("prepared", "warm", "captured"):
            self.restore()
        self.phase = "eager"
        warnings.warn(f"cg_lightning: the optimizer step runs eagerly from now on: {reason}.", stacklevel=3)

    def state_dict_view(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """``optimizer.state_dict()`` output with each group's ``lr`` and ``capturable`` as the user gave them
        (a float, the original flag), so a checkpoint loads into an optimizer that is not captured."""
        if not self._saved:
            return state
        groups = []
        for g, saved in zip(state["param_groups"], self._saved):
            g = dict(g)
            if isinstance(g.get("lr"), torch.Tensor) and not isinstance(saved["lr"], torch.Tensor):
                g["lr"] = float(g["lr"])
            g["capturable"] = saved["capturable"]
            groups.append(g)
        return {**state, "param_groups": groups}

    # ------------------------------------------------------------------ per step
    def step(self, closure: Optional[Callable[[], Any]]) -> Any:
        """What ``optimizer.step(closure)`` does in this phase: run ``closure`` (forward, backward, clipping),
        then capture and/or replay the step, or run it eagerly."""
        loss = closure() if closure is not None else None
        if self.phase == "prepared":
            type(self.optimizer).step(self.optimizer)
            self.phase = "warm"
            return loss
        if self.phase == "warm":
            self._capture()
            return loss
        if self.phase == "captured":
            reason = self._stale()
            if reason is None:
                self._sync_lr()
                self._graph.replay()
                self.replays += 1
                return loss
            self.give_up(reason)
        type(self.optimizer).step(self.optimizer)
        return loss

    def _capture(self) -> None:
        opt = self.optimizer
        self._sync_lr()
        self._grads = [(p, p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None]
        self._hyper = [_hyper(g) for g in opt.param_groups]
        self._pool = self.backend.new_pool()

        def body():
            type(opt).step(opt)
            return []

        self._graph = self.backend.capture(body, self._pool)
        if self.backend.name == "cuda":
            self._graph.replay()  # a CUDA capture records the step without running it
        self.phase = "captured"

    def _sync_lr(self) -> None:
        for group, t in zip(self.optimizer.param_groups, self._lr):
            lr = group["lr"]
            if lr is not t:  # a float (or another tensor) assigned by user code or an old-style scheduler
                t.fill_(float(lr))
                group["lr"] = t

    def _stale(self) -> Optional[str]:
        opt = self.optimizer
        for p, g in self._grads:
            if p.grad is not g:
                return ("a parameter's .grad is no longer the tensor captured with the step (gradients replaced "
                        "or set to None between steps); keep .grad in place or set graphs.capture_optimizer=false")
        for i, (group, hyper) in enumerate(zip(opt.param_groups, self._hyper)):
            now = _hyper(group)
            if now != hyper:
                keys = sorted(k for k in set(now) | set(hyper) if now.get(k) != hyper.get(k))
                return (f"hyperparameter(s) {keys} of param group {i} changed after the step was captured (only 'lr' "
                        "may change; a scheduler that also cycles momentum needs graphs.capture_optimizer=false)")
        if len(opt.param_groups) != len(self._hyper):
            return "param groups were added after the step was captured"
        if _has_step_hooks(opt):
            return "optimizer step hooks were registered after the step was captured"
        return None


def _hyper(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: _Same(v) for k, v in group.items() if k not in _STEP_KEYS_IGNORED}


class _Same:
    """A hyperparameter value compared by identity when it is a tensor (a graph reads tensors in place) and
    by ``==`` otherwise."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        a, b = self.value, other.value if isinstance(other, _Same) else other
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return a is b
        return a == b

    def __repr__(self) -> str:
        return repr(self.value)


ACTIVE = ("prepared", "warm", "captured")


@contextmanager
def step_replaced(optimizer: torch.optim.Optimizer, step: Callable[[Optional[Callable[[], Any]]], Any]) -> Iterator[None]:
    """Within the block, ``optimizer.step(closure=None, **kwargs)`` calls ``step(closure)`` instead (an instance
    attribute over the class method; whatever instance attribute was there, e.g. an LR scheduler's
    wrapper, is put back afterwards). Marks the step as taken for LR schedulers (``_opt_called``)."""
    had = "step" in optimizer.__dict__
    saved = optimizer.__dict__.get("step")

    def replaced(closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # what torch's LR-scheduler wrapper of step() records
        return step(closure)

    optimizer.step = replaced
    try:
        yield
    finally:
        if had:
            optimizer.step = saved
        else:
            del optimizer.step
