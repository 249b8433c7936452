"""The optimizer's update as the last part of the whole step's graph: a training iteration replayed as one launch.

Under ``graphs.capture_optimizer`` a fused ``torch.optim.Adam``/``AdamW`` update is replayed bit for bit from a graph
(:mod:`cg_lightning.optim.step_graph`: its kernels take the groups' Python values as arguments). Where the training
step is replayed from a graph of its own (:mod:`.whole_step`) and nothing of Lightning's between the backward and
the update could read or change the gradients or the weights, the same kernels are recorded at the end of the step's
graph: forward, backward, sync and update are one replay; ``optimizer.step()`` only marks the step taken. (The
PyTorch CUDA-graphs notes capture the optimizer with the rest in their whole-network example; Megatron-LM's
full-iteration graphs keep it outside.) :func:`update_refusal` says when not (also for ``LambdaCallback`` hooks and
``ddp.find_unused_parameters``); it is read again whenever the optimizers, the clipping value, the callbacks, hooks
set as attributes or the option change during the fit, and a refusal takes the update out for good.

:meth:`StepUpdate.plan`, before every step: graphs that hold the update replay while the optimizer's groups and
state tensors, their storage and the kernel values are as recorded. The update is recorded when its values held two
steps; while they change every step (warmup, cosine) the step's graph holds none; a one-off change (an epoch
scheduler) runs one step eagerly and records again at the next step whose batch has a graph. A recording is replaced
only after ``patience`` steps, fourfold more after one with the update served fewer. With several processes what a
decision is made from (a digest of the values and the flags) is agreed in one ``MAX`` all-reduce on a gloo group per
step, so every rank replays or captures at the same step; values that differ between ranks take the update out.
"""

from __future__ import annotations

import hashlib
import operator
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import protocol
from ..ddp.peers import peer_errors
from ..lifecycle.preemption import control_group
from ..optim.fused_adam_step import CachedFusedAdamStep
from ..optim.step_graph import kernel_values, optimizer_refusal
from .step_checks import LIGHTNING_BASES, overridden

#: the module's hooks Lightning runs between the backward and the optimizer's update
_BETWEEN_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step")
#: the callbacks' hooks Lightning runs there
_CALLBACK_HOOKS = ("on_after_backward", "on_before_optimizer_step")
#: steps a recording serves before it may be replaced, at first
PATIENCE = 8

#: replay (or capture this batch's graph); drop the graphs and capture; run eagerly; drop the graphs and run eagerly
KEEP, RESET, EAGER, DROP = "keep", "reset", "eager", "drop"


def update_refusal(strategy: Any, backend_name: str) -> Optional[str]:
    """Why the optimizer's update of the fit of ``strategy`` (the Lightning strategy, set up) cannot be part of the
    step's graph, or ``None``."""
    optimizers = strategy.optimizers
    if len(optimizers) != 1:
        return f"the fit has {len(optimizers)} optimizers"
    reason = optimizer_refusal(optimizers[0], backend_name)
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
    if any(protocol.main_grad(p).dtype != p.dtype for p in strategy.engine.params):
        return "ddp.grad_dtype differs from the parameters' dtype (the optimizer reads a cast copy of main_grad)"
    if getattr(strategy.engine, "unused", None) is not None:
        return "ddp.find_unused_parameters: which parameters the optimizer updates is known only after each backward"
    return None


def update_phrase(include: bool, joins: bool, capture_optimizer: bool, refusal: Optional[str]) -> str:
    """What a capture's announcement says of the optimizer step: ``include``: the graph holds the update; ``joins``:
    it may later (recorded once the values held two steps); ``refusal``: why it cannot."""
    if include:
        return "; the update is replayed with it while the optimizer's values hold"
    if joins:
        return "; the optimizer step is beside it for now, and may join it once the optimizer's values hold two steps"
    if capture_optimizer:
        return ("; the optimizer step is replayed from a graph of its own while its values hold"
                + (f" (not part of this graph: {refusal})" if refusal else ""))
    return "; the optimizer step runs eagerly"


def _fingerprint(strategy: Any) -> Tuple[tuple, tuple]:
    """What :func:`update_refusal` reads that a fit can change between steps, cheaply compared: the optimizers and
    callbacks (the objects, compared by identity: an id may be handed out again), the clipping value, the option, and
    the hooks set on the module or a callback as attributes."""
    module = strategy.lightning_module
    trainer = module.trainer
    owners = (module, *trainer.callbacks)
    attributes = tuple(hook in getattr(owner, "__dict__", ()) for owner in owners for hook in _BETWEEN_HOOKS)
    return ((*strategy.optimizers, None, *trainer.callbacks),
            (trainer.gradient_clip_val, strategy.graph_options.capture_optimizer, attributes))


def _same(a: Tuple[tuple, tuple], b: Tuple[tuple, tuple]) -> bool:
    return a[1] == b[1] and len(a[0]) == len(b[0]) and all(map(operator.is_, a[0], b[0]))


def _digest(values: Optional[tuple]) -> int:
    """The kernel values as a 63-bit integer, the same in every process (``hash`` of ``None`` is not)."""
    return int.from_bytes(hashlib.blake2b(repr(values).encode(), digest_size=8).digest(), "little") >> 1


class StepUpdate:
    """The optimizer's update inside the step's graphs of one fit (see the module docstring).

    Args:
        strategy: the Lightning strategy, set up; its one optimizer (a fused ``torch.optim.Adam``/``AdamW`` that
            :func:`update_refusal` refused nothing of) is the one updated.
        expose: points ``param.grad`` at the synced ``main_grad`` (the engine's ``expose_grads``), as the optimizer
            sees it in an eager step.
        backend_name: the step graphs' backend (``"cuda"``: every parameter must be on a GPU).
        timeout_s: ``ddp.timeout_s``, bounding the agreement between processes.
        group: the agreement's gloo group (:meth:`for_fit` makes it), ``None`` with one process.

    Attributes:
        recorded: the kernel values the current graphs update with; ``None`` while they hold no update.
        patience: steps a recording must serve before it is replaced.
        refusal: set once the update left the graphs for good (a later :func:`update_refusal`, or values that
            differ between ranks).

    Errors: :class:`~cg_lightning.ddp.peers.PeerLostError` when another rank does not take part in the agreement
    within ``timeout_s``.
    """

    @classmethod
    def for_fit(cls, strategy: Any, expose: Callable[[], None], backend_name: str,
                timeout_s: float) -> Tuple[Optional["StepUpdate"], Optional[str]]:
        """``(StepUpdate, None)`` for the fit, or ``(None, why not)``; the ranks agree (a refusal on one is one on
        all). Call on every rank at the same point (it makes a gloo group with several processes)."""
        group = control_group(timeout_s)
        reason = update_refusal(strategy, backend_name)
        if group is not None and _agree(group, [int(reason is not None)], timeout_s)[0] and reason is None:
            reason = "another rank refuses it (its optimizer, callbacks or hooks differ)"
        if reason is not None:
            if group is not None:
                dist.destroy_process_group(group)
            return None, reason
        return cls(strategy, expose, backend_name, timeout_s, group), None

    def __init__(self, strategy: Any, expose: Callable[[], None], backend_name: str, timeout_s: float,
                 group: Any = None) -> None:
        self.strategy = strategy
        self.backend_name = backend_name
        self.optimizer = strategy.optimizers[0]
        self.expose = expose
        self.timeout_s = timeout_s
        self.cached = CachedFusedAdamStep(self.optimizer)
        self.recorded: Optional[tuple] = None
        self.patience = PATIENCE
        self.refusal: Optional[str] = None
        self.missing = False  # the latest capture's tail found a parameter without Adam state and recorded nothing
        self._group = group  # the agreement's gloo group; None with one process
        self._fingerprint = _fingerprint(strategy)
        self._served = 0  # steps since the current recording
        self._previous: Optional[tuple] = None  # the kernel values of the previous step
        self._kept: List[torch.Tensor] = []  # the parameters and state tensors the recorded kernels read
        self._ptrs: List[int] = []
        self._eager_last = False

    def observe(self) -> None:
        """A step that runs eagerly before capture: its values are the previous step's for the next :meth:`plan`."""
        self._previous = kernel_values(self.optimizer)

    def plan(self, has_graphs: bool, fits: bool) -> Tuple[str, bool]:
        """Before a step after warmup: ``(action, include)``; ``action`` is :data:`KEEP` (replay the graphs there
        are, or capture this batch's), :data:`RESET` (drop them and capture this step), :data:`EAGER` (run this
        step eagerly) or :data:`DROP` (drop them and run this step eagerly); ``include``: the graph replayed or
        captured now holds the update. ``has_graphs``: step graphs exist; ``fits``: one of them was captured for this
        step's batch (else a reset waits for a batch that has one)."""
        values = kernel_values(self.optimizer)
        stable = values is not None and values == self._previous
        self._previous = values
        holds = self.recorded is not None and values == self.recorded and self._holds()
        recordable = holds or (stable and self._recordable())  # graphs that hold were recorded with the state
        refusal = self._refusal_now()
        self._served += 1  # steps since the recording, the same on every rank
        if self._group is not None:  # every rank decides from the same inputs: the minimum of each flag as -max(-x)
            digest = _digest(values)
            got = _agree(self._group, [digest, -digest, -int(stable), -int(holds), -int(recordable), -int(fits),
                                       int(refusal is not None)], self.timeout_s)
            if got[0] != -got[1]:
                refusal = refusal or "the optimizer's values differ between ranks (a rate changed on some only)"
            stable, holds, recordable, fits = (-flag == 1 for flag in got[2:6])
            refusal = refusal or ("another rank's optimizer or callbacks changed" if got[6] else None)
        recordable = recordable and stable and refusal is None
        eager_last, self._eager_last = self._eager_last, False
        if refusal is not None:  # graphs that hold the update must not replay again
            self.refusal = refusal
            if self.recorded is None or not has_graphs:
                return KEEP, False
            return (RESET, False) if fits else (DROP, False)
        if not has_graphs:
            return KEEP, recordable
        if self.recorded is None:  # graphs without the update
            ready = recordable and self._served >= self.patience
            return self._reset_when_fits(True, fits) if ready else (KEEP, False)
        if holds:
            return KEEP, True
        if recordable and self._served >= self.patience:
            return self._reset_when_fits(True, fits)
        if not stable and not eager_last:  # a change: one eager step for the values to settle
            self._eager_last = True
            return EAGER, False
        if fits and self._served < self.patience:  # the recording with the update served too few steps
            self.patience *= 4
        return self._reset_when_fits(False, fits)

    def captured(self, include: bool, first: bool) -> bool:
        """A graph was captured this step (after :meth:`plan`), with the update if ``include``; ``first``: no step
        graphs were there before it (a new recording). Returns whether this rank's graph holds the update: not where
        its tail found a parameter without Adam state (a first gradient), which then takes the update out on every
        rank (the next step drops the graphs)."""
        done = include and not self.missing
        if first:
            self._served = 0
            self.recorded = kernel_values(self.optimizer) if done else None
            self._kept = self.cached.tensors(grads=False) if done else []
            self._ptrs = list(map(torch.Tensor.data_ptr, self._kept))
        missing = self.missing
        if include and self._group is not None:
            missing = bool(_agree(self._group, [int(missing)], self.timeout_s)[0])
        if missing:
            self.refusal = "a parameter got its first gradient in the captured step (it has no Adam state to record)"
            self.recorded = self.recorded or ()  # every rank drops its graphs at the next step
        return done

    def tail(self) -> Callable[[], None]:
        """The work recorded at the end of one capture (and run at every replay of an eager backend): ``param.grad``
        pointed at ``main_grad`` as for an eager step, the lists rebuilt where the gradients changed, then the step
        counts + 1 and the fused kernels. Where the lists cannot be built (a parameter with a gradient and no Adam
        state yet) it records nothing, for good, and sets :attr:`missing`."""
        on = [True]
        self.missing = False

        def run() -> None:
            if not on[0]:
                return
            self.expose()
            cached = self.cached
            if not cached.usable() and not cached.rebuild():
                on[0], self.missing = False, True
                return
            cached.launch()

        return run

    def close(self) -> None:
        """Destroy the agreement's group, if any."""
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None

    @staticmethod
    def _reset_when_fits(include: bool, fits: bool) -> Tuple[str, bool]:
        """A reset now where the batch has a graph (on every rank); else this step runs eagerly and it waits."""
        return (RESET, include) if fits else (EAGER, False)

    def _refusal_now(self) -> Optional[str]:
        """:func:`update_refusal` again where what it reads changed since the last look, else ``None``."""
        if self.refusal is not None:
            return self.refusal
        now = _fingerprint(self.strategy)
        if _same(now, self._fingerprint):
            return None
        self._fingerprint = now
        reason = update_refusal(self.strategy, self.backend_name)
        if not self.strategy.graph_options.capture_optimizer:
            reason = "graphs.capture_optimizer was turned off"
        elif reason is None and self.strategy.optimizers[0] is not self.optimizer:
            reason = "the optimizer was replaced during the fit"
        return reason and f"{reason} (changed during the fit)"

    def _recordable(self) -> bool:
        """The update can be recorded now: a plain step, every parameter that got a gradient last step with its
        Adam state (known where the cached lists still describe the optimizer)."""
        cached = self.cached
        return cached.plain() and (cached.usable(grads=False) or cached.has_state())

    def _holds(self) -> bool:
        """The optimizer is as the graphs recorded it: the same groups and state tensors (so the kept list is still
        what the kernels read), their storage and the parameters' where it was."""
        return self.cached.usable(grads=False) and list(map(torch.Tensor.data_ptr, self._kept)) == self._ptrs


def _agree(group: Any, values: Sequence[int], timeout_s: float) -> List[int]:
    """The element-wise maximum of ``values`` over the ranks of ``group`` (gloo, on the host)."""
    flags = torch.tensor(list(values), dtype=torch.int64)
    with peer_errors("the agreement on the optimizer's update before a step", timeout_s):
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags.tolist()
