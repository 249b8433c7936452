"""``transformers`` models with the library's own features on, under the strategy against Lightning's ``"ddp"``.

Each test trains a random tiny model from :mod:`tests.hf_models` twice with the same seed and batches: weights
must be equal bit for bit, and the layers must really be graphed (captured calls counted). CI runs this file on
the lowest ``transformers`` the package supports and on the newest.
"""

from __future__ import annotations

import warnings

import pytest

from tests.helpers import cg_strategy
from tests.hf_models import assert_same_weights, fit_hf, tiny_llama, transformers  # noqa: F401


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
