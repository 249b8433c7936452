"""A small decoder-only transformer (GPT-style); its LightningModule is :mod:`cg_lightning.examples.gpt`.

The model is deliberately plain so that it can serve as a test bed for per-layer
CUDA graphs: every :class:`Block` takes exactly one tensor and returns exactly one
tensor, and its ``forward`` contains no host synchronisation, no data-dependent
Python control flow and no creation of CPU tensors.  The embedding and the final
norm/head run outside the blocks and are free to do ordinary eager things.

Shapes used throughout:

* ``B`` batch size, ``T`` sequence length (``T <= block_size``),
* ``d`` = ``d_model``, ``V`` = ``vocab_size``, ``H`` = ``n_head``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import cg_lightning
from cg_lightning.examples.arguments import check_arguments, finite_at_least, whole

__all__ = ["Block", "GPT"]


class Block(nn.Module):
    """One pre-norm transformer decoder block.

    ``x = x + attn(ln1(x))`` followed by ``x = x + mlp(ln2(x))``, where ``attn`` is
    causal multi-head self-attention (fused q/k/v projection, PyTorch's
    ``scaled_dot_product_attention``) and ``mlp`` is
    ``Linear(d, 4d) -> GELU(tanh) -> Linear(4d, d)``.

    Args:
        d_model: width ``d`` of the residual stream.
        n_head: number of attention heads; must divide ``d_model``.
        dropout: probability used for attention dropout (training only) and for
            the residual dropout after each sub-layer.
        bias: whether the Linear and LayerNorm layers carry a bias.
        recompute: activation recomputation of the whole block with
            :func:`cg_lightning.checkpoint` (reentrant; bypassed while the block's
            graph is built, so a graphed block keeps its activations).
    """

    def __init__(
        self, d_model: int, n_head: int, dropout: float = 0.0, bias: bool = True, recompute: bool = False
    ) -> None:
        super().__init__()
        self.recompute = recompute
        if d_model % n_head != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_head ({n_head})")
        self.d_model = d_model
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.dropout = float(dropout)

        self.ln1 = nn.LayerNorm(d_model, bias=bias)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.attn_proj = nn.Linear(d_model, d_model, bias=bias)
        self.attn_drop = nn.Dropout(dropout)

        self.ln2 = nn.LayerNorm(d_model, bias=bias)
        self.fc_in = nn.Linear(d_model, 4 * d_model, bias=bias)
        self.act = nn.GELU(approximate="tanh")
        self.fc_out = nn.Linear(4 * d_model, d_model, bias=bias)
        self.mlp_drop = nn.Dropout(dropout)

        # Projections that write into the residual stream get a depth-scaled init
        # (see GPT._init_weights); mark them so the parent model can find them.
        self.attn_proj.is_residual_proj = True
        self.fc_out.is_residual_proj = True

    def attention(self, x: Tensor) -> Tensor:
        """Causal self-attention: ``(B, T, d) -> (B, T, d)``."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(self.d_model, dim=2)
        # (B, T, d) -> (B, H, T, head_dim)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.attn_drop(self.attn_proj(y))

    def mlp(self, x: Tensor) -> Tensor:
        """Position-wise feed-forward network: ``(B, T, d) -> (B, T, d)``."""
        return self.mlp_drop(self.fc_out(self.act(self.fc_in(x))))

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block.

        Args:
            x: floating-point tensor of shape ``(B, T, d)``.

        Returns:
            Tensor of the same shape and dtype as ``x``.
        """
        if self.recompute:
            return cg_lightning.checkpoint(self._body, x)
        return self._body(x)

    def _body(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _check_sizes(vocab_size, block_size, n_layer, n_head, d_model, dropout) -> None:
    """Refuse sizes a GPT cannot be built with, before any memory is taken (see :func:`check_arguments`);
    a model whose float32 parameters alone exceed this machine's memory counts as one."""
    sizes = dict(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, d_model=d_model)
    check_arguments(**{name: (value, whole(value), "an int >= 1") for name, value in sizes.items()},
                    dropout=(dropout, finite_at_least(dropout, 0.0) and dropout < 1.0, "a probability in [0, 1)"))
    check_arguments(n_head=(n_head, d_model % n_head == 0, f"a divisor of d_model ({d_model})"))
    params = 2 * vocab_size * d_model + block_size * d_model + n_layer * (12 * d_model * d_model + 13 * d_model)
    memory = _physical_memory()
    if memory is not None and 4 * params > memory:
        raise ValueError(f"d_model: the model's {params:.3g} parameters ({4 * params / 2**30:.3g} GiB in float32; "
                         f"n_layer {n_layer}, d_model {d_model}, vocab_size {vocab_size}) exceed this machine's "
                         f"{memory / 2**30:.3g} GiB of memory")


class GPT(nn.Module):
    """Decoder-only transformer language model.

    ``idx (B, T) int64 -> tok_emb + pos_emb -> drop -> blocks -> ln_f -> lm_head``
    producing logits of shape ``(B, T, V)``.

    Args:
        vocab_size: number of token ids ``V`` (256 for raw bytes).
        block_size: maximum sequence length (size of the positional table).
        n_layer: number of :class:`Block` modules, kept in ``self.blocks``.
        n_head: attention heads per block.
        d_model: residual stream width ``d``.
        dropout: dropout probability (embedding, attention, residual).
        bias: whether Linear/LayerNorm layers in the blocks and ``ln_f`` carry biases.
        tie_weights: share one Parameter between ``tok_emb.weight`` and
            ``lm_head.weight``.
        recompute_blocks: activation recomputation inside every block (see :class:`Block`).
        block_schedule: indices of the blocks to apply, in order (default: each block
            once); e.g. ``[0, 0, 1]`` applies block 0 twice (weight sharing across depth).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        tie_weights: bool = False,
        recompute_blocks: bool = False,
        block_schedule: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        _check_sizes(vocab_size, block_size, n_layer, n_head, d_model, dropout)
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.n_layer = n_layer

        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            [Block(d_model, n_head, dropout=dropout, bias=bias, recompute=recompute_blocks) for _ in range(n_layer)]
        )
        self.block_schedule = list(range(n_layer)) if block_schedule is None else [int(i) for i in block_schedule]
        if any(not 0 <= i < n_layer for i in self.block_schedule):
            raise ValueError(f"block_schedule {self.block_schedule} has indices outside 0..{n_layer - 1}")
        self.ln_f = nn.LayerNorm(d_model, bias=bias)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

        self.apply(self._init_weights)
        if tie_weights:
            # Done after init so both names refer to the (embedding-initialised) Parameter.
            self.lm_head.weight = self.tok_emb.weight

    def _init_weights(self, module: nn.Module) -> None:
        """Deterministic (given the torch seed) GPT-2 style initialisation."""
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "is_residual_proj", False):
                std = 0.02 / math.sqrt(2 * self.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            if module.weight is not None:
                nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        """Compute next-token logits.

        Args:
            idx: int64 token ids of shape ``(B, T)`` with ``T <= block_size``.

        Returns:
            Logits of shape ``(B, T, vocab_size)`` (dtype of the parameters or autocast).
        """
        return self.head(self.hidden(idx))

    def hidden(self, idx: Tensor) -> Tensor:
        """Embeddings and blocks: ``(B, T)`` int64 -> ``(B, T, d)`` residual stream."""
        B, T = idx.shape
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for i in self.block_schedule:
            x = self.blocks[i](x)
        return x

    def head(self, x: Tensor) -> Tensor:
        """Final norm and output projection: ``(B, T, d) -> (B, T, V)`` logits."""
        return self.lm_head(self.ln_f(x))

    def head_loss(self, x: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy of :meth:`head` (scalar); ``targets`` int64 ``(B, T)``."""
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
