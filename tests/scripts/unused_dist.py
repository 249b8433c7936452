"""``ddp.find_unused_parameters`` against torch DDP's ``find_unused_parameters=True`` (gloo, CPU).

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/unused_dist.py --out DIR [--graphs]
    python tests/scripts/unused_dist.py --out DIR [--graphs]        # one process: plain PyTorch is the reference

Model: an always-used stack of two blocks, a block used every third step, a block used on rank 0 only and a
block never used; AdamW with weight decay (a zero gradient and a ``None`` one step differently). Windows of
one or two micro-batches (the first under ``no_sync``). After each window's backward, every rank writes which
``param.grad`` is ``None`` and whether values equal the reference's; at the end, whether the weights are equal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist
import torch.nn as nn

from cg_lightning.ddp import DDPOptions
from cg_lightning.graphs import GraphOptions
from cg_lightning.lifecycle import build_driver


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Branchy(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.sometimes = Block(width)
        self.rank0 = Block(width)
        self.never = Block(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x, step: int, rank: int):
        for block in self.blocks:
            x = block(x)
        if step % 3 == 0:
            x = self.sometimes(x)
        if rank == 0:
            x = self.rank0(x)
        return self.head(x).pow(2).mean()


WINDOWS = [1, 2, 1, 2, 2, 1, 1, 2]  # micro-batches per optimizer step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--graphs", action="store_true", help="graph blocks.* and sometimes (eager backend)")
    a = ap.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    ref_model, model = Branchy(), Branchy()
    model.load_state_dict(ref_model.state_dict())
    ref = nn.parallel.DistributedDataParallel(ref_model, find_unused_parameters=True) if distributed else ref_model
    graphs = GraphOptions(enabled=a.graphs, layers=["blocks.*", "sometimes"], warmup_steps=1, backend="eager",
                          segments=False)
    driver = build_driver(model, graphs, DDPOptions(find_unused_parameters=True), torch.device("cpu"))
    engine = driver.engine
    opt_ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    names = [n for n, _ in model.named_parameters()]
    gen = torch.Generator().manual_seed(100 + rank)
    report = {"rank": rank, "windows": []}
    try:
        for step, size in enumerate(WINDOWS):
            for i in range(size):
                x = torch.randn(4, 8, generator=gen)
                last = i == size - 1
                ctx_ref = contextlib.nullcontext() if last or not distributed else ref.no_sync()
                with ctx_ref:
                    ref(x, step, rank).backward()
                with contextlib.nullcontext() if last else driver.no_sync():
                    driver.begin_micro_batch(step)
                    loss = engine(x, step, rank)
                    driver.end_forward()
                    driver.before_backward(loss)
                    loss.backward()
                    driver.after_backward(completes_step=last)
            none_ref = [n for n, p in zip(names, ref_model.parameters()) if p.grad is None]
            none_got = [n for n, p in zip(names, model.parameters()) if p.grad is None]
            equal = all((p.grad is None and q.grad is None) or (p.grad is not None and q.grad is not None
                                                                 and torch.equal(p.grad, q.grad))
                        for p, q in zip(ref_model.parameters(), model.parameters()))
            report["windows"].append({"none_ref": none_ref, "none_got": none_got, "grads_equal": equal})
            opt_ref.step()
            opt_ref.zero_grad()
            with driver.stepping(opt):
                opt.step()
            driver.after_optimizer_step(zero_grad=False)
            opt.zero_grad()
        report["weights_equal"] = all(torch.equal(p, q) for p, q in zip(ref_model.parameters(), model.parameters()))
        report["replays"] = driver.graph_manager.stats.forward_replays if driver.graph_manager else 0
    except Exception as exc:  # reported, not raised: the test names it
        report["error"] = f"{type(exc).__name__}: {exc}"
    driver.close()
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
