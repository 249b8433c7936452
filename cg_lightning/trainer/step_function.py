"""The function a Lightning training step is captured from: what one run of the step does, run twice at capture.

:class:`LightningStepFunction` is called by :meth:`cg_lightning.graphs.step.whole_step.StepGraphs.capture` with the
static batch: Lightning's own ``training_step`` (the precision plugin's autocast, the engine's forward, the module's
``training_step``, its ``self.log`` calls kept for the replays), then ``main_grad`` zeroed (or left unfilled where
each first gradient share is copied in or adopted), the precision plugin's ``backward`` and the engine's gradient
sync. Each run at capture starts from the same Python state: the submodules' attributes and the step's watched values
are put back before the second run. Used by :mod:`.whole_step`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, List, Optional, Tuple

import torch

from .. import protocol
from ..graphs.step.step_code import StepCodeReport
from ..graphs.step.whole_step import StepGraphStats, StepGuards
from .step_checks import LogRecorder, StepCaptureRefused


class LightningStepFunction:
    """One run of the training step for a capture (see the module docstring).

    Args:
        strategy: the Lightning strategy (its engine, driver, precision plugin, module).
        run_training_step: Lightning's ``DDPStrategy.training_step`` bound to the strategy.
        stats: the whole-step graphs' counters (``fresh_main_grads`` is read and set here).
        code: the training step's code report (its watched values), or ``None``.

    Attributes:
        calls: the ``self.log`` calls of the latest run, as ``(args, kwargs)``.
        kept: the watched values before the first run; ``before``: the submodules' attributes then.

    Raises (from a call): :class:`~.step_checks.StepCaptureRefused` when ``training_step`` returns no loss tensor or
    logs what a replay could not log again; whatever the step raises.
    """

    def __init__(self, strategy: Any, run_training_step: Callable[..., Any], stats: StepGraphStats,
                 code: Optional[StepCodeReport], rest: tuple, kwargs: dict) -> None:
        self.strategy = strategy
        self.run_training_step = run_training_step
        self.stats = stats
        self.code = code
        self.rest, self.kwargs = rest, kwargs
        self.calls: List[Tuple[tuple, dict]] = []
        self.kept = code.values() if code is not None else ()
        self.before = StepGuards(strategy.lightning_module)
        self.runs = 0

    def __call__(self, static_batch: Any) -> Any:
        strategy, module = self.strategy, self.strategy.lightning_module
        if self.runs:  # each run at capture starts from the same Python state
            self.before.restore_attributes()
            if self.code is not None:
                self.code.restore(self.kept)
        self.runs += 1
        engine = strategy.engine
        engine.adoption.step_begins()  # the eager run's gradients freed before the captured forward
        self.calls.clear()
        module.log = LogRecorder(self.calls)
        try:
            out = self.run_training_step(static_batch, *self.rest, **self.kwargs)
        finally:
            del module.log
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise StepCaptureRefused(f"training_step returned {type(out).__name__} without a loss tensor")
        stats = self.stats
        # the first share of each main_grad copied in (the buffer left unfilled), or adopted where transient: where an
        # earlier backward showed that only the hooks write main_grad
        fresh = stats.fresh_main_grads = stats.fresh_main_grads or engine.adoption.proven
        engine.zero_grad_buffer(fill=not fresh)
        strategy.driver.before_backward(loss)
        # a few multi-tensor kernels instead of one a parameter; one process: first shares adopted, not copied
        with engine.grad_adds_batched(fresh, adopt=True) as adds:
            strategy.precision_plugin.backward(loss, module, None)
            if engine.sync_enabled:
                engine.finish_grad_sync()
        if not fresh:  # later runs copy if every main_grad got its gradients through the engine's hooks alone
            stats.fresh_main_grads = all(id(m) in adds.queued for m in map(protocol.main_grad, engine.params))
        return out

    def changed(self) -> Optional[str]:
        """After the capture: what the step's own Python changed that a replay would not change again, or ``None``."""
        changed = self.code.changed(self.kept) if self.code is not None else None
        return f"training_step changes what it reads ({changed})" if changed else self.before.changed_by_step()
