"""Peer ``compile_reduce_overhead``: ``torch.compile(model, mode="reduce-overhead")`` in a plain loop (no DDP).

The GPT module is compiled (the loss, backward driver and fused AdamW stay eager); Inductor's CUDA-graph trees
record on an early call and replay after that. ``cudagraph_mark_step_begin()`` starts every step, as PyTorch
recommends for training loops. Compile time is the warmup's excess over as many steady steps.
"""

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


def reset_compiler() -> None:
    """Drop compiled code and the CUDA-graph trees (and their memory pool) before the next peer."""
    import torch._dynamo

    torch._dynamo.reset()
    if torch.cuda.is_available():
        try:
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()
        except Exception:  # pragma: no cover - private API; dynamo.reset already did it on newer torch
            pass


def _measure(s: RunSettings) -> PeerResult:
    batches = make_batches(s)
    model = build_model(s)
    compiled = torch.compile(model, mode="reduce-overhead")
    optimizer = make_optimizer(model.named_parameters(), s)
    step = make_train_step(compiled, optimizer, s, before_step=torch.compiler.cudagraph_mark_step_begin)
    timing = time_loop(step, batches, s)
    extra = {}
    if s.warmup < 3:
        extra["note"] = "warmup < 3: CUDA-graph recording may fall inside the timed window"
    return PeerResult(
        timing.ms_per_step, timing.warmup_s,
        capture_s=excess_warmup_s(timing.warmup_step_s, timing.ms_per_step),
        capture_what="compile + graph recording: warmup time beyond as many steady steps",
        final_loss=loss_value(timing.last_loss), extra=extra,
    )


def run(s: RunSettings) -> PeerResult:
    try:
        return _measure(s)
    finally:
        gc.collect()  # the compiled module, its optimizer and outputs are gone before the trees are reset
        reset_compiler()


PEER = Peer("compile_reduce_overhead", run, needs_cuda=True,
            description='torch.compile(model, mode="reduce-overhead"), plain loop, no DDP')
