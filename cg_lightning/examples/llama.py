"""A transformers ``LlamaForCausalLM`` trained as a LightningModule, built from a config (random weights, no
download): the model people bring, on the same text data as the GPT example.

Batches are ``(x, y)`` int64 pairs of shape ``(B, T)``, ``y`` being ``x`` shifted left by one token
(:class:`cg_lightning.examples.data.TextDataModule`); the loss is the mean next-token cross-entropy of ``y`` under
the model's logits, computed in fp32. Under ``strategy: cudagraph_ddp`` the default layer selection graphs the decoder
layers (``model.model.layers.*``); embeddings, the final norm and the head run eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor

__all__ = ["LlamaLightningModule"]


class LlamaLightningModule(LightningModule):
    """``transformers.LlamaForCausalLM`` of the given size, randomly initialised.

    Args:
        vocab_size: tokens (256: bytes, as the default data).
        block_size: context length (``max_position_embeddings``); the data's windows may not be longer.
        n_layer, n_head, n_kv_head, d_model, d_ff: layers, attention heads, key/value heads (grouped-query
            attention), width and MLP width (default ``8 * d_model // 3`` rounded up to a multiple of 32).
        gradient_checkpointing: ``gradient_checkpointing_enable()`` (non-reentrant) on the model.
        attn_implementation: transformers' attention kernel, ``"sdpa"`` or ``"eager"``.
        lr, weight_decay, betas, fused: AdamW's (``fused=True``: one kernel per step, which ``cudagraph_ddp``
            calls on cached tensor lists).

    Raises:
        ImportError: when ``transformers`` is not installed (``pip install transformers``).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_kv_head: int = 2,
        d_model: int = 128,
        d_ff: int | None = None,
        gradient_checkpointing: bool = False,
        attn_implementation: str = "sdpa",
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        betas: Sequence[float] = (0.9, 0.95),
        fused: bool | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        import transformers

        d_ff = d_ff or -(-8 * d_model // 3 // 32) * 32
        config = transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=d_model, intermediate_size=d_ff, num_hidden_layers=n_layer,
            num_attention_heads=n_head, num_key_value_heads=n_kv_head, max_position_embeddings=block_size,
            tie_word_embeddings=False, use_cache=False, attn_implementation=attn_implementation,
        )
        self.block_size = block_size
        self.model = transformers.LlamaForCausalLM(config)
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.lr, self.weight_decay, self.betas, self.fused = float(lr), float(weight_decay), tuple(betas), fused

    def setup(self, stage: str) -> None:
        """Refuse a data module that cannot feed this model, before the first batch (as the GPT example does).

        Raises:
            cg_lightning.errors.ConfigError: windows longer than the model's context, token ids beyond its vocabulary.
        """
        from cg_lightning.errors import ConfigError
        from cg_lightning.examples.data import model_fit_problems

        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        problems = model_fit_problems(datamodule, self.model.config.vocab_size, self.block_size)
        if problems:
            raise ConfigError("\n".join(problems))

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """The mean next-token cross-entropy, logged as ``train_loss``."""
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.ndim >= 2]
        rest = [p for p in self.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        kwargs = {} if self.fused is None else {"fused": self.fused}
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, **kwargs)
