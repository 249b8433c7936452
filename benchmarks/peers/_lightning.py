"""Shared by the Lightning peers: the LightningModules, the step clock and one timed ``Trainer.fit``."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any, List, Optional, Sequence

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything

from benchmarks.common import (
    BatchDataset,
    LoopTiming,
    RunSettings,
    free_port,
    lm_loss,
    build_model,
    make_batches,
    make_optimizer,
    sync,
)
from cg_lightning.examples.gpt import GPTLightningModule


class BenchGPTModule(GPTLightningModule):
    """The example's LightningModule with the benchmark's optimizer and no per-step ``self.log``.

    Same GPT; the loss is computed exactly as in the plain loops (``lm_loss(model(x), y)``), whatever options
    the example's own ``_loss`` grows. Logging is left out so that Lightning's result collection is not part
    of what the strategies are compared on.
    """

    bench_settings: Optional[RunSettings] = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        return lm_loss(self.model(x), y)

    def configure_optimizers(self):
        return make_optimizer(self.named_parameters(), self.bench_settings)


class BenchModule(LightningModule):
    """Any model of ``benchmarks.models`` as ``self.model``, trained like :class:`BenchGPTModule` (the Llama's
    LightningModule; ``compile_model`` wraps it in ``torch.compile``, as Lightning users compile a model)."""

    def __init__(self, s: RunSettings, compile_model: bool = False) -> None:
        super().__init__()
        self.model = build_model(s)
        if compile_model:
            self.model = torch.compile(self.model)
        self.bench_settings = s

    def training_step(self, batch, batch_idx):
        x, y = batch
        return lm_loss(self.model(x), y)

    def configure_optimizers(self):
        return make_optimizer(self.named_parameters(), self.bench_settings)


def make_module(s: RunSettings, compile_model: bool = False) -> LightningModule:
    """The example's own LightningModule for the GPT (:class:`BenchGPTModule`), :class:`BenchModule` otherwise
    and whenever the model is compiled."""
    if s.model == "gpt" and not compile_model:
        module = BenchGPTModule(
            **s.gpt_kwargs(), lr=s.lr, weight_decay=s.weight_decay, betas=s.betas, warmup_lr_steps=0
        )
        module.bench_settings = s
        return module
    return BenchModule(s, compile_model)


class StepClock(Callback):
    """Timestamps (after a device sync) at the end of the last warmup step and of every ``steps``-th step
    after it, so window ``r`` covers exactly ``steps`` full steps (batch fetch and transfer included)."""

    def __init__(self, s: RunSettings) -> None:
        if s.warmup < 1:
            raise ValueError("the Lightning peers need warmup >= 1")
        self.s = s
        self.done = 0
        self.start: Optional[float] = None
        self.marks: List[float] = []
        self.last_loss: Optional[torch.Tensor] = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.start is None:
            sync(self.s.device)
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.done += 1
        k = self.done - self.s.warmup
        if k >= 0 and k % self.s.steps == 0 and len(self.marks) <= self.s.repeats:
            sync(self.s.device)
            self.marks.append(time.perf_counter())
        if self.done == self.s.total_steps:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            self.last_loss = loss.detach() if isinstance(loss, torch.Tensor) else None

    def timing(self) -> LoopTiming:
        if len(self.marks) != self.s.repeats + 1:
            raise RuntimeError(
                f"Lightning ran {self.done} of {self.s.total_steps} steps ({len(self.marks)} window marks, "
                f"expected {self.s.repeats + 1})"
            )
        ms = [1000.0 * (b - a) / self.s.steps for a, b in zip(self.marks, self.marks[1:])]
        return LoopTiming(ms, self.marks[0] - self.start, [], self.last_loss)


def fit_timed(s: RunSettings, strategy: Any, callbacks: Sequence[Callback] = (),
              compile_model: bool = False) -> "tuple[LoopTiming, Trainer]":
    """``Trainer(strategy=..., devices=1, precision="bf16-mixed").fit`` for ``s.total_steps`` steps on the
    benchmark's batches; returns the clock's timing and the trainer (for the strategy's stats). ``callbacks``
    join the step clock (the profiling tools' marks); ``compile_model``: the model wrapped in ``torch.compile``
    (:func:`make_module`)."""
    # A fresh port for Lightning's process group; the previous peer's group has been destroyed.
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    seed_everything(s.seed, verbose=False)
    module = make_module(s, compile_model)
    loader = torch.utils.data.DataLoader(
        BatchDataset(make_batches(s), s.total_steps), batch_size=None, shuffle=False, num_workers=0
    )
    clock = StepClock(s)
    trainer = Trainer(
        accelerator="gpu" if s.is_cuda else "cpu",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=s.total_steps,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[clock, *callbacks],
        # One process: keep the loader's sequential order, the order the plain loops use (Lightning's
        # DistributedSampler would shuffle it).
        use_distributed_sampler=False,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
        warnings.filterwarnings("ignore", message=".*Tensor Cores.*")
        trainer.fit(module, train_dataloaders=loader)
    return clock.timing(), trainer
