"""Peer ``whole_step_graph``: the whole training step in one CUDA graph: the limit for launch overhead.

Forward, loss, backward and ``AdamW(fused=True, capturable=True).step()`` are captured once, reading the batch
from static input buffers; each step copies the batch into them and replays. No DDP (nothing to all-reduce
with one GPU, and this is the bound, not a peer with the same features). As PyTorch's docs require, a few
eager steps run on a side stream first (they also create the optimizer state), and the gradients are set to
None just before capture so that backward allocates them from the graph's pool and every replay rewrites
them in place.
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import (
    PeerResult,
    RunSettings,
    autocast,
    build_model,
    lm_loss,
    loss_value,
    make_batches,
    make_optimizer,
    sync,
    time_loop,
)
from benchmarks.peers import Peer

SIDE_STREAM_WARMUP = 3


def run(s: RunSettings) -> PeerResult:
    batches = make_batches(s)
    B, T = s.size["batch_size"], s.size["block_size"]
    model = build_model(s)
    optimizer = make_optimizer(model.named_parameters(), s, capturable=True)
    static_x = torch.empty((B, T), dtype=torch.long, device=s.device)
    static_y = torch.empty((B, T), dtype=torch.long, device=s.device)
    static_x.copy_(batches[0][0])
    static_y.copy_(batches[0][1])

    def fwd_bwd_step() -> torch.Tensor:
        with autocast(s, cache_enabled=False):
            loss = lm_loss(model(static_x), static_y)
        loss.backward()
        optimizer.step()
        return loss

    sync(s.device)
    t0 = time.perf_counter()
    side = torch.cuda.Stream(device=s.device)
    side.wait_stream(torch.cuda.current_stream(s.device))
    with torch.cuda.stream(side):
        for _ in range(SIDE_STREAM_WARMUP):
            optimizer.zero_grad(set_to_none=True)
            fwd_bwd_step()
    torch.cuda.current_stream(s.device).wait_stream(side)
    optimizer.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = fwd_bwd_step().detach()
    sync(s.device)
    capture_s = time.perf_counter() - t0

    def step(batch):
        x, y = batch
        static_x.copy_(x, non_blocking=True)
        static_y.copy_(y, non_blocking=True)
        graph.replay()
        return static_loss

    timing = time_loop(step, batches, s)
    return PeerResult(
        timing.ms_per_step, timing.warmup_s, capture_s=capture_s,
        capture_what=f"{SIDE_STREAM_WARMUP} side-stream eager steps + capture of the whole step",
        final_loss=loss_value(timing.last_loss),
        extra={"side_stream_warmup_steps": SIDE_STREAM_WARMUP},
    )


PEER = Peer("whole_step_graph", run, needs_cuda=True,
            description="forward+backward+AdamW(fused, capturable) step in one CUDA graph, static inputs (the limit)")
