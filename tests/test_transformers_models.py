"""``transformers`` models with the library's own features on, under the strategy against Lightning's ``"ddp"``.

Each test trains a random tiny model from :mod:`tests.hf_models` twice with the same seed and batches: weights
must be equal bit for bit, and the layers must really be graphed (captured calls counted). CI runs this file on
the lowest ``transformers`` the package supports and on the newest.
"""

from __future__ import annotations

import warnings

import pytest

from cg_lightning import GraphCaptureError
from tests.helpers import cg_strategy
from tests.hf_models import assert_same_weights, fit_hf, tiny_llama, tiny_qwen2_moe, transformers  # noqa: F401


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_of_transformers_layers_is_graphed(use_reentrant):
    """``gradient_checkpointing_enable``: every decoder layer graphed (the checkpoint moves inside the layer's
    forward where the library wraps ``__call__``), nothing said about an empty capture, weights equal."""

    def prepare(model):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})

    ref, _ = fit_hf("ddp", tiny_llama, prepare=prepare)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, trainer = fit_hf(cg_strategy("eager"), tiny_llama, prepare=prepare)
    assert not [w for w in caught if "nothing is graphed" in str(w.message)]
    stats = trainer.strategy.last_graph_stats
    assert stats.captured_runners == 3 and stats.forward_replays > 0, stats
    assert_same_weights(got, ref)
    layer = got.model.model.layers[0]
    assert layer.gradient_checkpointing  # the user's setting is kept, and the layer's own function given back
    assert "PassThrough" not in type(layer.__dict__.get("_gradient_checkpointing_func")).__name__


def moe_eager_experts():
    """:func:`tiny_qwen2_moe` with the loop over experts (``one_hot``, ``nonzero``, ``where``: host syncs) and no
    cache object per step (``use_cache`` would make every call a new signature); router auxiliary loss off."""
    return tiny_qwen2_moe(experts_implementation="eager", use_cache=False)


def test_moe_decoder_layers_split_attention_and_norms_graphed_experts_eager():
    """``on_capture_error="split"``: each decoder layer fails whole (the experts' host sync), is split, its MoE block
    fails and is split too; attention, norms, router and shared expert are graphed, the experts run eagerly.
    Steps 0, 1 warm up, 2 and 3 record again after each split, 4 captures; weights equal ``"ddp"``'s bit for bit."""
    ref, _ = fit_hf("ddp", moe_eager_experts, steps=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, trainer = fit_hf(cg_strategy("eager", on_capture_error="split"), moe_eager_experts, steps=7)
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
        fit_hf(cg_strategy("eager"), moe_eager_experts, steps=3)
