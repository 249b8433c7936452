"""Variable-length text under graphs: graph sets, their memory and step time, with and without bucketed padding.

On a GPU, from the repository root::

    python -m benchmarks.diagnostics.varlen_pool [--steps 60] [--multiple 64] [--max-length 512]

A transformers ``LlamaForCausalLM`` (d=256, 4 layers, bf16-mixed, fused AdamW) trains on batches of 8 token
sequences of random lengths (16 plus an exponential, mean max_length/8), padded per batch to their longest (dynamic padding),
under ``cudagraph_ddp`` with ``graphs.shape_policy="recapture"``:

* ``dynamic``: padded to the longest row only, ``max_graph_sets`` = 4 (the default);
* ``bucketed``: :func:`cg_lightning.pad_to_multiple` (``--multiple``) on top, ``max_graph_sets`` = the number
  of buckets;
* ``ddp``: Lightning's ``"ddp"`` on the bucketed batches, the eager reference.

Printed: graph sets, replays, eager fallbacks, the pool's bytes (device memory the captures allocated), peak
memory and the median step time of the last half of the steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader

import cg_lightning
from cg_lightning import pad_to_multiple


class _Llama(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        import transformers

        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, use_cache=False))

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)


class _Times(Callback):
    def __init__(self) -> None:
        self.times, self.start = [], 0.0

    def on_train_batch_start(self, *args) -> None:
        torch.cuda.synchronize()
        self.start = time.perf_counter()

    def on_train_batch_end(self, *args) -> None:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.start)


def _dynamic(rows):
    """Pad to the longest row: input_ids 0, attention_mask 0, labels -100."""
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _rows(n: int, max_length: int):
    """``n`` rows of random tokens, lengths 16 + exponential (mean ``max_length / 8``), at most ``max_length``:
    most texts short, a few long."""
    g = torch.Generator().manual_seed(0)
    extra = torch.empty(n).exponential_(8 / max_length, generator=g)
    lengths = (16 + extra).clamp(max=max_length).long().tolist()
    return [torch.randint(1, 32000, (k,), generator=g).tolist() for k in lengths]


def run(name: str, steps: int, multiple: int, max_length: int):
    seed_everything(0)
    rows = _rows(8 * steps, max_length)
    buckets = -(-max_length // multiple)
    if name == "dynamic":
        collate, strategy = _dynamic, cg_lightning.CUDAGraphDDPStrategy(graphs={"shape_policy": "recapture"})
    else:
        collate = pad_to_multiple(multiple, max_length=max_length, collate_fn=_dynamic)
        strategy = "ddp" if name == "ddp" else cg_lightning.CUDAGraphDDPStrategy(
            graphs={"shape_policy": "recapture", "max_graph_sets": buckets})
    times = _Times()
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", strategy=strategy, max_steps=steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[times], use_distributed_sampler=False)
    trainer.fit(_Llama(), DataLoader(rows, batch_size=8, collate_fn=collate))
    stats = getattr(trainer.strategy, "last_graph_stats", None)
    tail = times.times[len(times.times) // 2:]
    return dict(name=name, sets=stats.graph_sets if stats else 0, replays=stats.forward_replays if stats else 0,
                fallbacks=stats.fallback_calls if stats else 0,
                pool_mib=(stats.pool_bytes if stats else 0) / 2**20,
                peak_mib=torch.cuda.max_memory_allocated() / 2**20, ms=1e3 * statistics.median(tail))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--multiple", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=512)
    a = ap.parse_args(argv)
    print(f"# variable-length batches: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{a.steps} steps of 8 rows, lengths 16 + exponential(mean {a.max_length // 8}) up to {a.max_length}, "
          f"buckets of {a.multiple}\n")
    print("| run | graph sets | replays | eager fallbacks | pool MiB | peak MiB | median ms/step (last half) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in ("ddp", "dynamic", "bucketed"):
        r = run(name, a.steps, a.multiple, a.max_length)
        print(f"| {name} | {r['sets']} | {r['replays']} | {r['fallbacks']} | {r['pool_mib']:.0f} | "
              f"{r['peak_mib']:.0f} | {r['ms']:.2f} |")


if __name__ == "__main__":
    main()
