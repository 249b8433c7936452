"""``transformers`` models trained under ``strategy="cudagraph_ddp"`` against Lightning's ``"ddp"``, same seed
and data (random tiny configs, no downloads; eager graph backend on CPU).

T5's encoder blocks return ``(hidden_states, position_bias, None)``: the ``None`` (no cross-attention bias in an
encoder) is kept from the capture and put back around the replayed tensors (``cg_lightning/graphs/outputs.py``);
so are the fields a layer's ``ModelOutput`` leaves at ``None`` (engine level, against plain PyTorch). The
library's activation checkpointing and its output-capturing hooks (``output_hidden_states``,
``output_attentions``, ``output_router_logits``) train under the strategy too, and so does a mixture-of-experts
model under ``graphs.on_capture_error="split"`` (its layers' parts graphed, the experts eager). Decoder layers,
called with the hidden states and the same mask, positions and flags each, form one segment. CI runs this file on
the lowest ``transformers`` the package supports and on the newest.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from cg_lightning import GraphCaptureError
from tests.engine_models import assert_grads_equal, batches, graphed_engine
from tests.helpers import WARMUP, cg_strategy, make_trainer, state_rel_diff
from tests.hf_models import HFModule, assert_same_weights, fit_hf, tiny_gpt2, tiny_llama, tiny_mixtral, tiny_qwen2_moe
from tests.recorders import LifecycleRecorder

transformers = pytest.importorskip("transformers")

ENCODER_BLOCKS = "model.encoder.block.*"
DECODER_BLOCKS = "model.decoder.block.*"


class T5Module(LightningModule):
    """A random ``T5ForConditionalGeneration`` (d_model 32, d_ff 64, 2 layers, 2 heads, vocabulary 64), AdamW,
    the model's own label loss; ``validation_step`` logs ``val_loss``."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                                       decoder_start_token_id=0, pad_token_id=0, use_cache=False)
        self.model = transformers.T5ForConditionalGeneration(config)

    def training_step(self, batch, batch_idx):
        source, target = batch
        return self.model(input_ids=source, labels=target).loss

    def validation_step(self, batch, batch_idx):
        source, target = batch
        self.log("val_loss", self.model(input_ids=source, labels=target).loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _loader(seed: int) -> DataLoader:
    """12 batches of 4 (source of 10 tokens, target of 7), tokens 1..63."""
    g = torch.Generator().manual_seed(seed)
    data = TensorDataset(torch.randint(1, 64, (48, 10), generator=g), torch.randint(1, 64, (48, 7), generator=g))
    return DataLoader(data, batch_size=4)


def _fit_t5(strategy, steps: int, validation: bool = True):
    """Seed, build :class:`T5Module` and fit it; with ``validation`` every 4 steps on 2 batches, after a 2-batch
    sanity check. Returns (module, trainer, lifecycle recorder)."""
    seed_everything(3)
    module = T5Module()
    life = LifecycleRecorder()
    every = dict(val_check_interval=4, limit_val_batches=2, num_sanity_val_steps=2) if validation else {}
    trainer = make_trainer(strategy, steps, [life], validation=validation, **every)
    trainer.fit(module, train_dataloaders=_loader(0), val_dataloaders=_loader(1))
    return module, trainer, life


def _assert_equal_weights(model, ref) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


def test_t5_encoder_blocks_returning_none_train_and_validate_like_ddp():
    """The encoder blocks, which return ``(hidden_states, position_bias, None)`` (block 0 computes the bias, block
    1 is handed it and passes it on), are captured and replayed in training and (``capture_eval``) validation: 9
    steps, validation at steps 4 and 8 and in the sanity check: weights and validation losses equal "ddp" bit for
    bit."""
    steps = 9
    ref, _, ref_life = _fit_t5("ddp", steps)
    model, trainer, life = _fit_t5(cg_strategy("eager", whole_step=False, layers=[ENCODER_BLOCKS], capture_eval=True), steps)
    stats = trainer.strategy.last_graph_stats
    assert stats.captured_runners == 2 and stats.failed_layers == [] and stats.fallback_calls == 0
    assert stats.forward_replays == 2 * (steps - WARMUP)
    val_batches = sum(run[1] for run in life.val_runs)
    assert val_batches == 6 and len(life.val_losses) == 3
    assert stats.eval_graphs == 2 and stats.eval_replays == 2 * (val_batches - 1)  # the first eval call is eager
    _assert_equal_weights(model, ref)
    assert life.val_losses == ref_life.val_losses


def test_t5_all_blocks_train_like_ddp():
    """Encoder and decoder blocks graphed, 8 steps: captured and replayed, weights equal to "ddp" bit for bit.
    The encoder output feeds the cross-attention key and value projections of both decoder blocks: each decoder
    block's capture hands the gradient pieces of that input back one by one, so that autograd adds the four in
    eager order (:mod:`cg_lightning.graphs.replay.input_pieces`)."""
    steps = 8
    ref, _, _ = _fit_t5("ddp", steps, validation=False)
    model, trainer, _ = _fit_t5(cg_strategy("eager", whole_step=False, layers=[ENCODER_BLOCKS, DECODER_BLOCKS]), steps,
                                validation=False)
    stats = trainer.strategy.last_graph_stats
    assert stats.captured_runners == 4 and stats.failed_layers == [] and stats.fallback_calls == 0
    assert stats.forward_replays == 4 * (steps - WARMUP)
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name


class _HiddenStateInLoss(HFModule):
    """The loss also takes an intermediate hidden state (the first layer's output)."""

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        out = self.model(input_ids=ids, labels=ids, output_hidden_states=True)
        return out.loss + 0.1 * out.hidden_states[1].pow(2).mean()


def test_an_intermediate_hidden_state_in_the_loss_stays_exact(monkeypatch):
    """The second layer's input is also used by the loss: its capture hands the input's gradient pieces back
    one by one, and autograd adds the loss's in eager order: weights equal to "ddp" bit for bit."""
    import tests.hf_models as hf

    monkeypatch.setattr(hf, "HFModule", _HiddenStateInLoss)
    ref, _ = fit_hf("ddp", tiny_llama, steps=8)
    got, stats, messages = _fit_cg(tiny_llama, steps=8)
    assert stats.captured_runners == 3 and stats.forward_replays == 3 * (8 - WARMUP), stats
    assert_same_weights(got, ref)


class _ModelOutputLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return transformers.modeling_outputs.BaseModelOutput(last_hidden_state=x + torch.tanh(self.fc(x)),
                                                             hidden_states=None, attentions=None)


class _ModelOutputStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_ModelOutputLayer() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            out = layer(x)
            assert type(out) is transformers.modeling_outputs.BaseModelOutput and out.attentions is None
            x = out.last_hidden_state
        return x.pow(2).mean()


def test_layers_returning_a_model_output_with_none_fields_are_graphed():
    """Layers returning a ``BaseModelOutput`` whose ``hidden_states`` and ``attentions`` are ``None``: replays
    return the same class with the same fields (the model checks them), and ``main_grad`` equals plain
    PyTorch's ``.grad`` bit for bit at every step (no updates: the same weights every step, new data)."""
    torch.manual_seed(0)
    plain = _ModelOutputStack()
    ref = []
    for x in batches(4, 16):
        plain.zero_grad(set_to_none=True)
        plain(x).backward()
        ref.append({k: p.grad.clone() for k, p in plain.named_parameters()})
    torch.manual_seed(0)
    model = _ModelOutputStack()
    manager, engine = graphed_engine(model, layers=["layers.*"])
    got = []
    for step, x in enumerate(batches(4, 16)):
        manager.begin_step(step)
        engine(x).backward()
        manager.end_step()
        engine.finish_grad_sync()
        got.append({k: p.main_grad.clone() for k, p in model.named_parameters()})
        engine.zero_grad_buffer()
    assert manager.stats.captured_runners == 2 and manager.stats.forward_replays == 2 * 3
    assert_grads_equal(got, ref, tol=0)


def _fit_cg(build, callbacks=(), graphs=None, **module_kwargs):
    """:func:`fit_hf` under the strategy with per-layer graphs; returns (module, graph stats, cg_lightning warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, trainer = fit_hf(cg_strategy("eager", whole_step=False, **(graphs or {})), build, callbacks=callbacks,
                              **module_kwargs)
    return got, trainer.strategy.last_graph_stats, [str(w.message) for w in caught if "cg_lightning" in str(w.message)]


class _SegmentMembers(Callback):
    """At the end of training: per captured segment, the number of layer calls replayed through its one node."""

    def __init__(self) -> None:
        self.members = None

    def on_train_end(self, trainer, pl_module) -> None:
        runners = trainer.strategy.graph_manager.all_runners()
        segments = {id(r.segment): r.segment for r in runners if r.segment is not None}
        self.members = [len(s.node_runners or ()) for s in segments.values()]


@pytest.mark.parametrize("build,layers", [(tiny_llama, 3), (tiny_gpt2, 2)], ids=["llama", "gpt2"])
def test_decoder_layers_called_with_the_same_mask_and_positions_form_one_segment(build, layers):
    """The decoder layers are called with the hidden states and keyword arguments that are the same for every layer
    of a forward (Llama: ``attention_mask``, ``position_embeddings=(cos, sin)``, ``position_ids``, ``use_cache``;
    GPT-2: ``None`` positionals, ``position_ids``, flags): all of them form one segment replayed through one node
    (``graphs.segments``, :mod:`cg_lightning.graphs.segments.context`); weights equal ``"ddp"``'s bit for bit."""
    ref, _ = fit_hf("ddp", build)
    members = _SegmentMembers()
    got, stats, messages = _fit_cg(build, callbacks=[members])
    assert messages == [], messages
    assert stats.segments == 1 and members.members == [layers], (stats, members.members)
    assert stats.captured_runners == layers and stats.forward_replays == layers * (6 - WARMUP), stats
    assert stats.fallback_calls == 0, stats
    assert_same_weights(got, ref)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_of_transformers_layers_is_graphed(use_reentrant):
    """``gradient_checkpointing_enable``: every decoder layer graphed (the checkpoint moves inside the layer's
    forward where the library wraps ``__call__``), nothing said about an empty capture, weights equal."""

    def prepare(model):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})

    ref, _ = fit_hf("ddp", tiny_llama, prepare=prepare)
    got, stats, messages = _fit_cg(tiny_llama, prepare=prepare)
    assert not [m for m in messages if "nothing is graphed" in m], messages
    assert stats.captured_runners == 3 and stats.forward_replays > 0, stats
    assert_same_weights(got, ref)
    layer = got.model.model.layers[0]
    assert layer.gradient_checkpointing  # the user's setting is kept, and the layer's own function given back
    assert "PassThrough" not in type(layer.__dict__.get("_gradient_checkpointing_func")).__name__


def test_hidden_states_output_keeps_layers_graphed():
    """``output_hidden_states=True`` installs the library's output hooks (on the layers, and inert ones on their
    attention): graphed, every step after warmup replayed, weights equal."""
    kwargs = dict(forward_kwargs=dict(output_hidden_states=True))
    ref, _ = fit_hf("ddp", tiny_llama, **kwargs)
    got, stats, messages = _fit_cg(tiny_llama, **kwargs)
    assert messages == [], messages
    assert stats.captured_runners == 3 and stats.forward_replays == 3 * (6 - WARMUP), stats
    assert_same_weights(got, ref)


def test_the_cache_is_turned_off_for_training_with_one_warning():
    """The library's default ``use_cache=True`` would hand the layers a new cache object at every forward: the
    strategy sets it to ``False`` (one warning) and the layers are graphed, weights equal to ``"ddp"`` on the
    model without the cache."""
    ref, _ = fit_hf("ddp", tiny_llama)
    got, stats, messages = _fit_cg(lambda: tiny_llama(use_cache=True))
    assert len(messages) == 1 and "set config.use_cache=False on model" in messages[0], messages
    assert got.model.config.use_cache is False
    assert stats.captured_runners == 3 and stats.forward_replays == 3 * (6 - WARMUP), stats
    assert_same_weights(got, ref)


def test_a_new_cache_object_every_step_is_said_not_silently_eager():
    """``use_cache=True`` passed to every training forward: nothing can match the warmup record, and one warning
    says so and what to do."""
    kwargs = dict(forward_kwargs=dict(use_cache=True))
    ref, _ = fit_hf("ddp", tiny_llama, **kwargs)
    got, stats, messages = _fit_cg(tiny_llama, **kwargs)
    said = [m for m in messages if "nothing is graphed" in m]
    assert len(said) == 1 and "use_cache=False" in said[0] and "cache" in said[0], messages
    assert stats.captured_runners == 0
    assert_same_weights(got, ref)


@pytest.mark.parametrize("case", ["attentions", "router_logits"])
def test_outputs_collected_inside_layers_run_those_steps_eagerly(case):
    """``output_attentions`` (hooks on the layers' attention) and ``output_router_logits`` (on an MoE layer's
    gate, whose auxiliary loss joins the loss), under ``on_capture_error="raise"``: the steps that ask for them run
    the layers eagerly, one warning, weights equal (unset, such layers are split: the next test)."""
    if case == "attentions":
        build, forward = (lambda: tiny_llama(attn_implementation="eager")), dict(output_attentions=True)
    else:
        build, forward = tiny_qwen2_moe, dict(output_router_logits=True)
    kwargs = dict(forward_kwargs=forward)
    ref, _ = fit_hf("ddp", build, **kwargs)
    got, stats, messages = _fit_cg(build, graphs={"on_capture_error": "raise"}, **kwargs)
    said = [m for m in messages if "collect outputs from inside the graphed layers" in m]
    assert len(said) == 1, messages
    assert stats.forward_replays == 0 and stats.fallback_calls > 0, stats
    assert_same_weights(got, ref)


def moe_eager_experts():
    """:func:`tiny_qwen2_moe` (no cache, router auxiliary loss off) with the loop over experts (``one_hot``,
    ``nonzero``, ``where``: host syncs)."""
    return tiny_qwen2_moe(experts_implementation="eager")


def test_moe_decoder_layers_split_attention_and_norms_graphed_experts_eager():
    """``on_capture_error="split"``: each decoder layer fails whole (the experts' host sync), is split, its MoE block
    fails and is split too; attention, norms, router and shared expert are graphed, the experts run eagerly.
    Steps 0, 1 warm up, 2 and 3 record again after each split, 4 captures; weights equal ``"ddp"``'s bit for bit."""
    ref, _ = fit_hf("ddp", moe_eager_experts, steps=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, trainer = fit_hf(cg_strategy("eager", on_capture_error="split", whole_step=False), moe_eager_experts, steps=7)
    assert_same_weights(got, ref)
    stats = trainer.strategy.last_graph_stats
    layers = ["model.model.layers.0", "model.model.layers.1"]
    parts = ["self_attn", "mlp.gate", "mlp.shared_expert", "mlp.shared_expert_gate", "input_layernorm",
             "post_attention_layernorm"]
    assert stats.graphed_parts == [f"{layer}.{part}" for layer in layers for part in parts]
    assert stats.captured_runners == len(stats.graphed_parts) and stats.forward_replays == 3 * 12  # steps 4-6
    assert stats.failed_layers == [f"{layer}.mlp.experts" for layer in layers]
    assert stats.split_layers == layers + [f"{layer}.mlp" for layer in layers]
    messages = [str(w.message) for w in caught if "could not be captured whole" in str(w.message)]
    assert len(messages) == 1 and "layers 'model.model.layers.0', 'model.model.layers.1'" in messages[0], messages
    assert "modeling_qwen2_moe.py" in messages[0] and "Eager: mlp.experts (host synchronization" in messages[0]


def test_moe_decoder_layer_under_raise_names_the_library_line_and_suggests_split():
    with pytest.raises(GraphCaptureError, match=r"(?s)'model\.model\.layers\.0'.*host synchronization.*"
                                                r"modeling_qwen2_moe\.py.*on_capture_error='split'"):
        fit_hf(cg_strategy("eager", whole_step=False, on_capture_error="raise"), moe_eager_experts, steps=3)


@pytest.mark.parametrize("case", ["attentions", "router_logits"])
def test_outputs_collected_inside_layers_under_split_graph_the_parts(case):
    """Under ``on_capture_error="split"`` a layer holding a submodule whose output the step collects is split:
    the hooked submodule (the attention, an MoE layer's router gate) becomes a graphed part whose own hook runs
    around its replay; the attention weights and the router's auxiliary loss come from replays, weights equal."""
    if case == "attentions":
        build, forward = (lambda: tiny_llama(attn_implementation="eager")), dict(output_attentions=True)
        hooked = "model.model.layers.0.self_attn"
    else:
        build, forward = (lambda: tiny_qwen2_moe(experts_implementation="eager")), dict(output_router_logits=True)
        hooked = "model.model.layers.0.mlp.gate"
    ref, _ = fit_hf("ddp", build, steps=8, forward_kwargs=forward)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got, trainer = fit_hf(cg_strategy("eager", on_capture_error="split", whole_step=False), build, steps=8, forward_kwargs=forward)
    stats = trainer.strategy.last_graph_stats
    assert "model.model.layers.0" in stats.split_layers and hooked in stats.graphed_parts, stats
    assert stats.forward_replays > 0 and stats.fallback_calls == 0, stats
    assert_same_weights(got, ref)


@pytest.mark.parametrize("build, split", [(tiny_mixtral, True), (tiny_qwen2_moe, False)],
                         ids=["mixtral-router-loss", "qwen2-moe"])
def test_moe_models_with_per_layer_graphs_and_no_capture_error_option_train_like_ddp(build, split):
    """Mixtral trained with its router's auxiliary loss and Qwen2-MoE with its default (``grouped_mm``) experts,
    per-layer graphs, ``on_capture_error`` unset: Mixtral's decoder layers hold the router whose logits the step
    collects, so they are split (unset splits the layers chosen by default) and attention, norms and router are
    graphed; Qwen2-MoE's layers capture whole on a CPU (on a GPU the experts' copy from host memory makes them
    split too: tests/test_cuda_models.py). Weights equal to "ddp" bit for bit."""
    ref, _ = fit_hf("ddp", build, steps=9)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got, trainer = fit_hf(cg_strategy("eager", whole_step=False), build, steps=9)
    stats = trainer.strategy.last_graph_stats
    assert stats.forward_replays > 0 and stats.fallback_calls == 0, stats
    if split:
        assert "model.model.layers.0" in stats.split_layers, stats
        for part in ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp.gate"):
            assert f"model.model.layers.0.{part}" in stats.graphed_parts, (part, stats.graphed_parts)
    else:
        assert stats.split_layers == [] and stats.captured_runners == 2, stats
    assert_same_weights(got, ref)


@pytest.mark.parametrize("build", [tiny_mixtral, tiny_qwen2_moe], ids=["mixtral-router-loss", "qwen2-moe"])
def test_moe_models_with_no_options_replay_the_whole_step_like_ddp(build):
    ref, _ = fit_hf("ddp", build, steps=8)
    got, trainer = fit_hf(cg_strategy("eager"), build, steps=8)
    stats = trainer.strategy.last_step_graph_stats
    assert stats.captures == 1 and stats.replays == 8 - 3 and stats.refusal is None, stats
    assert_same_weights(got, ref)
