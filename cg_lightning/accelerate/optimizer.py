"""``GradBufferOptimizer``: Accelerate's optimizer wrapper, told about the engines' ``main_grad`` buffers.

With the project's engine the gradients live in ``param.main_grad`` (``param.grad`` only aliases it
between the last backward of a step and ``zero_grad``), so zeroing gradients zeroes that buffer, and a
step whose backward bypassed ``accelerator.backward`` is an error instead of a silent step on unsynced
gradients. Accelerate's ``AcceleratedOptimizer`` already decides *whether* ``step``/``zero_grad`` act
(only when ``gradient_state.sync_gradients``, i.e. on the last micro-batch of an accumulation cycle);
this subclass adds *what else* happens then.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

from accelerate.optimizer import AcceleratedOptimizer
from typing_extensions import override

from ..ddp import progress
from ..ddp.peers import peer_errors
from ..optim.step_graph import step_replaced
from ..lifecycle import GraphedDataParallel

EngineLookup = Callable[["GradBufferOptimizer"], Iterable[GraphedDataParallel]]


class GradBufferOptimizer(AcceleratedOptimizer):
    """``AcceleratedOptimizer`` whose ``step`` and ``zero_grad`` also drive the engines it optimizes.

    Args:
        optimizer: the torch optimizer.
        engines: called with this wrapper, returns the :class:`GraphedDataParallel` engines that own
            some of its parameters (looked up at each call: a model may be prepared after its optimizer).
        device_placement: move the optimizer state to the accelerator's device (as Accelerate does).
        scaler: the ``GradScaler`` for fp16 mixed precision, or ``None``.

    Raises:
        RuntimeError: from ``step``, if a forward's backward did not go through ``accelerator.backward``.
    """

    def __init__(self, optimizer, engines: EngineLookup, device_placement: bool = True, scaler=None) -> None:
        super().__init__(optimizer, device_placement=device_placement, scaler=scaler)
        self._engines = engines

    @override
    def step(self, closure=None):
        if not self.gradient_state.sync_gradients:
            return super().step(closure)  # an accumulation micro-batch: Accelerate skips the step
        engines = list(self._engines(self))
        for engine in engines:
            engine.check_ready_for_step()
        sharded = [engine.driver.shard_optimizer(self.optimizer) for engine in engines if engine.shards is not None]
        bounded = contextlib.nullcontext()
        if engines:  # bounds the all-gather of ddp.distributed_optimizer
            step = max(engines[0].steps - 1, 0)  # the backward that completed this step counted it
            progress.report(step, "optimizer step")
            bounded = peer_errors(f"the optimizer step of step {step}", engines[0].options.timeout_s)
        with bounded, step_replaced(self.optimizer, sharded[0].step) if sharded else contextlib.nullcontext():
            out = super().step(closure)  # ddp.distributed_optimizer: this rank's shard, then the all-gather
        for engine in engines:
            engine.after_optimizer_step()
        return out

    @override
    def zero_grad(self, set_to_none=None) -> None:
        """Accelerate's ``zero_grad``; on a step micro-batch also the ``main_grad`` buffer of every engine whose
        parameters this optimizer all holds. An engine shared with other optimizers keeps their gradients
        (``GraphedDataParallel.covers_all``): ``o1.step(); o1.zero_grad(); o2.step()`` steps ``o2`` on its
        gradients, as with plain PyTorch."""
        super().zero_grad(set_to_none=set_to_none)
        if self.gradient_state.sync_gradients:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            for engine in self._engines(self):
                if engine.covers_all(params):
                    engine.zero_grad_buffer()
