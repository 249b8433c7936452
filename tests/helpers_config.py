"""Small Lightning classes the command line's tests build by ``class_path`` (test_backends.py builds one directly)."""

from __future__ import annotations

from typing import Literal, Optional

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyRegressor(LightningModule):
    """A two-layer MLP regressor."""

    def __init__(self, in_features: int = 4, hidden: int = 8, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TinyData(LightningDataModule):
    """Random regression data (fixed generator seed)."""

    def __init__(self, in_features: int = 4, n: int = 32, batch_size: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, in_features, generator=g)
        self.dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size)

    test_dataloader = predict_dataloader = val_dataloader


class RecordingCallback(Callback):
    """Counts training batches; ``tag`` identifies the instance."""

    def __init__(self, tag: str = "") -> None:
        self.tag = tag
        self.batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1


class NotACallback:
    """Neither a callback nor a module; takes any keyword argument."""

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs


class ManualRegressor(TinyRegressor):
    """``TinyRegressor`` with manual optimization (``automatic_optimization = False``)."""

    def __init__(self, in_features: int = 4, hidden: int = 8, lr: float = 0.1) -> None:
        super().__init__(in_features=in_features, hidden=hidden, lr=lr)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


class ChoiceCallback(Callback):
    """A callback whose arguments carry ``Literal`` and ``Optional`` annotations."""

    def __init__(self, mode: Literal["min", "max"] = "min", patience: Optional[int] = None) -> None:
        self.mode = mode
        self.patience = patience


class EvalRegressor(TinyRegressor):
    """``TinyRegressor`` that also tests (``test_loss``) and predicts (the outputs of ``net``)."""

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.net(x), y))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])


class HostReadBlock(nn.Module):
    """A linear layer that reads a value of its output on the host (``.item()``), which a graph cannot replay."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.lin = nn.Linear(features, features)

    def forward(self, x):
        y = self.lin(x)
        scale = y.abs().max().item()
        return y * (1.0 + 0.0 * scale)


class HostReadRegressor(TinyRegressor):
    """``TinyRegressor`` behind two :class:`HostReadBlock` (``blocks.*``): their capture fails."""

    def __init__(self, in_features: int = 4, hidden: int = 8, lr: float = 0.1) -> None:
        super().__init__(in_features=in_features, hidden=hidden, lr=lr)
        self.blocks = nn.ModuleList([HostReadBlock(in_features) for _ in range(2)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.net(x), y)


class LateParameterRegressor(TinyRegressor):
    """``TinyRegressor`` that starts using a parameter of its own (``late``) after ``from_step`` optimizer steps:
    a gradient the data-parallel engine did not expect."""

    def __init__(self, in_features: int = 4, hidden: int = 8, lr: float = 0.1, from_step: int = 3) -> None:
        super().__init__(in_features=in_features, hidden=hidden, lr=lr)
        self.late = nn.Linear(in_features, in_features)
        self.from_step = from_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step >= self.from_step:
            x = self.late(x)
        return nn.functional.mse_loss(self.net(x), y)
