"""Callbacks that record, during a Lightning fit, what the tests compare."""

from __future__ import annotations

from typing import Dict, List

import torch
from lightning.pytorch import Callback


class LossRecorder(Callback):
    """Records the loss of every step (``nan`` for a batch the module skipped), and nothing between the backward and
    the optimizer step (a hook there keeps the update out of the step's graph)."""

    def __init__(self) -> None:
        self.losses: List[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs is None or "loss" not in outputs:
            self.losses.append(float("nan"))
            return
        self.losses.append(float(outputs["loss"].detach()))


class GradRecorder(Callback):
    """Records losses every step, every parameter's gradient (``.grad``) at chosen global steps, and (under
    ``cudagraph_ddp``) the engine's grad-ready counts by parameter name at every optimizer step."""

    def __init__(self, at_steps=(), record_batches: bool = False) -> None:
        self.losses: List[float] = []
        self.ready_counts: List[Dict[str, int]] = []
        self.record_batches = record_batches
        self.batches: list = []
        self.at_steps = set(at_steps)
        self.grads: Dict[int, Dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.record_batches:
            self.batches.append([t.detach().clone() for t in batch])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs is None or "loss" not in outputs:  # a batch the LightningModule skipped (returned None)
            self.losses.append(float("nan"))
            return
        self.losses.append(float(outputs["loss"].detach()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self.ready_counts.append(dict(engine.last_ready_counts))
        if trainer.global_step in self.at_steps:
            self.grads[trainer.global_step] = {
                n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None
            }


class LifecycleRecorder(Callback):
    """Under cudagraph_ddp: counts captures, the eager calls made by every validation run, and checks at the
    start of every training batch that no gradient is pending (``param.grad`` None, ``main_grad`` zero).
    (Under "ddp" ``param.grad`` still holds the last step's gradient there: Lightning zeroes it inside the
    next step's closure, before the backward; so only the ``cudagraph_ddp`` record is checked.)"""

    def __init__(self) -> None:
        self.capture_seconds = []  # GraphStats.capture_seconds after every training batch (grows per capture)
        self.val_runs = []  # (sanity, validation batches, eager calls during the run, replays during the run)
        self.val_losses = []
        self.clean_starts = []  # (global_step, batch_idx, came right after a validation run, no param.grad)
        self._after_val = False
        self._val_batches = 0
        self._before = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        manager = getattr(trainer.strategy, "graph_manager", None)
        if manager is not None:
            self.capture_seconds.append(manager.stats.capture_seconds)

    @property
    def captures(self) -> int:
        """Number of training batches during which a capture happened."""
        seen = [0.0, *self.capture_seconds]
        return sum(1 for a, b in zip(seen, seen[1:]) if b != a)

    def _counters(self, trainer):
        manager = getattr(trainer.strategy, "graph_manager", None)
        return (manager.stats.eager_calls, manager.stats.forward_replays) if manager is not None else (0, 0)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._before = self._counters(trainer)
        self._val_batches = 0

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._val_batches += 1

    def on_validation_end(self, trainer, pl_module) -> None:
        eager, replays = self._counters(trainer)
        self.val_runs.append((trainer.sanity_checking, self._val_batches, eager - self._before[0],
                              replays - self._before[1]))
        self.val_losses.append(float(trainer.callback_metrics["val_loss"]))
        self._after_val = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # what a hook sees: no param.grad at all (main_grad may still hold values that the next backward zeroes
        # because param.grad is None, as eager PyTorch starts from None)
        clean = all(p.grad is None for p in pl_module.parameters())
        assert all(not hasattr(p, "main_grad") or p.grad is None or p.grad is p.main_grad
                   for p in pl_module.parameters()), "param.grad set but not the engine's main_grad"
        self.clean_starts.append((trainer.global_step, batch_idx, self._after_val, clean))
        self._after_val = False
