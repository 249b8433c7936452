"""The strategy's backward and optimizer-step hooks: the driver's events around Lightning's own.

Part of the strategy body (:class:`~.strategy.CUDAGraphDDPMixin` derives from :class:`StepHooksMixin`, ahead of the
faults and distributed-optimizer mixins, so their bounds and glue run inside these hooks):

* ``block_backward_sync``: the driver's ``no_sync`` (gradient accumulation).
* ``backward``: the driver's ``before_backward`` and ``after_backward`` around the precision plugin's ``backward``
  (autograd), between Lightning's ``on_before_backward`` and ``on_after_backward``; a step replayed from the
  whole-step graph runs the hooks around no autograd.
* ``optimizer_step``: Lightning's step inside the driver's ``stepping`` (the captured or cached optimizer step,
  where it applies), then ``after_optimizer_step``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Generator, Iterator, Optional

import torch
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from ..lifecycle import TrainingDriver


class StepHooksMixin:
    """The hooks above. Expects the strategy's ``driver``, ``whole_step``, ``precision_plugin``,
    ``lightning_module`` and ``_lightning_ns``."""

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator:
        if self.driver is not None:
            with self.driver.no_sync():
                yield None
        else:
            yield None

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any):
        """Lightning's backward, with the driver's events around the precision plugin's ``backward`` (autograd):
        ``before_backward`` after ``on_before_backward``, which sees (and may change) the sum so far in
        ``param.grad`` as under ``"ddp"``; ``after_backward`` (the all-reduce, ``param.grad`` pointing at
        ``main_grad``) before ``on_after_backward``, where torch DDP has its all-reduce done."""
        if self.driver is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        if self.whole_step is not None and self.whole_step.take_backward():
            return self._backward_replayed(closure_loss)
        with self._driver_around_autograd(self.driver) as ran:
            closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        if not ran:
            raise RuntimeError(
                "cg_lightning: Lightning's Strategy.backward did not call precision_plugin.backward, where "
                "CUDAGraphDDPStrategy finishes the gradient sync; this Lightning version is not supported."
            )
        return closure_loss

    def _backward_replayed(self, closure_loss: torch.Tensor) -> torch.Tensor:
        """Lightning's backward for a step whose graph ran it already: its hooks around no autograd, the
        gradients exposed again (the closure's ``zero_grad`` dropped them), the step counted."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.driver.replayed_backward()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @contextmanager
    def _driver_around_autograd(self, driver: TrainingDriver) -> Iterator[list]:
        """Within the block, the precision plugin's ``backward`` (the call that runs autograd, between the
        ``on_before_backward`` and ``on_after_backward`` hooks) is wrapped in the driver's ``before_backward``
        and ``after_backward``; an instance attribute over the plugin's method, removed afterwards. Yields a
        list that holds ``True`` once the wrapped call has run."""
        plugin = self.precision_plugin
        had = "backward" in plugin.__dict__
        saved = plugin.__dict__.get("backward")
        inner = plugin.backward
        ran: list = []

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            driver.before_backward(tensor)
            try:
                out = inner(tensor, *args, **kwargs)
            except RuntimeError as exc:  # a write into a transient main_grad placeholder: said in the engine's words
                explained = driver.engine.adoption.explain(exc) if driver.engine is not None else None
                if explained is None:
                    raise
                raise explained from exc
            driver.after_backward()  # completes the step exactly when gradient sync is on (not under no_sync)
            ran.append(True)
            return out

        plugin.backward = backward
        try:
            yield ran
        finally:
            if had:
                plugin.backward = saved
            else:
                del plugin.backward

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Module] = None,
        **kwargs: Any,
    ) -> Any:
        """Lightning's step (closure: forward, backward, clipping; then ``optimizer.step``) inside the driver's
        ``stepping`` (the captured or cached optimizer step, where it applies), then ``after_optimizer_step``.
        The gradients stay in ``param.grad`` (aliasing ``main_grad``) for ``on_train_batch_end`` and
        ``on_before_zero_grad``, as under ``"ddp"``; Lightning's ``zero_grad`` before the next backward sets
        them to ``None`` and the driver's ``before_backward`` zeroes ``main_grad`` to match."""
        if isinstance(optimizer, self._lightning_ns.optimizer_wrapper):
            optimizer = optimizer.optimizer
        driver = self.driver
        if driver is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        scaler = getattr(self.precision_plugin, "scaler", None)
        refusal = ("the GradScaler of 16-mixed checks the gradients for inf/NaN on the host before each step"
                   if scaler is not None else None)
        whole = self.whole_step  # a fused Adam's update may run inside the step's graph: optimizer.step() skips it
        updated = whole.take_update if whole is not None and whole.update is not None else None
        with driver.stepping(optimizer, refusal, updated):
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        driver.after_optimizer_step(zero_grad=False)
        return out

    @property
    def cached_optimizer_steps(self) -> int:
        """Optimizer steps taken on cached tensor lists so far in this fit (``graphs.cached_optimizer_step``)."""
        return self.driver.cached_optimizer_steps if self.driver is not None else 0

    @property
    def optimizer_replays(self) -> int:
        """Optimizer steps replayed from a graph so far in this fit (``graphs.capture_optimizer``), their own or the
        whole step's."""
        in_step = self.whole_step.stats.updates if self.whole_step is not None else 0
        return (self.driver.optimizer_replays if self.driver is not None else 0) + in_step
