"""Peer ``torch_ddp``: a plain PyTorch loop over ``DistributedDataParallel`` (world size 1), eager."""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import (
    PeerResult,
    RunSettings,
    build_model,
    loss_value,
    make_batches,
    make_optimizer,
    make_train_step,
    single_process_group,
    time_loop,
)
from benchmarks.peers import Peer


def wrap_ddp(model, s: RunSettings) -> DistributedDataParallel:
    return DistributedDataParallel(model, device_ids=[s.device.index or 0] if s.is_cuda else None)


def run(s: RunSettings) -> PeerResult:
    batches = make_batches(s)
    with single_process_group(s.device):
        model = build_model(s)
        ddp = wrap_ddp(model, s)
        optimizer = make_optimizer(model.named_parameters(), s)
        timing = time_loop(make_train_step(ddp, optimizer, s), batches, s)
    return PeerResult(timing.ms_per_step, timing.warmup_s, final_loss=loss_value(timing.last_loss))


PEER = Peer("torch_ddp", run, needs_cuda=False,
            description="plain loop, torch DistributedDataParallel (world size 1, NCCL/gloo), eager")
