"""Layers checkpointed around their whole call (``graphs/recompute/outer_checkpoint.py``), and the warning when nothing is
graphed because every call of the selected layers ran without autograd.

``AroundCallLayer`` follows the convention of transformers' ``GradientCheckpointingLayer`` in the versions that
override ``__call__`` (so this runs on every installed transformers; ``test_transformers_models.py`` trains the
library's own layers). Each run is compared with Lightning's ``"ddp"`` on the same seed and data: weights equal
bit for bit.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn as nn
from lightning.pytorch import Callback, LightningModule, seed_everything
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from cg_lightning.graphs.recompute import outer_checkpoint
from tests.helpers import cg_strategy, make_trainer


class AroundCallLayer(nn.Module):
    """Checkpoints around its own ``__call__`` when ``gradient_checkpointing`` is on, with the function set on it."""

    gradient_checkpointing = False

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x, scale=1.0):
        return x + scale * torch.tanh(self.fc(x))

    def __call__(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(functools.partial(super().__call__, **kwargs), *args)
        return super().__call__(*args, **kwargs)


def enable(model: nn.Module, use_reentrant: bool) -> None:
    for layer in model.modules():
        if isinstance(layer, AroundCallLayer):
            layer.gradient_checkpointing = True
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=use_reentrant)


class Net(LightningModule):
    def __init__(self, around: str = "layer") -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([AroundCallLayer() for _ in range(3)])
        self.head = nn.Linear(8, 1)
        self.around = around  # "layer": the layers' own convention; "user": torch.utils.checkpoint around each

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.stem(x)
        for block in self.blocks:
            if self.around == "user":
                h = checkpoint(block, h, use_reentrant=True)
            else:
                h = block(h, scale=0.5)
        return ((self.head(h) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class EnableAgain(Callback):
    """Sets a new checkpoint function on every layer at one step, as a second ``gradient_checkpointing_enable``."""

    def __init__(self, at_step: int, use_reentrant: bool) -> None:
        self.at_step, self.use_reentrant = at_step, use_reentrant

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at_step:
            enable(pl_module, self.use_reentrant)


def _fit(strategy, steps=8, callbacks=(), prepare=None, **net):
    seed_everything(0)
    model = Net(**net)
    if prepare is not None:
        prepare(model)
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    target = torch.randn(64, 1, generator=torch.Generator().manual_seed(2))
    trainer = make_trainer(strategy, steps, callbacks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(TensorDataset(data, target), batch_size=8))
    return model, trainer, [str(w.message) for w in caught if "cg_lightning" in str(w.message)]


def _assert_equal(got, ref):
    for (name, p), q in zip(got.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpoint_around_call_moves_inside_and_layers_are_graphed(use_reentrant):
    prepare = functools.partial(enable, use_reentrant=use_reentrant)
    again = lambda: [EnableAgain(5, use_reentrant)]  # noqa: E731  (a new function after capture is held too)
    ref, _, _ = _fit("ddp", prepare=prepare, callbacks=again())
    got, trainer, messages = _fit(cg_strategy("eager", whole_step=False), prepare=prepare, callbacks=again())
    assert not [m for m in messages if "nothing is graphed" in m], messages
    stats = trainer.strategy.last_graph_stats
    assert stats.captured_runners == 3 and stats.fallback_calls == 0, stats
    assert stats.forward_replays == 3 * (8 - 2), stats  # every call after the 2 warmup steps replayed
    _assert_equal(got, ref)
    for block in got.blocks:  # the user's function given back after training
        assert not isinstance(block.__dict__["_gradient_checkpointing_func"], outer_checkpoint.PassThrough)


def test_plain_layers_are_left_alone():
    assert not outer_checkpoint.checkpoints_around_call(nn.Linear(2, 2))
    assert outer_checkpoint.checkpoints_around_call(AroundCallLayer())


def test_nothing_graphed_is_said_once_and_training_stays_exact():
    """A reentrant checkpoint the user puts around each layer runs its forward without autograd: nothing can be
    graphed, and one warning says so and why."""
    ref, _, _ = _fit("ddp", around="user")
    got, trainer, messages = _fit(cg_strategy("eager", whole_step=False), around="user")
    said = [m for m in messages if "nothing is graphed" in m]
    assert len(said) == 1, messages
    assert "blocks.0, blocks.1, blocks.2" in said[0] and "without autograd" in said[0], said[0]
    assert trainer.strategy.last_graph_stats.captured_runners == 0
    _assert_equal(got, ref)
