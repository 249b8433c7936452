"""Train the example GPT with one strategy and save per-step losses, final weights and graph stats.

Run directly (Lightning's launcher re-runs this script once per extra process)::

    python tests/scripts/train_parity.py --strategy cudagraph_ddp --devices 2 --steps 20 --out /tmp/r.pt

Rank 0 writes ``--out`` (a ``torch.save`` dict: ``losses`` list of floats, ``state`` the final
state_dict, ``stats`` the graph counters or None, ``ready_counts`` the grad-ready count per parameter name at every optimizer step,
``rank_buffers`` every rank's module buffers at the end of training, indexed by rank, ``grad_norms`` the
total gradient norm before clipping at every optimizer step).
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
from cg_lightning.examples.data import TextDataModule
from cg_lightning.examples.gpt import GPTLightningModule


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


class GradNormRecorder(Callback):
    """The total gradient norm at every optimizer step, before Lightning clips (rank 0's copy of the
    all-reduced gradients)."""

    def __init__(self) -> None:
        self.norms = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad.detach().double().norm() for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.stack(grads).norm()) if grads else 0.0)


class BufferGatherer(Callback):
    """Every rank's module buffers (BatchNorm running statistics, ...) at the end of training, by rank."""

    def __init__(self) -> None:
        self.rank_buffers = []

    def on_train_end(self, trainer, pl_module) -> None:
        import torch.distributed as dist

        mine = {k: v.detach().cpu().clone() for k, v in pl_module.named_buffers()}
        if not mine:  # nothing to gather (the GPT): no collective, so the other runs are unchanged
            self.rank_buffers = [mine] * trainer.world_size
        elif dist.is_available() and dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            self.rank_buffers = gathered
        else:
            self.rank_buffers = [mine]


class BNBlock(torch.nn.Module):
    """``x + relu(BatchNorm1d(Linear(x)))``: a graphable layer with running statistics (buffers)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.bn = torch.nn.BatchNorm1d(d)

    def forward(self, x):
        return x + torch.relu(self.bn(self.fc(x)))


class BNLightningModule(LightningModule):
    """An input projection, two :class:`BNBlock` s in ``self.blocks`` (graph them with ``"blocks.*"``) and a
    regression head; SGD with momentum."""

    def __init__(self, d_in: int = 8, d: int = 16, n: int = 2, lr: float = 0.05) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(d_in, d)
        self.blocks = torch.nn.ModuleList([BNBlock(d) for _ in range(n)])
        self.head = torch.nn.Linear(d, 1)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return torch.nn.functional.mse_loss(self.head(h), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class BNData(LightningDataModule):
    """160 samples; odd samples are shifted by +2 and scaled by 3, so under a ``DistributedSampler`` (even
    indices to rank 0, odd to rank 1) the two ranks see data with different statistics."""

    def train_dataloader(self):
        g = torch.Generator().manual_seed(11)
        x = torch.randn(160, 8, generator=g)
        odd = torch.arange(160) % 2 == 1
        x[odd] = 3 * x[odd] + 2
        y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(160, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


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
    ap.add_argument("--gradient-clip-val", type=float, default=None)
    ap.add_argument("--gradient-clip-algorithm", default=None, choices=[None, "norm", "value"])
    ap.add_argument("--warmup-lr-steps", type=int, default=0, help="GPT only: per-step linear LR warmup (LambdaLR)")
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
    ap.add_argument("--model", default="gpt", choices=["gpt", "seed", "bn"],
                    help="gpt: the example GPT on text; seed: Megatron-LM PR #6373's CheckpointWithoutOutput layer; "
                         "bn: two Linear+BatchNorm1d blocks (graphed as 'blocks.*') on rank-dependent data")
    ap.add_argument("--no-broadcast-buffers", action="store_true",
                    help="cudagraph_ddp only: ddp.broadcast_buffers=False")
    ap.add_argument("--direct-grad-ready", action="store_true", help="cudagraph_ddp only: graphs.direct_grad_ready=True")
    ap.add_argument("--segments", action="store_true", help="cudagraph_ddp only: graphs.segments=True")
    ap.add_argument("--whole-step", default="auto", choices=["auto", "true", "false"],
                    help="cudagraph_ddp only: graphs.whole_step (auto: unset, the default)")
    ap.add_argument("--no-graphs", action="store_true",
                    help="cudagraph_ddp only: graphs.enabled=False (our DDP engine alone, every layer eager)")
    ap.add_argument("--deterministic", action="store_true",
                    help="Trainer(deterministic=True): deterministic kernels, to tell kernel noise from engine errors")
    ap.add_argument("--sdpa", default=None, choices=["math", "flash", "efficient", "cudnn"],
                    help="restrict scaled_dot_product_attention to one backend (kernel-choice diagnostics)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    seed_everything(a.seed, workers=True)
    if a.model == "gpt":
        model = GPTLightningModule(
            n_layer=a.n_layer, d_model=a.d_model, n_head=a.n_head, block_size=a.block_size, lr=3e-3,
            tie_weights=a.tie_weights, bias=not a.no_bias, recompute_loss=a.recompute_loss, recompute_blocks=a.recompute_blocks,
            block_schedule=None if a.block_schedule is None else [int(i) for i in a.block_schedule.split(",")],
            warmup_lr_steps=a.warmup_lr_steps,
        )
        data = TextDataModule(block_size=a.block_size, batch_size=a.batch_size, max_bytes=300_000)
    elif a.model == "bn":
        model, data = BNLightningModule(), BNData()
    else:
        model, data = SeedLightningModule(), SeedData()
    if a.strategy == "cudagraph_ddp":
        graphs = {"warmup_steps": a.warmup_steps, "backend": a.backend}
        if a.direct_grad_ready:
            graphs["direct_grad_ready"] = True
        if a.segments:
            graphs["segments"] = True
        if a.whole_step != "auto":
            graphs["whole_step"] = a.whole_step == "true"
        if a.no_graphs:
            graphs = {"enabled": False}
        if a.model == "bn":
            graphs["layers"] = ["blocks.*"]
        strategy = cg_lightning.CUDAGraphDDPStrategy(
            graphs=graphs, ddp={"timeout_s": a.timeout_s, "broadcast_buffers": not a.no_broadcast_buffers}
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
    bufs = BufferGatherer()
    norms = GradNormRecorder()
    trainer = Trainer(
        accelerator=a.accelerator, devices=a.devices, num_nodes=a.num_nodes, strategy=strategy, precision=a.precision,
        max_steps=a.steps, accumulate_grad_batches=a.accumulate, gradient_clip_val=a.gradient_clip_val,
        gradient_clip_algorithm=a.gradient_clip_algorithm, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[rec, counts, bufs, norms], deterministic=a.deterministic or None,
    )
    sdpa = "math" if a.deterministic else a.sdpa  # fused attention backwards accumulate with atomics
    if sdpa is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[sdpa]
        with sdpa_kernel(backend):
            trainer.fit(model, datamodule=data)
    else:
        trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        stats = None
        strat = trainer.strategy
        if isinstance(strat, cg_lightning.CUDAGraphDDPStrategy) and strat.last_graph_stats is not None:
            stats = dict(vars(strat.last_graph_stats))
        step_stats = None
        if isinstance(strat, cg_lightning.CUDAGraphDDPStrategy) and strat.last_step_graph_stats is not None:
            step_stats = dict(vars(strat.last_step_graph_stats))
        torch.save(
            {
                "losses": rec.losses,
                "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                "stats": stats,
                "step_stats": step_stats,
                "ready_counts": counts.counts,
                "rank_buffers": bufs.rank_buffers,
                "grad_norms": norms.norms,
            },
            a.out,
        )


if __name__ == "__main__":
    main()
    # Lightning destroys the process group at exit for NCCL only; a gloo group left to interpreter shutdown
    # aborts the process now and then on torch 2.13 ("terminate called without an active exception").
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
