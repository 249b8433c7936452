"""Two-process parity scenarios for ``tests/test_lightning_parity.py``: run under torchrun (2 processes, gloo).

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/lightning_parity_dist.py --out DIR fit gan

Each process trains every named scenario in turn under its reference strategy, then every one again under the
candidate strategy (:func:`tests.lightning_runs.candidate`), so an import serves both sides and a candidate that
fails cannot take the reference's results with it. For each side (``reference``, ``candidate``) it writes
``DIR/<side>/<scenario>.rank<r>.pt`` (the run's facts, :meth:`tests.lightning_runs.Run.facts`) or, if training
raised, ``DIR/<side>/<scenario>.rank<r>.err`` (the exception's line, then its traceback). Exit status 0 either way.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from lightning.pytorch import Callback

from cg_lightning import CUDAGraphDDPStrategy
from tests.lightning_manual_models import GANModel, ManualModel
from torch.utils.data import DataLoader

from tests.lightning_models import ParityModel, PlainAdamModel, dataset
from tests.lightning_runs import OutcomeRecorder, candidate, train


class NewRate(Callback):
    """At ``step`` a new learning rate on ``ranks`` (on some only, as a plateau scheduler on an unsynced metric may);
    with ``back``, the old one again at the next step."""

    def __init__(self, step: int, ranks=(0, 1), back: bool = False) -> None:
        self.step, self.ranks, self.back = step, ranks, back

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank not in self.ranks:
            return
        for group in trainer.optimizers[0].param_groups:
            if trainer.global_step == self.step:
                group["lr"] = 0.003
            elif self.back and trainer.global_step == self.step + 1:
                group["lr"] = 0.01


class RankZeroHook(PlainAdamModel):
    """On rank 0 only, an ``on_before_optimizer_step`` set on the module that halves the gradients."""

    def setup(self, stage: str) -> None:
        if self.global_rank == 0:
            self.on_before_optimizer_step = lambda optimizer: [p.grad.mul_(0.5) for p in self.parameters()]


class RankShapes(PlainAdamModel):
    """Fourteen batches of 4 on each rank (no distributed sampler), except rank 1's twelfth, of 3 samples."""

    def train_dataloader(self):
        x, y = dataset(64, seed=self.global_rank).tensors
        sizes = [4] * 11 + ([3] if self.global_rank == 1 else [4]) + [4] * 2
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return DataLoader([(x[a:a + n], y[a:a + n]) for a, n in zip(starts, sizes)], batch_size=None)


#: scenario -> (reference strategy, module factory, Trainer arguments); 4 batches per rank and epoch
SCENARIOS = {
    "fit": ("ddp", lambda: ParityModel(), dict(max_epochs=2)),
    "accumulate_clip": ("ddp", lambda: ParityModel(optimizer="adam", lr=0.01),
                        dict(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.05)),
    "manual_accumulate": ("ddp", lambda: ManualModel(accumulate=2), dict(max_epochs=2)),
    "manual_accumulate_no_sync": ("ddp", lambda: ManualModel(accumulate=2, no_sync=True), dict(max_epochs=2)),
    "gan": ("ddp_find_unused_parameters_true", GANModel, dict(max_epochs=2)),
    # the extra head joins the loss on one rank at a time: used somewhere on every step, unused locally
    "find_unused_by_rank": ("ddp_find_unused_parameters_true", lambda: ParityModel(branch="rank"),
                            dict(max_epochs=2)),
    # graphs.whole_step: forward, loss, backward and the all-reduce replayed as one step (eager backend), clipping
    "whole_step": ("ddp", lambda: ParityModel(optimizer="adam", lr=0.01), dict(max_epochs=2, gradient_clip_val=0.05)),
    # graphs.capture_optimizer: the fused AdamW update inside the step's graph (no hook before the update recorded)
    "iteration_graph": ("ddp", PlainAdamModel, dict(max_epochs=3, recorder=OutcomeRecorder)),
    # ... and a rate that differs between the ranks from step 5: every rank takes the update out of its graph
    "iteration_graph_rank_rate": ("ddp", PlainAdamModel, dict(max_epochs=3, recorder=OutcomeRecorder,
                                                              callbacks=[NewRate(5, ranks=(0,))])),
    # ... and a rate changed on both ranks at step 10 while rank 1's batch at step 11 has another shape: the ranks
    # capture again together at step 12, not rank 0 alone at step 11
    "iteration_graph_rank_shapes": ("ddp", RankShapes, dict(max_epochs=1, recorder=OutcomeRecorder,
                                                             use_distributed_sampler=False, callbacks=[NewRate(10)])),
    # ... and another rate on rank 0 only in the last warmup step (step 1): held two steps on rank 1 only at the
    # capture, so neither rank records the update then (recorded once the step graph served 8 steps)
    "iteration_graph_rank_warmup_rate": ("ddp", PlainAdamModel, dict(max_epochs=3, recorder=OutcomeRecorder,
                                                                     callbacks=[NewRate(1, ranks=(0,), back=True)])),
    # ... and a hook between the backward and the update on rank 0 only: both ranks keep the update out
    "iteration_graph_rank_hook": ("ddp", RankZeroHook, dict(max_epochs=3, recorder=OutcomeRecorder)),
}

#: scenario -> the candidate's graphs options, where it is not the reference's candidate strategy name
CANDIDATE_GRAPHS = {"whole_step": {"whole_step": True, "backend": "eager", "warmup_steps": 2},
                    "iteration_graph": {"backend": "eager", "warmup_steps": 2, "capture_optimizer": True},
                    "iteration_graph_rank_rate": {"backend": "eager", "warmup_steps": 2, "capture_optimizer": True},
                    "iteration_graph_rank_shapes": {"backend": "eager", "warmup_steps": 2, "capture_optimizer": True},
                    "iteration_graph_rank_warmup_rate": {"backend": "eager", "warmup_steps": 2,
                                                         "capture_optimizer": True},
                    "iteration_graph_rank_hook": {"backend": "eager", "warmup_steps": 2, "capture_optimizer": True}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS))
    a = ap.parse_args()
    rank = int(os.environ["RANK"])
    for side in ("reference", "candidate"):
        folder = os.path.join(a.out, side)
        os.makedirs(folder, exist_ok=True)
        for name in a.scenarios:
            reference, model, kwargs = SCENARIOS[name]
            strategy = reference if side == "reference" else candidate(reference)
            if side == "candidate" and name in CANDIDATE_GRAPHS:
                strategy = CUDAGraphDDPStrategy(graphs=CANDIDATE_GRAPHS[name])
            try:
                facts = train(strategy, model, devices=2, **kwargs).facts()
                step_stats = getattr(strategy, "last_step_graph_stats", None)
                if step_stats is not None:  # the test checks that the steps were replayed, with their updates
                    with open(os.path.join(folder, f"{name}.rank{rank}.replays"), "w") as f:
                        f.write(str(step_stats.replays))
                    with open(os.path.join(folder, f"{name}.rank{rank}.updates"), "w") as f:
                        f.write(f"{step_stats.updates}\n{step_stats.update_refusal}")
            except Exception as e:  # noqa: BLE001  (reported by the test, scenario by scenario)
                first = str(e).splitlines()[0] if str(e) else ""
                with open(os.path.join(folder, f"{name}.rank{rank}.err"), "w") as f:
                    f.write(f"{type(e).__name__}: {first}\n{traceback.format_exc()}")
                continue
            torch.save(facts, os.path.join(folder, f"{name}.rank{rank}.pt"))

if __name__ == "__main__":
    main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
