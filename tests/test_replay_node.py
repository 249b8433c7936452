"""Backward passes a captured backward cannot serve: ``torch.autograd.grad`` (or ``backward(inputs=...)``)
through a graphed layer whose graph adds weight gradients into ``main_grad``, and a second backward through
the same call (``retain_graph=True``). Both stop with an error naming the layer, before the graph runs (the
first) or before it runs twice (the second). Unchecked, the first would train silently off eager on a GPU
and fail with ``TypeError: 'NoneType' object is not iterable`` on CPU."""

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule, seed_everything
from torch import nn

from tests.engine_models import graphed_engine
from tests.helpers import cg_strategy, make_trainer


class _Probe(LightningModule):
    """Three residual MLP blocks; ``probe``: take d loss / d hidden state after block 0 with
    ``torch.autograd.grad`` inside ``training_step`` from global step ``probe`` on (a gradient-norm probe)."""

    def __init__(self, probe=None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3))
        self.head = nn.Linear(16, 1)
        self.probe = probe

    def training_step(self, batch, batch_idx):
        x, y = batch
        hidden = []
        for block in self.blocks:
            x = x + block(x)
            hidden.append(x)
        loss = F.mse_loss(self.head(x), y)
        if self.probe is not None and self.global_step >= self.probe:
            (g,) = torch.autograd.grad(loss, hidden[0], retain_graph=True)
            self.log("hidden_grad_norm", g.norm())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


class _Data(LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(16)]
        return torch.utils.data.DataLoader(data, batch_size=None)


def test_autograd_grad_through_a_graphed_layer_is_an_error_naming_it():
    """From step 3 (after capture at step 2) ``autograd.grad(loss, hidden[0])`` reaches the replays of blocks 1
    and 2: refused, naming the first one reached, instead of adding into main_grad a gradient eager autograd
    would not have accumulated. Before capture the same probe runs eagerly and is fine."""
    seed_everything(1)
    trainer = make_trainer(cg_strategy(layers=["blocks.*"]), 6)
    with pytest.raises(RuntimeError, match=r"graphed 'blocks\.2'.*torch\.autograd\.grad.*graphs\.layers"):
        trainer.fit(_Probe(probe=3), datamodule=_Data())
    assert trainer.global_step == 3  # the steps before ran, probe included while eager


def test_second_backward_through_the_same_call_is_an_error_naming_it():
    """Engine level: ``loss.backward(retain_graph=True)`` then ``loss.backward()`` on a replayed step."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])
    manager, engine = graphed_engine(model, layers=["0", "1"])
    x = torch.randn(4, 8)
    for step in range(2):
        manager.begin_step(step)
        engine(x).sum().backward()
        manager.end_step()
        engine.finish_grad_sync()
        engine.zero_grad_buffer()
    manager.begin_step(2)
    before = manager.stats.forward_replays
    loss = engine(x).sum()
    assert manager.stats.forward_replays == before + 2  # both layers replayed
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"graphed '1': a second backward pass reached the same call"):
        loss.backward()
