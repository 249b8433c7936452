"""Train the example GPT in a Lightning Fabric loop, under ``strategy="cudagraph_ddp"`` or (``--strategy ddp``)
Fabric's own DDP, on random tokens: accumulation with ``fabric.no_backward_sync``, clipping with
``fabric.clip_gradients``, a checkpoint with ``fabric.save`` at the end.

CPU, one or two processes (graphs on the eager backend)::

    python examples/train_fabric.py --accelerator cpu --devices 2 --steps 20
    torchrun --nproc_per_node 2 examples/train_fabric.py --accelerator cpu --devices 2 --steps 20

One GPU, CUDA graphs, bf16 autocast::

    python examples/train_fabric.py --precision bf16-mixed --steps 100

Under ``fabric run`` leave the strategy, devices and precision to its own options and pass ``--no-launch``
(``fabric run --accelerator cuda --devices 2 examples/train_fabric.py --no-launch``). Rank 0 prints the loss every
``--log-every`` steps and the graph counters at the end.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from cg_lightning.examples.gpt import GPT  # noqa: E402  (importing cg_lightning registers "cudagraph_ddp" with Fabric)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategy", default="cudagraph_ddp", help="cudagraph_ddp (default) or ddp, the reference")
    ap.add_argument("--accelerator", default="auto")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--precision", default="32-true", help="32-true, bf16-mixed or 16-mixed")
    ap.add_argument("--steps", type=int, default=50, help="optimizer steps")
    ap.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--checkpoint", default=None, help="file for fabric.save at the end (default: none)")
    ap.add_argument("--no-launch", action="store_true", help="started by `fabric run`: do not call fabric.launch()")
    a = ap.parse_args(argv)
    if a.no_launch:
        fabric = Fabric()
    else:
        fabric = Fabric(accelerator=a.accelerator, devices=a.devices, strategy=a.strategy, precision=a.precision)
        fabric.launch()
    fabric.seed_everything(0)
    model = GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, d_model=128)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = fabric.setup(model, optimizer)
    tokens = torch.randint(0, 256, (a.steps * a.accumulate * a.batch_size, 65),
                           generator=torch.Generator().manual_seed(fabric.global_rank))
    for step in range(a.steps):
        for micro in range(a.accumulate):
            i = (step * a.accumulate + micro) * a.batch_size
            batch = tokens[i:i + a.batch_size].to(fabric.device)
            with fabric.no_backward_sync(model, enabled=micro < a.accumulate - 1):
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
                fabric.backward(loss / a.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % a.log_every == 0 or step == a.steps - 1:
            fabric.print(f"step {step}: loss {loss.item():.4f}")
    stats = getattr(model._forward_module, "graph_stats", None)
    if stats is not None:
        fabric.print(f"graphed calls {stats.captured_runners}, forward replays {stats.forward_replays}")
    if a.checkpoint:
        fabric.save(a.checkpoint, {"model": model, "optimizer": optimizer, "step": a.steps})


if __name__ == "__main__":
    main()
