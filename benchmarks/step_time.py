"""Step time of the example GPT under several training setups, side by side in one process.

    python benchmarks/step_time.py --size tiny --steps 60 --repeats 3 --out benchmarks/results

Peers (each at the same precision, model, data and optimizer):
  * ``lightning_ddp``: Lightning ``strategy="ddp"``, eager.
  * ``cudagraph_ddp``: this project's strategy with per-layer CUDA graphs.
Each peer trains ``--steps`` steps ``--repeats`` times; the time of the steps after ``--skip`` (warmup and
capture) is measured with a device synchronization at both ends. Reports the median ms/step, the ratio
to ``lightning_ddp``, peak memory and graph capture time, as JSON and Markdown naming GPU and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

import cg_lightning
from examples.data import TextDataModule
from examples.gpt import GPTLightningModule

SIZES = {
    "tiny": dict(d_model=256, n_layer=12, n_head=4, block_size=128, batch_size=8),
    "small": dict(d_model=768, n_layer=12, n_head=12, block_size=512, batch_size=8),
    "large": dict(d_model=2048, n_layer=8, n_head=16, block_size=1024, batch_size=8),
}


class StepTimer(Callback):
    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.t0 = None
        self.t1 = None
        self.steps = 0

    def _sync(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.skip and self.t0 is None:
            self._sync()
            self.t0 = time.perf_counter()
            self.first = trainer.global_step

    def on_train_end(self, trainer, pl_module):
        self._sync()
        self.t1 = time.perf_counter()
        self.steps = trainer.global_step - self.first


def run_peer(peer: str, size: dict, steps: int, skip: int, precision: str, accelerator: str) -> dict:
    seed_everything(0)
    model = GPTLightningModule(
        d_model=size["d_model"], n_layer=size["n_layer"], n_head=size["n_head"], block_size=size["block_size"],
        lr=3e-4,
    )
    data = TextDataModule(block_size=size["block_size"], batch_size=size["batch_size"], max_bytes=8_000_000)
    strategy = "ddp" if peer == "lightning_ddp" else cg_lightning.CUDAGraphDDPStrategy(graphs={"warmup_steps": 2})
    timer = StepTimer(skip)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(
        accelerator=accelerator, devices=1, strategy=strategy, precision=precision, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[timer],
    )
    trainer.fit(model, datamodule=data)
    out = {
        "ms_per_step": 1000 * (timer.t1 - timer.t0) / timer.steps,
        "peak_mem_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
    }
    if peer == "cudagraph_ddp":
        stats = strategy.last_graph_stats
        out["capture_s"] = stats.capture_seconds
        out["backend"] = stats.backend
        out["replays"] = stats.forward_replays
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--peers", default="lightning_ddp,cudagraph_ddp")
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    a = ap.parse_args(argv)
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    size = SIZES[a.size]
    results = {}
    for rep in range(a.repeats):
        for peer in a.peers.split(","):
            r = run_peer(peer, size, a.steps, a.skip, a.precision, accelerator)
            results.setdefault(peer, []).append(r)
            print(f"repeat {rep} {peer}: {r}", flush=True)
    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    import lightning

    summary = {
        "machine": machine, "torch": torch.__version__, "lightning": lightning.__version__, "size": a.size,
        "config": size, "precision": a.precision, "steps": a.steps, "skip": a.skip, "repeats": a.repeats,
        "peers": {},
    }
    base = statistics.median(r["ms_per_step"] for r in results["lightning_ddp"]) if "lightning_ddp" in results else None
    for peer, rs in results.items():
        med = statistics.median(r["ms_per_step"] for r in rs)
        summary["peers"][peer] = {
            "ms_per_step_median": med,
            "ms_per_step_all": [r["ms_per_step"] for r in rs],
            "speedup_vs_lightning_ddp": (base / med) if base else None,
            "peak_mem_mib": max((r["peak_mem_mib"] or 0) for r in rs),
            **({"capture_s": statistics.median(r["capture_s"] for r in rs), "backend": rs[0]["backend"]}
               if peer == "cudagraph_ddp" else {}),
        }
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"step_time_{a.size}_{machine.replace(' ', '_')}")
    with open(stem + ".json", "w") as f:
        json.dump(summary, f, indent=2)
    lines = [
        f"# Step time, {a.size} GPT ({size}), {a.precision}, on {machine}",
        f"torch {torch.__version__}, lightning {lightning.__version__}; median of {a.repeats} runs of "
        f"{a.steps - a.skip} timed steps",
        "",
        "| peer | ms/step (median) | runs | speedup vs Lightning ddp | peak MiB | capture s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for peer, s in summary["peers"].items():
        runs = " / ".join(f"{x:.2f}" for x in s["ms_per_step_all"])
        sp = f"{s['speedup_vs_lightning_ddp']:.2f}x" if s["speedup_vs_lightning_ddp"] else "-"
        cap = f"{s['capture_s']:.2f}" if "capture_s" in s else "-"
        lines.append(f"| {peer} | {s['ms_per_step_median']:.2f} | {runs} | {sp} | {s['peak_mem_mib']:.0f} | {cap} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
