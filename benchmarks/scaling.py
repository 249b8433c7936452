"""Step time and throughput on 1 and N GPUs: Lightning ``"ddp"`` eager beside ``"cudagraph_ddp"``.

On a machine with 2 GPUs, from the repository root::

    python benchmarks/scaling.py --size tiny --strategy cudagraph_ddp --devices 2

Weak scaling: every rank trains on its own batch of ``B`` sequences per step (the benchmark's random-token
batches, bf16-mixed, fused AdamW), so tokens per second on N GPUs is ``N * B * T / step time``. Rank 0 times
``--repeats`` windows of ``--steps`` steps after ``--warmup`` and appends one JSON line (median ms/step,
tokens/s, versions, commit, command) to ``--out`` (default ``benchmarks/results/scaling_<size>_<gpu>_<yyyymmdd>.jsonl``,
``<gpu>`` as ``H200x2`` on a machine with two). ``python benchmarks/scaling.py --report FILE.jsonl`` prints a Markdown table with
weak-scaling efficiency (tokens/s on N GPUs over N times that on 1 GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning
import torch
from lightning.pytorch import Trainer, seed_everything

from benchmarks import report
from benchmarks.common import SIZES, VOCAB_SIZE, BatchDataset, RunSettings, make_batches


def _measure(a) -> None:
    from benchmarks.peers._lightning import BenchGPTModule, StepClock

    s = RunSettings(device=torch.device("cuda"), size_name=a.size, size=SIZES[a.size], vocab_size=VOCAB_SIZE,
                    warmup=a.warmup, steps=a.steps, repeats=a.repeats)
    seed_everything(s.seed, verbose=False)
    module = BenchGPTModule(**s.gpt_kwargs(), lr=s.lr, weight_decay=s.weight_decay, betas=s.betas)
    module.bench_settings = s
    loader = torch.utils.data.DataLoader(BatchDataset(make_batches(s), s.total_steps), batch_size=None)
    if a.strategy == "cudagraph_ddp":
        import cg_lightning

        strategy = cg_lightning.CUDAGraphDDPStrategy(graphs={"warmup_steps": 2})
    else:
        strategy = "ddp"
    clock = StepClock(s)
    trainer = Trainer(accelerator="gpu", devices=a.devices, strategy=strategy, precision="bf16-mixed",
                      max_steps=s.total_steps, max_epochs=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, callbacks=[clock], use_distributed_sampler=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(module, train_dataloaders=loader)
    if trainer.is_global_zero:
        ms = clock.timing().ms_per_step
        med = statistics.median(ms)
        tokens = a.devices * s.size["batch_size"] * s.size["block_size"]
        row = dict(size=a.size, strategy=a.strategy, devices=a.devices, ms_per_step=med, min_ms=min(ms),
                   max_ms=max(ms), tokens_per_s=tokens / (med / 1000), gpu=torch.cuda.get_device_name(),
                   torch=torch.__version__, lightning=lightning.__version__,
                   commit=(report.environment(torch.device("cuda"))["cg_lightning"]["commit"] or "unknown")[:12],
                   command=" ".join(["python", "benchmarks/scaling.py", *a.argv]))
        out = a.out or os.path.join(report.ROOT, "benchmarks", "results", report.result_name(
            "scaling", a.size, report.gpu_slug(torch.cuda.get_device_name(), torch.cuda.device_count()), "jsonl"))
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row))


def _report(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    one = {(r["size"], r["strategy"]): r for r in rows if r["devices"] == 1}
    print(f"GPU: {rows[0]['gpu']}, torch {rows[0]['torch']}\n")
    print("| size | strategy | GPUs | ms/step (median) | tokens/s | weak-scaling efficiency |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in sorted(rows, key=lambda r: (list(SIZES).index(r["size"]), r["strategy"], r["devices"])):
        base = one.get((r["size"], r["strategy"]))
        eff = f"{r['tokens_per_s'] / (r['devices'] * base['tokens_per_s']):.2f}" if base else "-"
        print(f"| {r['size']} | {r['strategy']} | {r['devices']} | {r['ms_per_step']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {eff} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", choices=list(SIZES))
    ap.add_argument("--strategy", default="cudagraph_ddp", choices=["ddp", "cudagraph_ddp"])
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON-lines file to append to (default: named by the rule of "
                    "benchmarks/README.md in benchmarks/results/)")
    ap.add_argument("--report", default=None, metavar="FILE", help="print the table of a results file and exit")
    a = ap.parse_args(argv)
    a.argv = sys.argv[1:] if argv is None else list(argv)
    if a.report:
        _report(a.report)
    else:
        _measure(a)


if __name__ == "__main__":
    main()
