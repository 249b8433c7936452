"""The GPT example's LightningModule: next-token cross-entropy on :class:`~cg_lightning.examples.gpt_model.GPT`
(the model, re-exported here with its :class:`~cg_lightning.examples.gpt_model.Block`), AdamW with a linear warmup.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

import cg_lightning
from cg_lightning.examples.arguments import check_arguments, finite_at_least, whole
from cg_lightning.examples.data import model_fit_problems
from cg_lightning.examples.gpt_model import GPT, Block

__all__ = ["Block", "GPT", "GPTLightningModule"]


class _LinearWarmup:
    """LR multiplier ramping linearly from ``1/steps`` to 1 over ``steps`` steps.

    A small class rather than a lambda so that it pickles and its state is saved
    by ``LambdaLR.state_dict()``.
    """

    def __init__(self, steps: int) -> None:
        self.steps = int(steps)

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.steps)


class GPTLightningModule(LightningModule):
    """LightningModule training :class:`GPT` with next-token cross-entropy.

    Batches are ``(x, y)`` pairs of int64 tensors of shape ``(B, T)`` where ``y`` is
    ``x`` shifted left by one token (see :class:`cg_lightning.examples.data.TextDataModule`).

    Model args are those of :class:`GPT`; optimiser args:

    Args:
        lr: peak AdamW learning rate.
        weight_decay: decoupled weight decay applied to parameters with
            ``ndim >= 2`` (matrices and embeddings); biases and norms get 0.
        betas: AdamW betas; a list (e.g. from YAML) is converted to a tuple.
        warmup_lr_steps: if > 0, the LR is ramped linearly over that many
            optimiser steps by a per-step ``LambdaLR``.
        fused: ``torch.optim.AdamW(fused=...)``; ``None`` lets torch choose
            (``foreach`` on CUDA). ``True`` runs one fused kernel per step, and
            lets ``cudagraph_ddp`` call it on cached tensor lists
            (``graphs.cached_optimizer_step``).
        recompute_loss: compute the head and the loss under activation
            recomputation (:func:`cg_lightning.checkpoint`), so the ``(B, T, V)``
            logits are not kept for the backward. With ``tie_weights`` the shared
            weight then reports ready twice per step: once in the outer backward
            (embedding) and once in the loss's nested backward (head).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        tie_weights: bool = False,
        recompute_blocks: bool = False,
        block_schedule: Sequence[int] | None = None,
        recompute_loss: bool = False,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        betas: Sequence[float] = (0.9, 0.95),
        warmup_lr_steps: int = 0,
        fused: bool | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_arguments(
            lr=(lr, finite_at_least(lr, 0.0, strict=True), "a finite learning rate > 0"),
            weight_decay=(weight_decay, finite_at_least(weight_decay, 0.0), "a finite number >= 0"),
            betas=(betas, len(betas) == 2 and all(finite_at_least(b, 0.0) and b < 1.0 for b in betas),
                   "two numbers in [0, 1)"),
            warmup_lr_steps=(warmup_lr_steps, whole(warmup_lr_steps, 0), "an int >= 0"),
        )
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.betas = tuple(float(b) for b in betas)
        if len(self.betas) != 2:
            raise ValueError(f"betas must have two entries, got {betas!r}")
        self.warmup_lr_steps = int(warmup_lr_steps)
        self.fused = fused
        self.model = GPT(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            d_model=d_model,
            dropout=dropout,
            bias=bias,
            tie_weights=tie_weights,
            recompute_blocks=recompute_blocks,
            block_schedule=block_schedule,
        )
        self.recompute_loss = bool(recompute_loss)

    def forward(self, idx: Tensor) -> Tensor:
        """``(B, T)`` int64 -> ``(B, T, V)`` logits."""
        return self.model(idx)

    def setup(self, stage: str) -> None:
        """Refuse a data module that cannot feed this model, before the first batch: windows longer than its
        context, token ids beyond its vocabulary (:func:`cg_lightning.examples.data.model_fit_problems`).

        Raises:
            cg_lightning.errors.ConfigError (a ``ValueError``): one line per problem, naming the keys
                (``data.init_args.block_size``, ``data.init_args.path``); ``python -m cg_lightning`` reports them as
                ``error:`` lines, exit status 2.
        """
        self.check_data(getattr(self.trainer, "datamodule", None) if self._trainer is not None else None)

    def check_data(self, datamodule) -> None:
        """The check of :meth:`setup`, for loops without a Trainer (``examples/train_accelerate.py``; call it after
        the data module's ``setup``, which finds the vocabulary of a ``.bin`` file)."""
        problems = model_fit_problems(datamodule, self.model.vocab_size, self.model.block_size)
        if problems:
            from cg_lightning.errors import ConfigError

            raise ConfigError("\n".join(problems))

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        hidden = self.model.hidden(x)
        if self.recompute_loss and torch.is_grad_enabled():
            # The (B, T, V) logits are never stored: recomputed in the backward (reentrant recomputation).
            return cg_lightning.checkpoint(self.model.head_loss, hidden, y)
        return self.model.head_loss(hidden, y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Return the scalar mean cross-entropy loss and log it as ``train_loss``."""
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Log the mean cross-entropy as ``val_loss`` (averaged across ranks)."""
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        """AdamW with decay on ``ndim >= 2`` parameters, optional linear LR warmup."""
        decay, no_decay = [], []
        for _, p in self.named_parameters():  # tied weights appear once
            if not p.requires_grad:
                continue
            (decay if p.ndim >= 2 else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, fused=self.fused)
        if self.warmup_lr_steps > 0:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, _LinearWarmup(self.warmup_lr_steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        return opt
