"""Peer ``torch_ddp_graphed``: ``torch_ddp`` with ``torch.cuda.make_graphed_callables`` on every block.

The blocks are graphed first (one call, one shared pool: forwards captured in order, backwards in reverse,
the order they replay in each step), then the model is wrapped in DDP, so the all-reduce stays outside the
graphs (PyTorch's recipe for per-module graphs under DDP). torch refuses an autocast with its weight-cast
cache on, so capture and training both run under ``torch.autocast(..., cache_enabled=False)``.
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import (
    PeerResult,
    RunSettings,
    autocast,
    build_model,
    loss_value,
    make_batches,
    make_optimizer,
    make_train_step,
    single_process_group,
    sync,
    time_loop,
)
from benchmarks.peers import Peer
from benchmarks.peers.torch_ddp import wrap_ddp


def graph_blocks(model, s: RunSettings) -> float:
    """Graph every block of ``model.blocks`` in place; returns the seconds it took (warmup + capture)."""
    B, T, d = s.size["batch_size"], s.size["block_size"], s.size["d_model"]
    blocks = tuple(model.blocks)
    # Each block sees a (B, T, d) fp32 activation that requires grad: the embedding sum is fp32 (embeddings
    # are not autocast), and a block returns x + bf16 branch outputs, which promotes to fp32.
    sample_args = tuple(
        (torch.randn(B, T, d, device=s.device, dtype=torch.float32, requires_grad=True),) for _ in blocks
    )
    sync(s.device)
    t0 = time.perf_counter()
    with autocast(s, cache_enabled=False):
        graphed = torch.cuda.make_graphed_callables(blocks, sample_args)
    sync(s.device)
    seconds = time.perf_counter() - t0
    for i, block in enumerate(graphed):
        model.blocks[i] = block  # the same module objects, forward replaced; kept explicit
    return seconds


def run(s: RunSettings) -> PeerResult:
    batches = make_batches(s)
    with single_process_group(s.device):
        model = build_model(s)
        capture_s = graph_blocks(model, s)
        ddp = wrap_ddp(model, s)
        optimizer = make_optimizer(model.named_parameters(), s)
        step = make_train_step(ddp, optimizer, s, cache_enabled=False)
        timing = time_loop(step, batches, s)
    return PeerResult(
        timing.ms_per_step, timing.warmup_s, capture_s=capture_s,
        capture_what="torch.cuda.make_graphed_callables on all blocks (3 warmup iters + capture)",
        final_loss=loss_value(timing.last_loss),
        extra={"autocast_cache_enabled": False},
    )


PEER = Peer("torch_ddp_graphed", run, needs_cuda=True,
            description="torch_ddp + torch.cuda.make_graphed_callables on every block (autocast cache off)", models=("gpt",))
