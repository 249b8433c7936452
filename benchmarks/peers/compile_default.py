"""Peer ``compile_default``: ``torch.compile(model)`` (default mode: Inductor's fused kernels, no CUDA graphs) in a
plain loop (no DDP). The loss, backward driver and fused AdamW stay eager, as in ``compile_reduce_overhead``."""

from __future__ import annotations

import gc

import torch

from benchmarks.common import (
    PeerResult,
    RunSettings,
    build_model,
    excess_warmup_s,
    loss_value,
    make_batches,
    make_optimizer,
    make_train_step,
    time_loop,
)
from benchmarks.peers import Peer
from benchmarks.peers.compile_reduce_overhead import reset_compiler


def run(s: RunSettings) -> PeerResult:
    try:
        batches = make_batches(s)
        model = build_model(s)
        optimizer = make_optimizer(model.named_parameters(), s)
        timing = time_loop(make_train_step(torch.compile(model), optimizer, s), batches, s)
        return PeerResult(
            timing.ms_per_step, timing.warmup_s,
            capture_s=excess_warmup_s(timing.warmup_step_s, timing.ms_per_step),
            capture_what="compile: warmup time beyond as many steady steps",
            final_loss=loss_value(timing.last_loss),
        )
    finally:
        gc.collect()
        reset_compiler()


PEER = Peer("compile_default", run, needs_cuda=True,
            description="torch.compile(model) (default mode: fused kernels, no CUDA graphs), plain loop, no DDP")
