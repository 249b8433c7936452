"""Peers ``lightning_ddp``: Lightning ``Trainer(strategy="ddp", devices=1, precision="bf16-mixed")``, eager; and
``lightning_ddp_compile``: the same with the model wrapped in ``torch.compile`` (default mode) inside the
LightningModule, how Lightning users combine the two."""

from __future__ import annotations

from benchmarks.common import PeerResult, RunSettings, loss_value
from benchmarks.peers import Peer


def run(s: RunSettings, compile_model: bool = False) -> PeerResult:
    from benchmarks.peers._lightning import fit_timed

    from lightning.pytorch.strategies import DDPStrategy

    from benchmarks.common import PROCESS_GROUP_TIMEOUT

    try:
        timing, _ = fit_timed(s, DDPStrategy(timeout=PROCESS_GROUP_TIMEOUT), compile_model=compile_model)
    finally:
        if compile_model:
            from benchmarks.peers.compile_reduce_overhead import reset_compiler

            reset_compiler()
    if not compile_model:
        return PeerResult(timing.ms_per_step, timing.warmup_s, final_loss=loss_value(timing.last_loss))
    return PeerResult(timing.ms_per_step, timing.warmup_s, capture_s=timing.warmup_s,
                      capture_what="compile: wall time of the warmup steps", final_loss=loss_value(timing.last_loss))


def run_compiled(s: RunSettings) -> PeerResult:
    return run(s, compile_model=True)


PEER = Peer("lightning_ddp", run, needs_cuda=False,
            description='Lightning Trainer(strategy="ddp", devices=1, precision="bf16-mixed"), eager')


PEER_COMPILE = Peer("lightning_ddp_compile", run_compiled, needs_cuda=True,
                    description='Lightning Trainer(strategy="ddp", devices=1, precision="bf16-mixed") with '
                                'self.model = torch.compile(model) in the LightningModule')
