"""Default layer selection (``graphs/selection.py``) and training of models it finds nothing in.

Selection is checked on hand-written stacks and on ``transformers`` models (random tiny configs, no downloads);
training on Lightning-style models (one ``nn.Linear``; blocks in an ``nn.Sequential``) under
``strategy="cudagraph_ddp"`` against Lightning's ``"ddp"``, same seed and data: weights equal bit for bit.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

import cg_lightning  # noqa: F401  (registers the strategy name)
from cg_lightning.graphs.selection import default_layers, select_layers


def _names(model):
    return [n for n, _ in default_layers(model)]


class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))

    def forward(self, x):
        return x + self.mlp(x)


def test_single_linear_has_no_default_layers():
    assert _names(nn.Linear(4, 2)) == []


def test_sequential_picks_repeated_classes_with_parameters():
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.LayerNorm(8))
    assert _names(seq) == ["0", "2"]  # the ReLUs repeat but hold no parameters; one LayerNorm is no stack


def test_outermost_stack_wins_and_every_stack_counts():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.ModuleList([Block() for _ in range(3)])
            self.decoder = nn.Sequential(Block(), Block())
            self.head = nn.Linear(8, 2)

    assert _names(Net()) == ["encoder.0", "encoder.1", "encoder.2", "decoder.0", "decoder.1"]


def test_frozen_entries_are_not_blocks():
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    seq[0].requires_grad_(False)
    seq[1].requires_grad_(False)
    assert _names(seq) == []


def test_explicit_patterns_that_match_nothing_still_raise():
    with pytest.raises(ValueError, match=r"matched no module; some module names"):
        select_layers(nn.Sequential(nn.Linear(2, 2)), ["blocks.*"])


def test_transformers_models_select_their_decoder_layers():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    assert _names(llama) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    assert _names(gpt2) == ["transformer.h.0", "transformer.h.1"]


# ------------------------------------------------------------------------------------------------ training
class LinearModule(LightningModule):
    """A single ``nn.Linear`` (Lightning's BoringModel shape)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(32, 2)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SequentialModule(LinearModule):
    """Blocks inside an ``nn.Sequential``, a ``Linear`` head."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 8), Block(), Block(), Block(), nn.Linear(8, 2))


def _fit(module_type, strategy, steps=8):
    seed_everything(3)
    model = module_type()
    data = DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=4)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    return model, trainer, [str(w.message) for w in caught if "cg_lightning" in str(w.message)]


def _assert_equal_weights(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_model_without_stacks_trains_ungraphed_with_one_warning():
    ref, _, _ = _fit(LinearModule, "ddp")
    got, trainer, messages = _fit(LinearModule, "cudagraph_ddp")
    assert len(messages) == 1 and "graphs.layers" in messages[0] and "'layer'" in messages[0], messages
    assert trainer.strategy.last_graph_stats is None  # no graph manager at all
    _assert_equal_weights(got, ref)


def test_sequential_blocks_are_graphed_by_default():
    ref, _, _ = _fit(SequentialModule, "ddp")
    got, trainer, messages = _fit(SequentialModule, "cudagraph_ddp")
    assert messages == []
    stats = trainer.strategy.last_graph_stats
    assert stats is not None and stats.captured_runners == 3, stats  # layer.1, layer.2, layer.3
    _assert_equal_weights(got, ref)
