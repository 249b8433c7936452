"""``graphs.compile`` and layers the user compiled: the compiled code is what warms up, is captured and replays.

On a CPU the eager graph backend runs a "replay" by calling the captured body again, so the compiled function
runs there too; dynamo's ``aot_eager`` backend (AOTAutograd, no code generation) stands in for Inductor, which
needs a C compiler here. The reference is the same layers compiled the same way under Lightning's ``"ddp"``:
compiling changes the operations (AOTAutograd's decompositions), so plain eager is not the reference. The GPU
test with Inductor's kernels and real graphs is ``tests/test_cuda_models.py``.
"""

from __future__ import annotations

import pytest
import torch

from cg_lightning.graphs import GraphOptions
from tests.helpers import cg_strategy
from tests.hf_models import assert_same_weights, fit_hf, tiny_llama
from tests.lightning_runs import train

pytest.importorskip("transformers")


def _compile_layers(backend):
    """``prepare`` of :class:`~tests.hf_models.HFModule`: every decoder layer's forward compiled by the user."""

    def prepare(model):
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward, backend=backend, dynamic=False)

    return prepare


class CountingBackend:
    """A ``torch.compile`` backend that runs the traced graph as it is and counts its calls."""

    def __init__(self) -> None:
        self.compiled = 0
        self.calls = 0

    def __call__(self, gm, example_inputs):
        self.compiled += 1

        def run(*args):
            self.calls += 1
            return gm.forward(*args)

        return run


def test_graphs_compile_trains_like_the_same_compiled_layers_under_ddp():
    torch._dynamo.reset()
    ref, _ = fit_hf("ddp", tiny_llama, steps=5, prepare=_compile_layers("aot_eager"))
    torch._dynamo.reset()
    got, trainer = fit_hf(cg_strategy(compile=True, compile_backend="aot_eager", whole_step=False), tiny_llama, steps=5)
    stats = trainer.strategy.last_graph_stats
    assert stats.captured_runners == 3 and stats.fallback_calls == 0
    assert stats.compile_seconds > 0
    assert_same_weights(got.model, ref.model)
    for layer in got.model.model.layers:  # the layers' own forward back after training
        assert "forward" not in layer.__dict__


def test_a_forward_the_user_compiled_is_captured_and_given_back():
    torch._dynamo.reset()
    backend = CountingBackend()
    compiled = {}

    def prepare(model):
        for i, layer in enumerate(model.model.layers):
            layer.forward = compiled[i] = torch.compile(layer.forward, backend=backend, dynamic=False)

    _, trainer = fit_hf(cg_strategy(compile=True, whole_step=False), tiny_llama, steps=5, prepare=prepare)
    stats = trainer.strategy.last_graph_stats
    assert stats.captured_runners == 3 and stats.forward_replays > 0
    # graphs.compile kept the user's compiled forward (no second torch.compile around it): the user's backend
    # traced the layer and its graph ran in the warmup steps, the capture and the replays
    assert backend.compiled >= 1
    steps_with_layer_calls = 5 * 3
    assert backend.calls >= steps_with_layer_calls
    module = trainer.lightning_module
    for i, layer in enumerate(module.model.model.layers):
        assert layer.forward is compiled[i], "the user's compiled forward was not put back"


@pytest.mark.parametrize("whole_step", [False, None])
def test_user_compiled_blocks_of_a_lightning_model_train_like_ddp(whole_step):
    """Lightning's own kind of model: blocks in an ``nn.ModuleList``, each compiled by the user. They get per-layer
    graphs of their compiled forwards, also with the defaults (``whole_step`` unset), which refuse the whole step
    for them: unlike a model compiled whole, no compiled code runs the graphed layers."""
    from tests.lightning_models import ParityModel

    def model():
        m = ParityModel(optimizer="adam")
        for block in m.body.blocks:
            block.forward = torch.compile(block.forward, backend="aot_eager", dynamic=False)
        return m

    torch._dynamo.reset()
    ref = train("ddp", model, max_steps=6)
    torch._dynamo.reset()
    got = train(cg_strategy(whole_step=whole_step), model, max_steps=6)
    assert got.trainer.strategy.last_graph_stats.captured_runners == 3
    for (name, p), q in zip(got.model.named_parameters(), ref.model.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_compile_modes_with_cuda_graphs_of_their_own_are_refused(mode):
    with pytest.raises(ValueError, match=r"graphs\.compile_mode.*" + mode):
        GraphOptions(compile=True, compile_mode=mode)


def test_the_whole_model_as_one_graphed_layer_splits_where_it_must_and_trains_like_ddp():
    """``graphs.layers=["model"]`` with ``on_capture_error="split"``: the whole causal-LM forward as one graphed
    call where the model permits. transformers' mask code reads a tensor on the host when it is not traced, so
    eagerly the model is split down to its embeddings, decoder layers, norm and head; compiled, dynamo traces
    that check away and the whole forward, the loss included, is one graph."""
    ref, _ = fit_hf("ddp", tiny_llama, steps=5)
    got, trainer = fit_hf(cg_strategy(layers=["model"], on_capture_error="split", whole_step=False), tiny_llama, steps=5)
    stats = trainer.strategy.last_graph_stats
    assert "model" in stats.split_layers and "model.model" in stats.split_layers, stats
    assert {"model.lm_head", "model.model.embed_tokens", "model.model.norm"} <= set(stats.graphed_parts), stats
    assert stats.fallback_calls == 0
    assert_same_weights(got.model, ref.model)

    torch._dynamo.reset()

    def compile_model(model):
        model.forward = torch.compile(model.forward, backend="aot_eager", dynamic=False)

    ref, _ = fit_hf("ddp", tiny_llama, steps=5, prepare=compile_model)
    torch._dynamo.reset()
    got, trainer = fit_hf(cg_strategy(layers=["model"], on_capture_error="split", compile=True, whole_step=False,
                                      compile_backend="aot_eager"), tiny_llama, steps=5)
    stats = trainer.strategy.last_graph_stats
    assert stats.captured_runners == 1 and stats.split_layers == [] and stats.fallback_calls == 0, stats
    assert_same_weights(got.model, ref.model)
