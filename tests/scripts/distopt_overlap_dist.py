"""Multi-process runs of ``ddp.overlap_param_gather`` for ``tests/test_distopt_overlap.py`` (torchrun, gloo).

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/distopt_overlap_dist.py --out DIR [--short]

A small model (an input ``nn.Linear``, three graphed blocks, a head, and a weight read by the root's forward from a
module that never runs) trains a few steps with the distributed optimizer, fused AdamW and clipping by norm, through
the lifecycle driver (graphs with and without segments, no graphs, the option off), ``CUDAGraphAccelerator`` and,
without ``--short``, Lightning (against Lightning ``"ddp"``, with a validation and a checkpoint after every second
step).
Torch DDP runs the same steps as the reference. Right after one step the loop takes a ``state_dict`` and right after
another it runs an eval forward. Every run records, in order: the all-gathers started and waited for (the engine's
``ParamGather.observer``), the step's begin and end, and each read of a module's parameters (a forward pre-hook after
the engine's on the eager modules, a call inside the blocks' forward, which the eager graph backend runs at every
replay, a ``state_dict`` pre-hook) with the buckets still pending then. Each rank writes ``DIR/rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

D_IN, D, STEPS, CLIP, LR = 6, 8, 6, 0.05, 0.02
STATE_AFTER, EVAL_AFTER = 2, 3  # the loop's state_dict / eval forward right after these steps
DDP = {"distributed_optimizer": True, "bucket_size_mb": 1e-6}  # one parameter a bucket
EVENTS: list = []
GATHER: list = []  # the ParamGather of the run being recorded
INLINE = [True]  # the blocks record their reads themselves (graphed: a replay runs the whole forward at once)


def read(name: str, module: nn.Module) -> None:
    """Record a read of ``module``'s parameters with the buckets of them still pending."""
    if GATHER:
        gather = GATHER[0]
        pending = sorted({gather.bucket_of[p] for p in module.parameters() if gather.is_pending(gather.bucket_of[p])})
        EVENTS.append(("read", name, pending))


class Block(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if INLINE[0]:
            read(self.name, self)
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList([Block(f"block{i}") for i in range(3)])
        self.head = nn.Linear(D, 1)
        self.side = nn.Linear(D, 1)  # never called: its weight is read by the root's forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        read("side", self.side)
        return self.head(h) + F.linear(h, self.side.weight, self.side.bias)


def net() -> Net:
    torch.manual_seed(0)
    return Net()


def data(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(4, D_IN, generator=g) for _ in range(STEPS)]
    return xs, [torch.sin(x.sum(1, keepdim=True)) for x in xs], torch.randn(4, D_IN, generator=g)


def probe(model: Net, gather, graphed: bool = True) -> None:
    """Record reads: pre-hooks on the eager modules (after the engine's; without graphs also on the blocks' layers,
    whose own forward then reads nothing before calling them), a state_dict pre-hook on the root."""
    GATHER[:] = [gather]
    EVENTS.clear()
    INLINE[0] = graphed
    gather.observer = lambda kind, bucket: EVENTS.append((kind, bucket))
    eager = [("inp", model.inp), ("head", model.head)]
    eager += [] if graphed else [(block.name, block.fc) for block in model.blocks]
    for name, module in eager:
        module.register_forward_pre_hook(lambda m, args, name=name: read(name, m))
    model.register_state_dict_pre_hook(lambda m, *a: read("state_dict", m))


def result(model: Net, gather, losses, state, evaluated, stats=None) -> dict:
    buckets = {n: gather.bucket_of[p] for n, p in model.named_parameters()}
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "state": state, "eval": evaluated, "events": list(EVENTS), "buckets": buckets,
            "synchronous": sorted(gather.synchronous), "order": list(gather.order), "stats": stats}


def after_step(model, step, state, evaluated, call):
    """The loop's reads right after a step: a state_dict, an eval forward (``call``), with gathers pending."""
    if step == STATE_AFTER:
        EVENTS.append(("pending", GATHER[0].pending if GATHER else 0))
        state.update({k: v.clone() for k, v in model.state_dict().items()})
    if step == EVAL_AFTER:
        EVENTS.append(("pending", GATHER[0].pending if GATHER else 0))
        model.eval()
        with torch.no_grad():
            evaluated.append(call().clone())
        model.train()


def run_driver(rank: int, graphs, overlap: bool = True) -> dict:
    from cg_lightning.ddp import DDPOptions
    from cg_lightning.graphs import GraphOptions
    from cg_lightning.lifecycle import TrainingDriver, apply_data_parallel, apply_graphs
    from cg_lightning.optim.sharded_optimizer import clip_grad_norm_

    model = net()
    options = GraphOptions(**graphs) if graphs is not None else GraphOptions(enabled=False)
    manager = apply_graphs(model, options, torch.device("cpu"))
    engine = apply_data_parallel(model, DDPOptions(**DDP, overlap_param_gather=overlap), graph_manager=manager)
    driver = TrainingDriver(options, manager, engine)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)
    sharded = driver.shard_optimizer(opt)
    probe(model, engine.param_gather, graphed=manager is not None)
    xs, ys, xv = data(rank)
    losses, state, evaluated = [], {}, []
    for step, (x, y) in enumerate(zip(xs, ys)):
        driver.begin_micro_batch(step)
        loss = F.mse_loss(engine(x), y)
        driver.end_forward()
        driver.before_backward(loss)
        EVENTS.append(("backward", step))
        loss.backward()
        driver.after_backward(completes_step=True)
        clip_grad_norm_([sharded], CLIP)
        EVENTS.append(("step_begin", step))
        with driver.stepping(opt):
            opt.step()
        EVENTS.append(("step_end", step))
        driver.after_optimizer_step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        after_step(model, step, state, evaluated, lambda: engine(xv))
    stats = vars(manager.stats).copy() if manager is not None else None
    driver.close()
    return result(model, engine.param_gather, losses, state, evaluated, stats)


def run_accelerate(rank: int) -> dict:
    from cg_lightning.accelerate import CUDAGraphAccelerator

    accelerator = CUDAGraphAccelerator(cpu=True, graphs={"warmup_steps": 1, "backend": "eager"}, ddp=DDP)
    raw = net()
    model, opt = accelerator.prepare(raw, torch.optim.AdamW(raw.parameters(), lr=LR, weight_decay=0.1, fused=True))
    probe(raw, model.param_gather)
    xs, ys, xv = data(rank)
    losses, state, evaluated = [], {}, []
    for step, (x, y) in enumerate(zip(xs, ys)):
        loss = F.mse_loss(model(x), y)
        EVENTS.append(("backward", step))
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), CLIP)
        EVENTS.append(("step_begin", step))
        opt.step()
        EVENTS.append(("step_end", step))
        opt.zero_grad()
        losses.append(float(loss.detach()))
        after_step(raw, step, state, evaluated, lambda: model(xv))
    stats = vars(model.graph_stats).copy()
    gather = model.param_gather
    accelerator.end_training()
    return result(raw, gather, losses, state, evaluated, stats)


def run_torch_ddp(rank: int) -> dict:
    model = net()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)
    xs, ys, xv = data(rank)
    losses, state, evaluated = [], {}, []
    GATHER.clear()
    for step, (x, y) in enumerate(zip(xs, ys)):
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        after_step(model, step, state, evaluated, lambda: model(xv))
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "state": state, "eval": evaluated}


def run_lightning(strategy, folder: str) -> dict:
    from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1, fused=True)

    class Record(Callback):
        def __init__(self) -> None:
            self.val, self.saved = [], []

        def on_train_start(self, trainer, module):
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:
                probe(module.net, engine.param_gather)
                module.register_state_dict_pre_hook(lambda m, *a: read("state_dict", m.net))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            EVENTS.append(("batch_end", batch_idx, GATHER[0].pending if GATHER else 0))  # before a checkpoint

        def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
            self.val.append(float(outputs))

        def on_save_checkpoint(self, trainer, module, checkpoint):
            self.saved.append({k: v.clone() for k, v in checkpoint["state_dict"].items()})

    seed_everything(3, verbose=False)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, D_IN, generator=g)
    train = DataLoader(TensorDataset(x, torch.sin(x.sum(1, keepdim=True))), batch_size=4)
    val = DataLoader(TensorDataset(x[:8], torch.cos(x[:8].sum(1, keepdim=True))), batch_size=4)
    record, module = Record(), Module()
    GATHER.clear()
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_steps=STEPS,
                      logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      val_check_interval=2, limit_val_batches=1, gradient_clip_val=CLIP, default_root_dir=folder,
                      callbacks=[record, ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)])
    trainer.fit(module, train, val)
    gather = GATHER[0] if GATHER else None
    return {"val": record.val, "saved": record.saved, "events": list(EVENTS) if gather else [],
            "buckets": {n: gather.bucket_of[p] for n, p in module.named_parameters()} if gather else {},
            "weights": {k: v.detach().clone() for k, v in module.state_dict().items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--short", action="store_true", help="the driver runs only")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {"torch_ddp": run_torch_ddp(rank),
           "plain": run_driver(rank, {"warmup_steps": 1, "backend": "eager", "segments": False}),
           "segments": run_driver(rank, {"warmup_steps": 1, "backend": "eager"}),
           "eager": run_driver(rank, None),
           "off": run_driver(rank, {"warmup_steps": 1, "backend": "eager", "segments": False}, overlap=False)}
    if not a.short:
        import cg_lightning

        strategy = cg_lightning.CUDAGraphDDPStrategy(graphs={"warmup_steps": 1}, ddp=DDP)
        out["lightning_ddp"] = run_lightning("ddp", os.path.join(a.out, "ddp"))
        out["lightning_cg"] = run_lightning(strategy, os.path.join(a.out, "cg"))
        out["accelerate"] = run_accelerate(rank)  # last: Accelerate's end_training destroys the process group
    torch.save(out, os.path.join(a.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
