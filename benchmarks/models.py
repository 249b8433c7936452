"""The models every peer trains: the example GPT, and a Llama from ``transformers`` (random weights, no download).

Both map token ids ``(B, T)`` (int64) to logits ``(B, T, vocab)``, so the loss, data and timing of every peer are
the same for either. The Llama of a size has the GPT's width, depth, heads and sequence length, a SwiGLU MLP of
about ``8/3 d`` (rounded up to a multiple of 64), RMSNorm, rotary positions, untied head, SDPA attention, no KV
cache, and Llama's 32000-token vocabulary.

:data:`LAYERS` names, per model, the module patterns (``graphs.layers``) of the strategy's variants: the blocks
(its default), the blocks with the final norm and head, the glue too, and the whole model as one graph.
"""

from __future__ import annotations

from typing import Dict, List

from torch import Tensor, nn

MODELS = ("gpt", "llama")
#: Llama's vocabulary; the GPT keeps GPT-2's rounded one (``common.VOCAB_SIZE``)
LLAMA_VOCAB_SIZE = 32000

#: graphs.layers of the strategy's variants, per model (module names inside the LightningModule: ``model.*``)
LAYERS: Dict[str, Dict[str, List[str]]] = {
    "gpt": {
        "head": ["model.blocks.*", "model.ln_f", "model.lm_head"],
        "glue": ["model.tok_emb", "model.pos_emb", "model.blocks.*", "model.ln_f", "model.lm_head"],
        "whole": ["model"],
    },
    "llama": {
        "head": ["model.hf.model.layers.*", "model.hf.model.norm", "model.hf.lm_head"],
        "glue": ["model.hf.model.embed_tokens", "model.hf.model.layers.*", "model.hf.model.norm", "model.hf.lm_head"],
        "whole": ["model"],
    },
}


class LlamaLM(nn.Module):
    """``transformers.LlamaForCausalLM`` as a ``tokens -> logits`` module (the benchmark computes the loss)."""

    def __init__(self, d_model: int, n_layer: int, n_head: int, block_size: int, vocab_size: int) -> None:
        super().__init__()
        import transformers

        intermediate = -(-(8 * d_model) // 3 // 64) * 64
        config = transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=d_model, intermediate_size=intermediate, num_hidden_layers=n_layer,
            num_attention_heads=n_head, num_key_value_heads=n_head, max_position_embeddings=block_size,
            use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa",
        )
        self.hf = transformers.LlamaForCausalLM(config)

    def forward(self, idx: Tensor) -> Tensor:
        return self.hf(input_ids=idx).logits


def build(model: str, size: Dict[str, int], vocab_size: int) -> nn.Module:
    """The ``model`` (one of :data:`MODELS`) of ``size`` (``common.SIZES``), in fp32 on the CPU."""
    if model == "gpt":
        from cg_lightning.examples.gpt import GPT

        return GPT(vocab_size=vocab_size, block_size=size["block_size"], n_layer=size["n_layer"],
                   n_head=size["n_head"], d_model=size["d_model"], dropout=0.0, bias=True, tie_weights=False)
    if model == "llama":
        return LlamaLM(size["d_model"], size["n_layer"], size["n_head"], size["block_size"], vocab_size)
    raise ValueError(f"unknown model {model!r}; choose from {MODELS}")


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())

