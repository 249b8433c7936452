"""Train the example GPT with one strategy and save per-step losses, final weights and graph stats.

Run directly (Lightning's launcher re-runs this script once per extra process)::

    python tests/scripts/train_parity.py --strategy cudagraph_ddp --devices 2 --steps 20 --out /tmp/r.pt

Rank 0 writes ``--out`` (a ``torch.save`` dict: ``losses`` list of floats, ``state`` the final
state_dict, ``stats`` the graph counters or None, ``ready_counts`` the grad-ready count per parameter name at every optimizer step).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

import cg_lightning
from examples.data import TextDataModule
from examples.gpt import GPTLightningModule


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"].detach()))


class ReadyCountRecorder(Callback):
    """The engine's grad-ready count per parameter name, every optimizer step (cudagraph_ddp only)."""

    def __init__(self) -> None:
        self.counts = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self.counts.append(dict(engine.last_ready_counts))


class SeedLightningModule(LightningModule):
    """Two graphed SeedLayers (a Linear used only inside CheckpointWithoutOutput, one outside)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        from tests.engine_models import SeedLayer, Stack

        self.net = Stack(SeedLayer, d, 2, recompute=True)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class SeedData(LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(5)
        return DataLoader(TensorDataset(torch.randn(160, 16, generator=g)), batch_size=8, shuffle=False)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="cudagraph_ddp")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--num-nodes", type=int, default=1,
                    help="Trainer(num_nodes=...): under torchrun --nnodes N, one Lightning run across N nodes")
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--tie-weights", action="store_true")
    ap.add_argument("--recompute-loss", action="store_true")
    ap.add_argument("--no-bias", action="store_true")
    ap.add_argument("--recompute-blocks", action="store_true")
    ap.add_argument("--block-schedule", default=None, help="comma-separated block indices, e.g. 0,0,1")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--model", default="gpt", choices=["gpt", "seed"],
                    help="gpt: the example GPT on text; seed: Megatron-LM PR #6373's CheckpointWithoutOutput layer")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    seed_everything(a.seed, workers=True)
    if a.model == "gpt":
        model = GPTLightningModule(
            n_layer=a.n_layer, d_model=a.d_model, n_head=a.n_head, block_size=a.block_size, lr=3e-3,
            tie_weights=a.tie_weights, bias=not a.no_bias, recompute_loss=a.recompute_loss, recompute_blocks=a.recompute_blocks,
            block_schedule=None if a.block_schedule is None else [int(i) for i in a.block_schedule.split(",")],
        )
        data = TextDataModule(block_size=a.block_size, batch_size=a.batch_size, max_bytes=300_000)
    else:
        model, data = SeedLightningModule(), SeedData()
    if a.strategy == "cudagraph_ddp":
        strategy = cg_lightning.CUDAGraphDDPStrategy(
            graphs={"warmup_steps": a.warmup_steps, "backend": a.backend}, ddp={"timeout_s": a.timeout_s}
        )
    elif a.strategy == "ddp_static":
        # torch DDP refuses a parameter finalized in several reentrant backward passes unless its graph is
        # declared static; the eager reference for such models.
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(static_graph=True)
    else:
        strategy = a.strategy
    rec = LossRecorder()
    counts = ReadyCountRecorder()
    trainer = Trainer(
        accelerator=a.accelerator, devices=a.devices, num_nodes=a.num_nodes, strategy=strategy, precision=a.precision,
        max_steps=a.steps, accumulate_grad_batches=a.accumulate, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[rec, counts],
    )
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        stats = None
        strat = trainer.strategy
        if isinstance(strat, cg_lightning.CUDAGraphDDPStrategy) and strat.last_graph_stats is not None:
            stats = dict(vars(strat.last_graph_stats))
        torch.save(
            {
                "losses": rec.losses,
                "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                "stats": stats,
                "ready_counts": counts.counts,
            },
            a.out,
        )


if __name__ == "__main__":
    main()
