"""Small LightningModules and data for the "ddp" vs "cudagraph_ddp" parity cases (``tests/test_lightning_parity.py``).

Three bodies: one ``nn.Linear`` (like Lightning's ``BoringModel``), :class:`Block` s inside an ``nn.Sequential``,
and an ``nn.ModuleList`` of same-class :class:`Block` s between an input projection and a head. Data: fixed
random regression sets (inputs ``(n, 8)``, targets ``(n, 1)``), each drawn from its own generator, so they do not
depend on the global RNG; loaders keep their order (``shuffle=False``).

Every module keeps ``self.events``, a list that the recording callbacks of ``tests/lightning_runs.py`` (and the
module's own overrides) append to in call order; a run compares that list between strategies.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, TensorDataset

D_IN, HIDDEN, BATCH = 8, 16, 4
TRAIN_SAMPLES = 32  # 8 batches per epoch in one process, 4 per rank with two


def dataset(n: int = TRAIN_SAMPLES, seed: int = 0) -> TensorDataset:
    """``n`` samples: inputs ``(n, D_IN)`` and targets ``(n, 1)``, from a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def loader(n: int = TRAIN_SAMPLES, seed: int = 0) -> DataLoader:
    return DataLoader(dataset(n, seed), batch_size=BATCH, shuffle=False)


class Block(nn.Module):
    """``x + tanh(dropout(fc(x)))`` on ``(batch, d)``."""

    def __init__(self, d: int = HIDDEN, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.drop(self.fc(x)))


class ListBody(nn.Module):
    """Input projection, ``n`` :class:`Block` s in an ``nn.ModuleList`` (``blocks``), a head."""

    def __init__(self, n: int = 3, dropout: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.blocks = nn.ModuleList([Block(HIDDEN, dropout) for _ in range(n)])
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_body(kind: str, dropout: float = 0.0) -> nn.Module:
    """``"linear"``, ``"sequential"`` or ``"modulelist"``: ``(batch, D_IN) -> (batch, 1)``."""
    if kind == "linear":
        return nn.Linear(D_IN, 1)
    if kind == "sequential":
        return nn.Sequential(nn.Linear(D_IN, HIDDEN), Block(HIDDEN, dropout), Block(HIDDEN, dropout),
                             nn.Linear(HIDDEN, 1))
    if kind == "modulelist":
        return ListBody(dropout=dropout)
    raise ValueError(f"unknown body {kind!r}")


class ParityModel(LightningModule):
    """Regression with mean squared error on :func:`dataset`.

    Args:
        body: ``"linear"``, ``"sequential"`` or ``"modulelist"`` (:func:`make_body`).
        optimizer: ``"sgd"`` (momentum 0.9), ``"adam"``, ``"fused_adamw"`` or ``"lbfgs"``.
        scheduler: ``None``; ``"step"`` (StepLR every 3 optimizer steps); ``"epoch"`` (StepLR every epoch);
            ``"plateau"`` (ReduceLROnPlateau on the epoch mean of ``train_loss``); ``"plateau_val"`` (on
            ``val_loss``); ``"plateau_step"`` (on ``train_loss``, checked every optimizer step).
        branch: ``None``; ``"step"``: an extra head ``aux`` (on the inputs) joins the loss only on even batch
            indices; ``"rank"``: only where batch index plus global rank is even.
        frozen: the body's first parameters (``requires_grad=False`` from the start).
        skip_every: ``training_step`` returns ``None`` (Lightning skips backward and step) on batches
            ``k * skip_every - 1``.
    """

    def __init__(self, body: str = "modulelist", optimizer: str = "sgd", lr: float = 0.05,
                 scheduler: Optional[str] = None, dropout: float = 0.0, branch: Optional[str] = None,
                 frozen: bool = False, skip_every: int = 0) -> None:
        super().__init__()
        self.body = make_body(body, dropout)
        self.aux = nn.Linear(D_IN, 1) if branch else None
        if frozen:
            next(self.body.parameters()).requires_grad_(False)
        self.optimizer_name, self.lr, self.scheduler_name = optimizer, lr, scheduler
        self.branch, self.skip_every = branch, skip_every
        self.events: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def loss(self, batch, batch_idx: int = 0) -> torch.Tensor:
        x, y = batch
        out = self(x)
        if self.aux is not None and (batch_idx + (self.global_rank if self.branch == "rank" else 0)) % 2 == 0:
            out = out + self.aux(x)
        return F.mse_loss(out, y)

    def training_step(self, batch, batch_idx):
        if self.skip_every and batch_idx % self.skip_every == self.skip_every - 1:
            return None
        loss = self.loss(batch, batch_idx)
        self.log("train_loss", loss)
        self.log("train_loss_mean", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("val_loss", loss)
        return loss

    def test_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def train_dataloader(self):
        return loader()

    def val_dataloader(self):
        return loader(16, seed=1)

    def test_dataloader(self):
        return loader(16, seed=2)

    def predict_dataloader(self):
        return loader(12, seed=3)

    def make_optimizer(self, params, name: Optional[str] = None):
        name = name or self.optimizer_name
        params = [p for p in params if p.requires_grad]
        if name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        if name == "adam":
            return torch.optim.Adam(params, lr=self.lr)
        if name == "fused_adamw":
            return torch.optim.AdamW(params, lr=self.lr, fused=True)
        if name == "lbfgs":
            return torch.optim.LBFGS(params, lr=self.lr, max_iter=3, history_size=4)
        raise ValueError(f"unknown optimizer {name!r}")

    def make_scheduler(self, opt) -> Optional[dict]:
        name = self.scheduler_name
        if name is None:
            return None
        if name in ("step", "epoch"):
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3 if name == "step" else 1, gamma=0.5)
            return {"scheduler": sched, "interval": name}
        monitor, interval = {"plateau": ("train_loss_mean", "epoch"), "plateau_val": ("val_loss", "epoch"),
                             "plateau_step": ("train_loss", "step")}[name]
        # a 30 % improvement is required each time, so the rate is cut within a few epochs (or steps)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=2 if interval == "step" else 0,
                                                           threshold=0.3)
        return {"scheduler": sched, "interval": interval, "monitor": monitor}

    def configure_optimizers(self):
        opt = self.make_optimizer(self.parameters())
        sched = self.make_scheduler(opt)
        return opt if sched is None else {"optimizer": opt, "lr_scheduler": sched}


class WarmupStepModel(ParityModel):
    """``optimizer_step`` overridden to warm the learning rate up linearly over the first 4 steps."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        for group in optimizer.param_groups:
            group["lr"] = self.lr * min(1.0, (self.trainer.global_step + 1) / 4)
        optimizer.step(closure=optimizer_closure)


class SkipStepModel(ParityModel):
    """``optimizer_step`` overridden to run the closure (forward, backward) but not step on every third batch."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if batch_idx % 3 == 2:
            optimizer_closure()
        else:
            optimizer.step(closure=optimizer_closure)


class ZeroGradModel(ParityModel):
    """``optimizer_zero_grad`` overridden to zero gradients in place (``set_to_none=False``)."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=False)


class ClipHeadModel(ParityModel):
    """``configure_gradient_clipping`` overridden: the head's gradients clipped by norm 0.05, the rest by value
    0.02; the clipped gradients are recorded in ``events``."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        head = list(self.body.head.parameters())
        torch.nn.utils.clip_grad_norm_(head, 0.05)
        rest = [p for n, p in self.named_parameters() if not n.startswith("body.head.")]
        torch.nn.utils.clip_grad_value_(rest, 0.02)
        self.events.append(("clipped", {n: p.grad.clone() for n, p in self.named_parameters()}))


class PlainAdamModel(ParityModel):
    """A fused AdamW (lr 0.01) and a training step that reads only its batch (graphed whole by default), on
    ``batches`` batches of 4 an epoch (in one process)."""

    def __init__(self, batches: int = 8, **kwargs) -> None:
        super().__init__(optimizer="fused_adamw", lr=0.01, **kwargs)
        self.batches = batches

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self):
        return loader(4 * self.batches)
