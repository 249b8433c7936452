"""Multi-process runs of ``ddp.distributed_optimizer`` for ``tests/test_distributed_optimizer.py`` (torchrun, gloo).

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/distopt_dist.py --out DIR --phase fresh
    python -m torch.distributed.run --nproc_per_node 4 tests/scripts/distopt_dist.py --out DIR --phase reshard

``fresh`` (2 processes): Lightning ``"ddp"`` and ``cudagraph_ddp`` with the distributed optimizer train the same
module (a ``ModuleList`` body, fused AdamW in two param groups, a StepLR, 2 batches accumulated, clipping by norm,
tiny buckets) for 2 epochs, each saving a checkpoint at every epoch's end; then the distributed optimizer resumes
from its epoch-0 checkpoint. It also compares the collectives' fallbacks with
torch's flat-tensor forms. ``reshard`` (4 processes): both strategies resume from their epoch-0 checkpoints of the
2-process run (the distributed optimizer's 2 shards cut into 4) and train 2 more epochs. Each rank writes
``DIR/<phase>.rank<r>.pt``: per run the per-step losses, final weights, and for the distributed optimizer the
elements its state holds.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import cg_lightning
from cg_lightning.ddp import collectives
from tests.lightning_models import ListBody, dataset

SAMPLES, BATCH = 64, 4


class Model(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = ListBody()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.body(x), y)

    def train_dataloader(self):
        return DataLoader(dataset(SAMPLES), batch_size=BATCH, shuffle=False)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=0.02,
                                weight_decay=0.1, fused=True)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


class Facts(Callback):
    """Per optimizer step the loss Lightning reports, and at the end the weights and the optimizer's shard size."""

    def __init__(self) -> None:
        self.losses, self.state_numel, self.shard_numel, self.pieces = [], None, None, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, module):
        driver = getattr(trainer.strategy, "driver", None)
        sharded = driver.sharded_optimizer(trainer.optimizers[0]) if driver is not None else None
        if sharded is not None:  # elements in this rank's optimizer state (exp_avg), and what the rank owns
            self.state_numel = sum(s["exp_avg"].numel() for s in sharded.inner.state.values())
            self.shard_numel = sharded.layout.shard_numel
            self.pieces = len(sharded.runs)


def fit(strategy, world: int, epochs: int, folder=None, ckpt=None, seed: int = 7) -> dict:
    seed_everything(seed, verbose=False)
    model = Model()
    facts = Facts()
    callbacks = [facts] + ([ModelCheckpoint(dirpath=folder, save_top_k=-1)] if folder else [])
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=world, max_epochs=epochs, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=folder is not None,
                      num_sanity_val_steps=0, limit_val_batches=0, accumulate_grad_batches=2, gradient_clip_val=0.05,
                      deterministic=True, callbacks=callbacks)
    trainer.fit(model, ckpt_path=ckpt)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": facts.losses, "weights": weights, "state_numel": facts.state_numel,
            "shard_numel": facts.shard_numel, "pieces": facts.pieces,
            "param_numel": sum(p.numel() for p in model.parameters())}


def distopt():
    return cg_lightning.CUDAGraphDDPStrategy(graphs={"warmup_steps": 1}, ddp={"distributed_optimizer": True,
                                                                             "bucket_size_mb": 0.0005})


def collectives_agree(rank: int, world: int) -> bool:
    """The fallbacks give what torch's flat-tensor collectives give, bit for bit (in place, as the engine calls them)."""
    torch.manual_seed(rank)
    data = torch.randn(world * 37)
    out = {}
    for native in (True, False):
        x = data.clone()
        collectives.reduce_scatter(x[rank * 37 : (rank + 1) * 37], x, native=native).wait()
        y = torch.zeros(world * 37)
        y[rank * 37 : (rank + 1) * 37] = data[:37]
        collectives.all_gather(y, y[rank * 37 : (rank + 1) * 37], native=native).wait()
        out[native] = (x[rank * 37 : (rank + 1) * 37], y)
    return all(torch.equal(a, b) for a, b in zip(out[True], out[False]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", choices=("fresh", "reshard"), required=True)
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ddp_dir, cg_dir = os.path.join(a.out, "ckpt_ddp"), os.path.join(a.out, "ckpt_cg")
    result = {}
    if a.phase == "fresh":
        result["ddp"] = fit("ddp", world, 2, ddp_dir)
        result["cg"] = fit(distopt(), world, 2, cg_dir)
        result["resumed"] = fit(distopt(), world, 2, ckpt=os.path.join(cg_dir, "epoch=0-step=4.ckpt"), seed=7)
        result["collectives_agree"] = collectives_agree(rank, world)
    else:
        result["ddp"] = fit("ddp", world, 3, ckpt=os.path.join(ddp_dir, "epoch=0-step=4.ckpt"), seed=7)
        result["cg"] = fit(distopt(), world, 3, ckpt=os.path.join(cg_dir, "epoch=0-step=4.ckpt"), seed=7)
    torch.save(result, os.path.join(a.out, f"{a.phase}.rank{rank}.pt"))


if __name__ == "__main__":
    main()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
