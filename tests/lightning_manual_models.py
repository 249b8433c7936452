"""Manual-optimization LightningModules for the parity cases: one optimizer, several optimizers, a small GAN,
and a variant of each module that logs which of its own hooks Lightning calls, in order."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch import LightningModule

from tests.lightning_models import D_IN, Block, ParityModel, loader


class ManualModel(ParityModel):
    """One optimizer by hand: ``manual_backward``, then ``step`` and ``zero_grad`` through the
    ``LightningOptimizer``.

    Args:
        accumulate: batches whose gradients are summed (each loss divided by ``accumulate``) before a step.
        closure: step with ``opt.step(closure=...)`` (zero_grad, forward, backward inside the closure).
        schedule: step the learning-rate scheduler by hand at each epoch end (build with ``scheduler="epoch"``).
    """

    def __init__(self, accumulate: int = 1, closure: bool = False, schedule: bool = False, no_sync: bool = False,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.accumulate, self.closure, self.schedule, self.no_sync = accumulate, closure, schedule, no_sync

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        if self.closure:
            def closure():
                loss = self.loss(batch, batch_idx)
                opt.zero_grad()
                self.manual_backward(loss)
                return loss

            loss = opt.step(closure=closure)
        else:
            loss = self.loss(batch, batch_idx)
            steps = (batch_idx + 1) % self.accumulate == 0
            # the strategy's block_backward_sync skips the gradient all-reduce of accumulating backwards
            with (self.trainer.strategy.block_backward_sync() if self.no_sync and not steps
                  else contextlib.nullcontext()):
                self.manual_backward(loss / self.accumulate)
            if steps:
                opt.step()
                opt.zero_grad()
        self.log("train_loss", loss)
        return loss.detach()

    def on_train_epoch_end(self):
        if self.schedule:
            self.lr_schedulers().step()


class TwoOptimizerModel(ParityModel):
    """Two optimizers by hand on the ModuleList body.

    Args:
        shared: both optimizers (SGD, then Adam) hold every parameter and step on two different losses;
            otherwise SGD holds the input projection and the blocks, Adam the head, and each step runs between
            ``toggle_optimizer`` and ``untoggle_optimizer``.
    """

    def __init__(self, shared: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.shared = shared

    def configure_optimizers(self):
        if self.shared:
            return self.make_optimizer(self.parameters(), "sgd"), self.make_optimizer(self.parameters(), "adam")
        first = [p for n, p in self.named_parameters() if not n.startswith("body.head.")]
        return self.make_optimizer(first, "sgd"), self.make_optimizer(self.body.head.parameters(), "adam")

    def training_step(self, batch, batch_idx):
        losses = []
        for opt, scale in zip(self.optimizers(), (1.0, 0.5)):
            if not self.shared:
                self.toggle_optimizer(opt)
            loss = scale * self.loss(batch, batch_idx)
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
            if not self.shared:
                self.untoggle_optimizer(opt)
            losses.append(loss.detach())
        return {"loss": losses[0], "second": losses[1]}


class GANModel(LightningModule):
    """A least-squares GAN on the inputs of :func:`~tests.lightning_models.dataset`, trained by hand.

    The generator maps noise ``(batch, 4)`` through a projection and 2 :class:`Block` s to ``(batch, D_IN)``; the
    discriminator is 3 :class:`Block` s (the largest ModuleList of one class, so these are graphed by default)
    and a head. Per batch: a generator step (discriminator called once, its parameters toggled off), then a
    discriminator step whose one backward runs its blocks twice (real and generated samples). Noise comes from a
    generator seeded by epoch and batch index, independent of the global RNG.
    """

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.g_inp = nn.Linear(4, D_IN)
        self.g_blocks = nn.ModuleList([Block(D_IN) for _ in range(2)])
        self.d_blocks = nn.ModuleList([Block(D_IN) for _ in range(3)])
        self.d_head = nn.Linear(D_IN, 1)
        self.lr = lr
        self.events: list = []

    def generate(self, z: torch.Tensor) -> torch.Tensor:
        h = self.g_inp(z)
        for block in self.g_blocks:
            h = block(h)
        return h

    def discriminate(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.d_blocks:
            x = block(x)
        return self.d_head(x)

    def configure_optimizers(self):
        g_params = [*self.g_inp.parameters(), *self.g_blocks.parameters()]
        d_params = [*self.d_blocks.parameters(), *self.d_head.parameters()]
        return (torch.optim.Adam(g_params, lr=self.lr, betas=(0.5, 0.999)),
                torch.optim.Adam(d_params, lr=self.lr, betas=(0.5, 0.999)))

    def training_step(self, batch, batch_idx):
        real = batch[0]
        opt_g, opt_d = self.optimizers()
        gen = torch.Generator().manual_seed(1000 * self.current_epoch + batch_idx)
        z = torch.randn(real.shape[0], 4, generator=gen).to(real)

        self.toggle_optimizer(opt_g)
        fake = self.generate(z)
        ones = torch.ones(real.shape[0], 1, dtype=real.dtype, device=real.device)
        g_loss = F.mse_loss(self.discriminate(fake), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        scores = torch.cat([self.discriminate(real), self.discriminate(fake.detach())])
        target = torch.cat([torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)]).to(real)
        d_loss = F.mse_loss(scores, target)
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        return {"loss": d_loss.detach(), "g_loss": g_loss.detach()}

    def train_dataloader(self):
        return loader()


class CallLogMixin:
    """Appends ``{"hook": name}`` to ``self.events`` for each LightningModule step hook that Lightning calls."""

    def training_step(self, *args, **kwargs):
        self.events.append({"hook": "training_step"})
        return super().training_step(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self.events.append({"hook": "backward"})
        return super().backward(*args, **kwargs)

    def optimizer_step(self, *args, **kwargs):
        self.events.append({"hook": "optimizer_step"})
        return super().optimizer_step(*args, **kwargs)

    def optimizer_zero_grad(self, *args, **kwargs):
        self.events.append({"hook": "optimizer_zero_grad"})
        return super().optimizer_zero_grad(*args, **kwargs)

    def configure_gradient_clipping(self, *args, **kwargs):
        self.events.append({"hook": "configure_gradient_clipping"})
        return super().configure_gradient_clipping(*args, **kwargs)

    def lr_scheduler_step(self, *args, **kwargs):
        self.events.append({"hook": "lr_scheduler_step"})
        return super().lr_scheduler_step(*args, **kwargs)


class CallLogModel(CallLogMixin, ParityModel):
    pass


class CallLogManualModel(CallLogMixin, ManualModel):
    pass
