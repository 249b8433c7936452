"""``pytorch_lightning.Trainer`` (the standalone package) with ``strategy="cudagraph_ddp"`` and the classes of
:mod:`cg_lightning.pytorch_lightning`, against its own ``"ddp"`` on the same seed and data (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("pytorch_lightning")

import cg_lightning  # noqa: E402  (registers the strategy name with both Lightning packages)
from cg_lightning.pytorch_lightning import CUDAGraphCallback, CUDAGraphDDPStrategy, GraphMonitor  # noqa: E402
from cg_lightning.examples.gpt import GPT  # noqa: E402

STEPS = 8
N_LAYER = 2


class TinyGPT(pl.LightningModule):
    """The example GPT (two blocks in a ``ModuleList``, graphed by default) as a ``pytorch_lightning`` module,
    trained with a fused AdamW (so the cached optimizer step runs too)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(vocab_size=64, block_size=16, n_layer=N_LAYER, n_head=2, d_model=32)
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, fused=True)


def _fit(strategy, callbacks=()):
    """``STEPS`` optimizer steps of :class:`TinyGPT` from seed 5 on fixed random tokens; returns the model and
    the trainer."""
    pl.seed_everything(5, workers=True)
    tokens = torch.randint(0, 64, (STEPS * 4, 17), generator=torch.Generator().manual_seed(11))
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    model = TinyGPT()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=STEPS, logger=False,
                         callbacks=list(callbacks), enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    return model, trainer


@pytest.fixture(scope="module")
def reference():
    return _fit("ddp")[0]


def _assert_same_training(model, reference):
    assert model.losses == reference.losses
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("by", ["name", "class"])
def test_fit_equals_pytorch_lightning_ddp_bit_for_bit(by, reference):
    """By name and by class, the losses and final weights equal ``pl.Trainer(strategy="ddp")`` exactly, with
    the whole step (by name: the default) or the layers (``graphs.whole_step: false``) replayed from graphs after the
    eager warmup, and the fused AdamW stepped on cached lists."""
    strategy = "cudagraph_ddp" if by == "name" else CUDAGraphDDPStrategy(graphs={"backend": "eager",
                                                                                 "whole_step": False})
    model, trainer = _fit(strategy)
    assert type(trainer.strategy) is CUDAGraphDDPStrategy
    assert isinstance(trainer.strategy, pl.strategies.DDPStrategy)
    if by == "name":
        stats = trainer.strategy.last_step_graph_stats
        assert stats.captures == 1 and stats.replays == STEPS - 3, stats
    else:
        stats = trainer.strategy.last_graph_stats
        assert stats.captured_runners == N_LAYER and stats.forward_replays == N_LAYER * (STEPS - 2)
    assert trainer.strategy.last_cached_optimizer_steps > 0
    _assert_same_training(model, reference)


def test_callbacks_of_pytorch_lightning(reference):
    """The ``pytorch_lightning`` callbacks: ``CUDAGraphCallback`` sets the strategy's schedule (one warmup step),
    ``GraphMonitor`` runs alongside; training stays equal to ``"ddp"``."""
    assert isinstance(CUDAGraphCallback(), pl.Callback) and isinstance(GraphMonitor(), pl.Callback)
    strategy = CUDAGraphDDPStrategy(graphs={"backend": "eager", "whole_step": False})
    model, trainer = _fit(strategy, [CUDAGraphCallback(warmup_steps=1), GraphMonitor(log_every_n_steps=2)])
    assert strategy.graph_options.warmup_steps == 1
    assert strategy.last_graph_stats.forward_replays == N_LAYER * (STEPS - 1)
    _assert_same_training(model, reference)


def test_strategy_of_the_other_package_names_the_import():
    """Each package's Trainer refuses the other package's class with a message naming the class that fits."""
    from lightning.pytorch import Trainer

    kw = dict(accelerator="cpu", devices=1, logger=False)
    with pytest.raises(TypeError, match=r"cg_lightning\.CUDAGraphDDPStrategy is built on lightning\.pytorch, "
                                        r"but the Trainer it was given to is pytorch_lightning's .*use `from "
                                        r"cg_lightning\.pytorch_lightning import CUDAGraphDDPStrategy`"):
        pl.Trainer(strategy=cg_lightning.CUDAGraphDDPStrategy(), **kw)
    with pytest.raises(TypeError, match=r"built on pytorch_lightning, but the Trainer it was given to is "
                                        r"lightning\.pytorch's .*use `from cg_lightning import "
                                        r"CUDAGraphDDPStrategy`"):
        Trainer(strategy=CUDAGraphDDPStrategy(), **kw)
    assert type(Trainer(strategy="cudagraph_ddp", **kw).strategy) is cg_lightning.CUDAGraphDDPStrategy


def test_options_are_checked_as_under_lightning_pytorch():
    with pytest.raises(TypeError, match=r"^graphs\.warmup_steps: expected int, got 'two'$"):
        CUDAGraphDDPStrategy(graphs={"warmup_steps": "two"})
