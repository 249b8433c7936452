"""``transformers.Trainer`` and ``CUDAGraphTrainer`` on several processes for ``tests/test_transformers_trainer.py``
(gloo, started with torchrun's environment):

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/hf_trainer_dist.py --out DIR [--bf16]

Both train the same tiny random Llama on the same seed and data, one after the other in the same processes
(accumulation 2, clipping, evaluation every 3 steps, a checkpoint at step 3 and 6); each rank writes
``DIR/rank<r>.pt``: per run the logged losses, evaluation losses and gradient norms, the final weights, and for
``CUDAGraphTrainer`` the engine's forward replays.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist
import transformers
from accelerate.state import AcceleratorState

from cg_lightning.transformers import CUDAGraphTrainer
from tests.hf_models import TokenDataset, logged, tiny_llama, trainer_args


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--bf16", action="store_true")
    a = ap.parse_args()
    results = {}
    for cls in (transformers.Trainer, CUDAGraphTrainer):
        AcceleratorState._reset_state(True)  # the process group stays; the next Trainer builds its accelerator anew
        extra = {"graphs": {"warmup_steps": 1}, "ddp": {"timeout_s": 120}} if cls is CUDAGraphTrainer else {}
        torch.manual_seed(0)
        trainer = cls(model=tiny_llama(attn_implementation="eager"),
                      args=trainer_args(os.path.join(a.out, cls.__name__), bf16=a.bf16, ddp_backend="gloo"),
                      train_dataset=TokenDataset(64, 1), eval_dataset=TokenDataset(16, 2), **extra)
        trainer.train()
        engines = getattr(trainer.accelerator, "_graph_engines", [])
        results[cls.__name__] = {
            "logged": logged(trainer), "world_size": trainer.args.world_size,
            "weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            "forward_replays": engines[0].graph_stats.forward_replays if engines else None,
        }
    torch.save(results, os.path.join(a.out, f"rank{dist.get_rank()}.pt"))


if __name__ == "__main__":
    main()
