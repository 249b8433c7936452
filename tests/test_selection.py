"""Default layer selection (``graphs/selection.py``) and training of models it finds nothing in.

Selection is checked on hand-written stacks (a torchvision-shaped ResNet among them) and on ``transformers``
models (random tiny configs, no downloads) by exact name lists; training on Lightning-style models (one
``nn.Linear``; blocks in an ``nn.Sequential``; the ResNet) under ``strategy="cudagraph_ddp"`` against Lightning's
``"ddp"``, same seed and data: weights and buffers equal bit for bit.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

import cg_lightning  # noqa: F401  (registers the strategy name)
from cg_lightning import CUDAGraphDDPStrategy
from cg_lightning.graphs.selection import default_layers, eager_modules, select_layers
from tests.helpers import cg_strategy, make_trainer


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


class Other(Block):
    """A second layer class (a hybrid stack's other kind of layer)."""


class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 8)

    def forward(self, x):
        return self.proj(x)


def test_module_list_takes_every_own_layer_class_but_not_lone_builtins():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block(), Block(), Other(), nn.LayerNorm(8), nn.Linear(8, 8)])

    assert _names(Net()) == ["layers.0", "layers.1", "layers.2", "layers.3"]


def test_sequential_takes_only_its_most_frequent_class():
    class Mid(Stem):
        pass

    seq = nn.Sequential(Stem(), Block(), Block(), Mid(), nn.Linear(8, 2))
    assert _names(seq) == ["1", "2"]  # a pipeline: the stem, the odd step and the head stay eager


def test_eager_modules_name_what_holds_parameters_outside_the_graphs():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Parameter(torch.zeros(8))
            self.stem = Stem()
            self.blocks = nn.ModuleList([Block(), Block()])
            self.act = nn.Tanh()
            self.frozen = nn.Linear(8, 8).requires_grad_(False)
            self.head = nn.Linear(8, 2)
            self.tied = nn.Linear(8, 2)
            self.tied.weight = self.head.weight
            self.again = self.head  # one module under two names: named once

    net = Net()
    assert eager_modules(net, _names(net)) == ["pos", "stem", "head", "tied"]
    assert eager_modules(net, ["blocks.1"]) == ["pos", "stem", "blocks.0", "head", "tied"]


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


def test_transformers_encoder_decoder_and_two_towers_select_every_stack():
    transformers = pytest.importorskip("transformers")
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4))
    assert _names(t5) == ["encoder.block.0", "encoder.block.1",
                          "decoder.block.0", "decoder.block.1", "decoder.block.2"]
    assert eager_modules(t5, _names(t5)) == ["shared", "encoder.embed_tokens", "encoder.final_layer_norm",
                                             "decoder.embed_tokens", "decoder.final_layer_norm", "lm_head"]
    clip = transformers.CLIPModel(transformers.CLIPConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                           image_size=16, patch_size=8),
        projection_dim=16))
    assert _names(clip) == ["text_model.encoder.layers.0", "text_model.encoder.layers.1",
                            "vision_model.encoder.layers.0", "vision_model.encoder.layers.1",
                            "vision_model.encoder.layers.2"]


def test_hybrid_stack_of_two_layer_classes_is_selected_whole():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "JambaConfig"):
        pytest.skip("transformers without Jamba")
    # Jamba's own layout: one attention layer in eight (attn_layer_period 8, offset 4), the rest Mamba
    jamba = transformers.JambaForCausalLM(transformers.JambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, mamba_d_state=4, mamba_d_conv=2,
        mamba_expand=2, mamba_dt_rank=4))
    kinds = [type(layer).__name__ for layer in jamba.model.layers]
    assert kinds[4] == "JambaAttentionDecoderLayer" and kinds.count("JambaMambaDecoderLayer") == 7
    assert _names(jamba) == [f"model.layers.{i}" for i in range(8)]
    assert eager_modules(jamba, _names(jamba)) == ["model.embed_tokens", "model.final_layernorm", "lm_head"]


class BasicBlock(nn.Module):
    """torchvision's ResNet ``BasicBlock``: two 3x3 convolutions with batch norm, a 1x1 ``downsample``
    (``nn.Sequential`` of a convolution and a batch norm) where the shape changes."""

    def __init__(self, c_in, c_out, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    """torchvision's ResNet layout at toy width: stem (``conv1``, ``bn1``, ``relu``, ``maxpool``), stages
    ``layer1``..``layer4`` (``nn.Sequential`` of :class:`BasicBlock`), ``avgpool``, ``fc``."""

    def __init__(self, blocks=(2, 2, 2, 2), widths=(4, 8, 8, 16), classes=5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        c_in = widths[0]
        for i, (n, width) in enumerate(zip(blocks, widths)):
            stage = [BasicBlock(c_in, width, 1 if i == 0 else 2)] + [BasicBlock(width, width) for _ in range(n - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
            c_in = width
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def test_resnet_stages_select_their_blocks():
    resnet = ResNet(blocks=(2, 3, 2, 2))
    assert _names(resnet) == ["layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer2.2",
                              "layer3.0", "layer3.1", "layer4.0", "layer4.1"]
    assert eager_modules(resnet, _names(resnet)) == ["conv1", "bn1", "fc"]


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
    """Per-layer graphs (``graphs.whole_step: false``) have nothing to graph: one warning; by default the whole
    step is graphed instead, without a warning."""
    ref, _, _ = _fit(LinearModule, "ddp")
    got, trainer, messages = _fit(LinearModule, CUDAGraphDDPStrategy(graphs={"whole_step": False}))
    assert len(messages) == 1 and "graphs.layers" in messages[0] and "'layer'" in messages[0], messages
    assert trainer.strategy.last_graph_stats is None  # no graph manager at all
    _assert_equal_weights(got, ref)
    got, trainer, messages = _fit(LinearModule, "cudagraph_ddp")
    assert messages == [] and trainer.strategy.last_step_graph_stats.replays > 0
    _assert_equal_weights(got, ref)


def test_sequential_blocks_are_graphed_by_default():
    ref, _, _ = _fit(SequentialModule, "ddp")
    got, trainer, messages = _fit(SequentialModule, CUDAGraphDDPStrategy(graphs={"whole_step": False}))
    assert messages == []
    stats = trainer.strategy.last_graph_stats
    assert stats is not None and stats.captured_runners == 3, stats  # layer.1, layer.2, layer.3
    _assert_equal_weights(got, ref)


class ResNetModule(LightningModule):
    """:class:`ResNet` on random 16x16 images, cross-entropy, SGD with momentum."""

    def __init__(self):
        super().__init__()
        self.net = ResNet()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _fit_resnet(strategy, steps=6):
    seed_everything(5)
    model = ResNetModule()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4 * steps, 3, 16, 16, generator=g), torch.randint(0, 5, (4 * steps,), generator=g))
    trainer = make_trainer(strategy, steps)
    trainer.fit(model, DataLoader(data, batch_size=4))
    return model, trainer


def test_resnet_blocks_are_graphed_by_default_and_train_as_ddp():
    """The stages' 8 blocks graphed (batch norm statistics updated inside them); every weight and buffer
    (running statistics, batch counts) equal to ``"ddp"`` bit for bit."""
    ref, _ = _fit_resnet("ddp")
    got, trainer = _fit_resnet(cg_strategy("eager", whole_step=False))
    stats = trainer.strategy.last_graph_stats
    assert stats.captured_runners == 8 and stats.failed_layers == [] and stats.forward_replays > 0, stats
    for (name, a), b in zip(got.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name


class T5Module(LightningModule):
    def __init__(self):
        super().__init__()
        import transformers

        self.net = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.net(input_ids=x, labels=y, use_cache=False).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_t5_blocks_train_as_ddp():
    """Encoder and decoder blocks graphed by default, weights equal to "ddp" bit for bit."""
    pytest.importorskip("transformers")

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, 64, (24, 8), generator=g), torch.randint(0, 64, (24, 6), generator=g))
    models, trainers = [], []
    for strategy in ("ddp", cg_strategy("eager", whole_step=False)):
        seed_everything(5)
        models.append(T5Module())
        trainers.append(make_trainer(strategy, 6))
        trainers[-1].fit(models[-1], DataLoader(data, batch_size=4))
    stats = trainers[1].strategy.last_graph_stats
    assert stats.captured_runners == 4 and stats.failed_layers == [] and stats.forward_replays > 0, stats
    _assert_equal_weights(*models)
