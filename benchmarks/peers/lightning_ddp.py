"""Peer ``lightning_ddp``: Lightning ``Trainer(strategy="ddp", devices=1, precision="bf16-mixed")``, eager."""

from __future__ import annotations

from benchmarks.common import PeerResult, RunSettings, loss_value
from benchmarks.peers import Peer


def run(s: RunSettings) -> PeerResult:
    from benchmarks.peers._lightning import fit_timed

    from lightning.pytorch.strategies import DDPStrategy

    from benchmarks.common import PROCESS_GROUP_TIMEOUT

    timing, _ = fit_timed(s, DDPStrategy(timeout=PROCESS_GROUP_TIMEOUT))
    return PeerResult(timing.ms_per_step, timing.warmup_s, final_loss=loss_value(timing.last_loss))


PEER = Peer("lightning_ddp", run, needs_cuda=False,
            description='Lightning Trainer(strategy="ddp", devices=1, precision="bf16-mixed"), eager')
