"""Models nobody here wrote, from ``transformers`` (random tiny configs, no downloads), trained in Lightning.

The builders set ``use_cache=False`` (what the strategy sets for training, :mod:`cg_lightning.lifecycle.hf_cache`),
so that the ``"ddp"`` reference runs the same model; pass ``use_cache=True`` to get the library's default.

``HFModule`` wraps any ``transformers`` causal-LM (or seq2seq) model: its training step is the model's own loss
on a batch of token ids (labels = the ids). ``fit_hf`` trains one under a strategy with a fixed seed and data,
so a run under ``"ddp"`` and one under ``cudagraph_ddp`` see the same model and batches.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import pytest
import torch
from lightning.pytorch import LightningModule, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import make_trainer

transformers = pytest.importorskip("transformers")

VOCAB = 64
SEQ = 16


def tiny_llama(**overrides):
    """A 3-layer ``LlamaForCausalLM``, hidden size 32."""
    config = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, **overrides}))


def tiny_gpt2(**overrides):
    """A 2-layer ``GPT2LMHeadModel`` (``Conv1D`` projections, tied head), width 32."""
    config = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
                  use_cache=False)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**config, **overrides}))


def tiny_bert(**overrides):
    """A 2-layer ``BertForMaskedLM``, width 32."""
    config = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64)
    return transformers.BertForMaskedLM(transformers.BertConfig(**{**config, **overrides}))


def tiny_t5(**overrides):
    """A ``T5ForConditionalGeneration`` with 2 encoder and 2 decoder blocks, width 32 (labels: the input ids)."""
    config = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                  decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(**{**config, **overrides}))


def tiny_qwen2_moe(**overrides):
    """A 2-layer ``Qwen2MoeForCausalLM`` with 4 experts (2 per token) and a shared expert."""
    config = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                  decoder_sparse_step=1, router_aux_loss_coef=0.01, use_cache=False)
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**{**config, **overrides}))


def tiny_mixtral(**overrides):
    """A 2-layer ``MixtralForCausalLM``, 4 experts (2 per token), its default experts and the router's auxiliary
    loss in the training loss (``output_router_logits=True``)."""
    config = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                  output_router_logits=True, router_aux_loss_coef=0.01, use_cache=False)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**config, **overrides}))


class HFModule(LightningModule):
    """``build()``'s model trained on its own language-model loss; ``forward_kwargs`` go to every forward,
    ``prepare(model)`` runs on the built model (e.g. ``gradient_checkpointing_enable``)."""

    def __init__(self, build: Callable, forward_kwargs: Optional[Dict] = None,
                 prepare: Optional[Callable] = None, lr: float = 3e-3, fused: bool = False) -> None:
        super().__init__()
        self.model = build()
        if prepare is not None:
            prepare(self.model)
        self.forward_kwargs = dict(forward_kwargs or {})
        self.lr, self.fused = lr, fused

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        out = self.model(input_ids=ids, labels=ids, **self.forward_kwargs)
        return out.loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=self.fused)


def token_loader(n: int = 64, seq: int = SEQ, batch_size: int = 4, seed: int = 1) -> DataLoader:
    ids = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(ids), batch_size=batch_size)


def fit_hf(strategy, build: Callable, steps: int = 6, *, seed: int = 0, callbacks=(), trainer_kwargs=None,
           compile_module: bool = False, **module_kwargs):
    """Seed, build ``HFModule(build, **module_kwargs)`` and fit it for ``steps`` steps on :func:`token_loader`
    with :func:`~tests.helpers.make_trainer` (``trainer_kwargs``: e.g. ``accelerator``, ``precision``);
    ``compile_module`` fits ``torch.compile(module)`` instead (Lightning compiles the module's steps in place).
    Returns (module, trainer)."""
    seed_everything(seed, workers=True)
    module = HFModule(build, **module_kwargs)
    trainer = make_trainer(strategy, steps, callbacks, **(trainer_kwargs or {}))
    trainer.fit(torch.compile(module) if compile_module else module, token_loader())
    return module, trainer


class TokenDataset(torch.utils.data.Dataset):
    """``n`` rows of ``seq`` random token ids (seeded), as ``transformers.Trainer`` takes them: ``{"input_ids",
    "labels"}`` (the model's own causal-LM loss)."""

    def __init__(self, n: int, seed: int, seq: int = SEQ) -> None:
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_args(folder: str, **overrides) -> "transformers.TrainingArguments":
    """``TrainingArguments`` of the ``transformers.Trainer`` runs: 6 steps of 2 micro-batches of 4, clipping at 0.5,
    a loss logged every step, evaluation and a checkpoint every 3 steps, on the CPU, seeded; ``overrides`` win."""
    kw = dict(output_dir=folder, max_steps=6, per_device_train_batch_size=4, per_device_eval_batch_size=4,
              gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=3e-3, logging_steps=1,
              eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=3, report_to=[], use_cpu=True,
              seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    return transformers.TrainingArguments(**{**kw, **overrides})


def logged(trainer) -> list:
    """``(step, value)`` of every loss, evaluation loss and gradient norm a ``transformers.Trainer`` logged."""
    return [(e["step"], e[k]) for e in trainer.state.log_history for k in ("loss", "eval_loss", "grad_norm") if k in e]


def assert_same_weights(got: torch.nn.Module, ref: torch.nn.Module) -> None:
    """Every parameter bit-equal (names the first that differs)."""
    for (name, p), q in zip(got.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{name}: max abs diff {(p - q).abs().max().item():.3g}"
