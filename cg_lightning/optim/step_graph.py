"""The optimizer step as one graph: ``optimizer.step()`` captured once and replayed every step after.

A fused or ``foreach`` AdamW over ~150 tensors costs the host about a millisecond per step in Python and
launches (``_init_group``, grouping tensors by device and dtype, the kernel launches); on a launch-bound model
that is a large share of the step. ``torch.optim`` supports capture for optimizers that take
``capturable=True``: the step count lives on the device, so one captured step is right for every later step
(the PyTorch CUDA-graphs notes, "whole-network capture").

The learning rate: the captured step reads it from a 0-dim float32 device tensor per param group, which this
class owns. ``group["lr"]`` stays the Python float that schedulers, callbacks (``LearningRateMonitor``) and
checkpoints see; before every replay its current value is written into the tensor (``fill_``: one small
kernel per group, no host sync). The tensor is in the group only while the step is being captured.

What stays exact, and what is checked before every replay (the step runs eagerly again, with one warning
that names the cause, as soon as one check fails):

* every parameter's ``.grad`` is the tensor the graph read at capture, or ``None`` where it was ``None``
  (gradients replaced, a skipped backward, a new parameter with a gradient);
* the param groups are those captured, and every hyperparameter other than ``lr`` has its captured value (a
  ``betas`` cycled by OneCycleLR, or a changed ``weight_decay``, would be ignored by the graph);
* no step pre- or post-hooks are registered (the graph would skip them).

State, all on this object: ``phase`` goes ``"off" -> "prepared" -> "warm" -> "captured"`` (or ``"eager"``
once refused or given up). ``prepared``: ``capturable=True`` was set on every group (CUDA); the next step runs
eagerly in that form (``warm``: lazy state and the capturable code path ran once outside capture); the step
after it is captured and then replayed, and every later step replays. A step without any gradient is not
captured (the next one is).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from ..torch_compat import mark_optimizer_stepped, optimizer_has_step_hooks

_STEP_KEYS_IGNORED = ("params", "lr")

ACTIVE = ("prepared", "warm", "captured")


def optimizer_refusal(optimizer: torch.optim.Optimizer, backend_name: str) -> Optional[str]:
    """Why ``optimizer``'s step cannot be captured by ``backend_name``, or ``None`` if it can.

    Capturing needs an optimizer with a ``capturable`` option (in torch 2.11-2.13: Adam, AdamW, NAdam, RAdam,
    Adamax, RMSprop, ASGD, Adadelta; not SGD or Adagrad), no ``differentiable`` step, no step hooks, and
    (CUDA) every parameter on a CUDA device.
    """
    name = type(optimizer).__name__
    if "capturable" not in optimizer.defaults:
        return f"{name} has no 'capturable' option, so its step cannot be replayed from a graph"
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
        self._capturable: List[Any] = []  # per group: the user's "capturable" value
        self._lr: List[torch.Tensor] = []  # per group: the device tensor the captured step reads
        self._lr_values: List[Any] = []  # per group: the value last written into it
        self._hyper: List[Dict[str, Any]] = []
        self._grads: List[tuple] = []  # (param, .grad at capture or None), every parameter of every group

    # ------------------------------------------------------------------ life cycle
    def prepare(self) -> None:
        """On CUDA: ``capturable=True`` on every group, each parameter's ``step`` moved to the device."""
        self._capturable = [g.get("capturable", False) for g in self.optimizer.param_groups]
        if self.backend.name == "cuda":
            for group in self.optimizer.param_groups:
                group["capturable"] = True
                for p in group["params"]:
                    state = self.optimizer.state.get(p)
                    step = state.get("step") if state else None
                    if isinstance(step, torch.Tensor) and step.device != p.device:
                        state["step"] = step.to(device=p.device, dtype=torch.float32)
        self.phase = "prepared"

    def restore(self) -> None:
        """Undo :meth:`prepare`: ``capturable`` back to the user's setting (``step`` tensors stay where they are;
        every optimizer accepts them) and drop the graph."""
        for group, flag in zip(self.optimizer.param_groups, self._capturable):
            group["capturable"] = flag
        self._capturable, self._lr = [], []
        self._graph = None

    def give_up(self, reason: str) -> None:
        """Run the step eagerly from now on; warn once with ``reason``."""
        self.reason = reason
        if self.phase in ACTIVE:
            self.restore()
        self.phase = "eager"
        warnings.warn(f"cg_lightning: the optimizer step runs eagerly from now on: {reason}.", stacklevel=3)

    def state_dict_view(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """``optimizer.state_dict()`` output with each group's ``capturable`` as the user set it (groups added
        after :meth:`prepare` are left as they are)."""
        if not self._capturable:
            return state
        groups = [dict(g) for g in state["param_groups"]]
        for g, flag in zip(groups, self._capturable):
            g["capturable"] = flag
        return {**state, "param_groups": groups}

    # ------------------------------------------------------------------ per step
    def step(self, closure: Optional[Callable[[], Any]]) -> Any:
        """What ``optimizer.step(closure)`` does in this phase: run ``closure`` (forward, backward, clipping),
        then run the step eagerly, capture it, or replay it."""
        loss = closure() if closure is not None else None
        if self.phase == "prepared" or (self.phase == "warm" and self._groups_changed()):
            if self._groups_changed():  # a group added since prepare: prepare it too
                self.restore()
                self.prepare()
            with warnings.catch_warnings():
                # torch warns once that a capturable optimizer stepping outside capture is slower: this is
                # the one deliberate eager step before capture
                warnings.filterwarnings("ignore", message=".*capturable=True.*")
                type(self.optimizer).step(self.optimizer)
            self.phase = "warm"
            return loss
        if self.phase == "warm":
            if any(p.grad is not None for g in self.optimizer.param_groups for p in g["params"]):
                self._capture()
            else:  # nothing to update (a skipped backward): capturing now would record an empty step
                type(self.optimizer).step(self.optimizer)
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

    def _groups_changed(self) -> bool:
        return len(self.optimizer.param_groups) != len(self._capturable)

    def _capture(self) -> None:
        opt = self.optimizer
        groups = opt.param_groups
        cuda = self.backend.name == "cuda"
        self._grads = [(p, p.grad) for g in groups for p in g["params"]]
        self._hyper = [_hyper(g) for g in groups]
        if cuda:
            self._lr = [torch.tensor(float(g["lr"]), dtype=torch.float32, device=g["params"][0].device)
                        if g["params"] else torch.tensor(float(g["lr"])) for g in groups]
            self._lr_values = [g["lr"] for g in groups]
        self._pool = self.backend.new_pool()

        def body():
            if not cuda:  # the eager backend re-runs this at every replay: the plain step, float lr
                type(opt).step(opt)
                return []
            floats = [g["lr"] for g in groups]
            for g, t in zip(groups, self._lr):
                g["lr"] = t  # read by the captured kernels from the device
            try:
                type(opt).step(opt)
            finally:
                for g, lr in zip(groups, floats):
                    g["lr"] = lr
            return []

        try:
            self._graph = self.backend.capture(body, self._pool)
        except BaseException:  # the backend ended the capture; this object holds nothing of it
            self._graph, self._pool, self._lr, self._lr_values = None, None, [], []
            raise
        self.phase = "captured"
        if cuda:
            self._graph.replay()  # a CUDA capture records the step without running it

    def _sync_lr(self) -> None:
        """Write each group's learning rate into its device tensor, only when it changed (one small kernel)."""
        for i, (group, t) in enumerate(zip(self.optimizer.param_groups, self._lr)):
            lr = group["lr"]
            if lr != self._lr_values[i]:
                t.fill_(lr)
                self._lr_values[i] = lr

    def _stale(self) -> Optional[str]:
        opt = self.optimizer
        if len(opt.param_groups) != len(self._hyper):
            return "param groups were added after the step was captured"
        for p, g in self._grads:
            if p.grad is not g:
                return ("a parameter's .grad is not the tensor captured with the step (gradients replaced, set "
                        "to None by a skipped backward, or a parameter that had none now has one); keep .grad "
                        "in place or set graphs.capture_optimizer=false")
        for i, (group, hyper) in enumerate(zip(opt.param_groups, self._hyper)):
            keys = _changed_keys(group, hyper)
            if keys:
                return (f"hyperparameter(s) {keys} of param group {i} changed after the step was captured (only 'lr' "
                        "may change; a scheduler that also cycles momentum needs graphs.capture_optimizer=false)")
        if has_step_hooks(opt):
            return "optimizer step hooks were registered after the step was captured"
        return None


def _hyper(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: _Same(v) for k, v in group.items() if k not in _STEP_KEYS_IGNORED}


def _changed_keys(group: Dict[str, Any], hyper: Dict[str, Any]) -> List[str]:
    """Hyperparameters of ``group`` that differ from the captured ``hyper`` (added, removed or changed)."""
    changed = [k for k, v in hyper.items() if k not in group or not v == group[k]]
    if len(group) - sum(k in group for k in _STEP_KEYS_IGNORED) != len(hyper):
        changed += [k for k in group if k not in hyper and k not in _STEP_KEYS_IGNORED]
    return sorted(changed)


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


@contextmanager
def step_replaced(optimizer: torch.optim.Optimizer, step: Callable[[Optional[Callable[[], Any]]], Any]) -> Iterator[None]:
    """Within the block, ``optimizer.step(closure=None, **kwargs)`` calls ``step(closure)`` instead (an instance
    attribute over the class method; whatever instance attribute was there, e.g. an LR scheduler's
    wrapper, is put back afterwards). Marks the step as taken for LR schedulers (``torch_compat.mark_optimizer_stepped``)."""
    had = "step" in optimizer.__dict__
    saved = optimizer.__dict__.get("step")

    def replaced(closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        mark_optimizer_stepped(optimizer)
        return step(closure)

    optimizer.step = replaced
    try:
        yield
    finally:
        if had:
            optimizer.step = saved
        else:
            del optimizer.step
