"""Two-process scenarios for the DDP engine with graphed layers (gloo), launched by ``torch.distributed.run``.

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/engine_dist.py --scenario overlap --out DIR

Every rank writes ``DIR/rank{r}.json``: the scenario's observations (event order, error messages, seconds).
Scenarios (model: ``tests.engine_models.Stack`` of four graphed layers, eager graph backend, warmup 1 step):

* ``overlap``: tiny buckets; log grad-ready and bucket dispatch events of a replayed iteration.
* ``missing``: in iteration 2 rank 1 skips ``layers.1``; both ranks must raise ``GradSyncError``.
* ``stuck``: in iteration 2 rank 1 fails inside a graphed layer and never reaches the end of the backward
  (it waits, as a wedged rank would); rank 0 must raise within ``timeout_s``.
* ``golden``: in iteration 0 rank 1 applies ``layers.1`` twice; the golden counts differ across ranks.
* ``reduce``: ``average=True`` and ``average=False``: after ``finish_grad_sync`` every ``main_grad`` is the
  mean (sum) of the two ranks' eager gradients; the maximum relative error is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist

from cg_lightning.ddp import DataParallelEngine, DDPOptions, GradSyncError
from cg_lightning.ddp.bucket import Bucket
from cg_lightning.graphs import GraphManager, GraphOptions
from tests import engine_models as em


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", required=True, choices=["overlap", "missing", "stuck", "golden", "reduce"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout-s", type=float, default=10.0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: NCCL, one GPU per rank, real CUDA graphs (the GPU machine)")
    a = ap.parse_args()
    if a.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    if a.scenario == "reduce":
        _reduce(a, device, rank)
        return
    torch.manual_seed(0)
    model = em.Stack(em.SeedLayer, 16, 4, recompute=True).to(device)
    # "missing" skips a layer on one rank: inside a segment that rank would stop at the next layer's call
    # (SegmentError) before the engine's missing-gradient error this scenario is about. "overlap" is about
    # buckets dispatched between the layers' backward replays: a segment's backward is one graph launch, so
    # every bucket it fills goes out after it (per-layer graphs, segments=false, interleave)
    options = GraphOptions(warmup_steps=1, backend="cuda" if a.device == "cuda" else "eager", layers=["layers.*"],
                           segments=a.scenario not in ("missing", "overlap"))
    manager = GraphManager(model, options, device)
    engine = DataParallelEngine(model, DDPOptions(bucket_size_mb=16 * 17 * 4 / 2**20, timeout_s=a.timeout_s),
                                grad_accumulator_stream=getattr(manager.backend, "stream", None))
    manager.bind_grad_ready(engine.grad_ready)
    events = []
    result = {"rank": rank, "buckets": len(engine.buckets)}

    engine.ready_observer = lambda param: events.append(["ready", engine.names[param]])
    original_dispatch = Bucket.dispatch

    def logged_dispatch(self, *args, **kwargs):
        events.append(["dispatch", self.index, [engine.names[p] for p in self.params]])
        original_dispatch(self, *args, **kwargs)

    Bucket.dispatch = logged_dispatch
    g = torch.Generator().manual_seed(10 + rank)
    start = None
    try:
        for it in range(4):
            x = torch.randn(8, 16, generator=g).to(device)
            events.clear()
            manager.begin_step(it)
            if a.scenario == "missing" and it == 2 and rank == 1:
                h = model.inp(x)
                for i, layer in enumerate(model.layers):
                    if i != 1:
                        h = layer(h)
                loss = model.head(h).pow(2).mean()
            elif a.scenario == "golden" and it == 0 and rank == 1:
                h = model.inp(x)
                for i, layer in enumerate(model.layers):
                    h = layer(layer(h)) if i == 1 else layer(h)
                loss = model.head(h).pow(2).mean()
            elif a.scenario == "stuck" and it == 2 and rank == 1:
                try:
                    raise RuntimeError("simulated failure inside layers.2")
                except RuntimeError:
                    deadline = time.time() + 120
                    while time.time() < deadline and not os.path.exists(os.path.join(a.out, "rank0.json")):
                        time.sleep(0.2)
                    result["stuck"] = True
                    break
            else:
                loss = engine(x)
            loss.backward()
            manager.end_step()
            start = time.time()
            engine.finish_grad_sync()
            if a.device == "cuda":
                torch.cuda.synchronize()
            if it == 2:
                result["events"] = list(events)
                result["dispatch_order"] = engine.last_dispatch_order
            engine.zero_grad_buffer()
    except GradSyncError as exc:
        result["error"] = str(exc)
        result["error_after_s"] = time.time() - start if start is not None else None
        result["iteration"] = engine.iteration
    path = os.path.join(a.out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    if "error" not in result and not result.get("stuck"):
        dist.destroy_process_group()
    os._exit(0)  # never block on collectives another rank will not join


def _reduce(a, device, rank) -> None:
    result = {"rank": rank}
    for average in (True, False):
        torch.manual_seed(0)
        model = em.Stack(em.SeedLayer, 16, 2, recompute=False).to(device)
        ref = em.Stack(em.SeedLayer, 16, 2, recompute=False).to(device)
        ref.load_state_dict(model.state_dict())
        engine = DataParallelEngine(model, DDPOptions(bucket_size_mb=0.001, average=average, timeout_s=a.timeout_s))
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 + rank)).to(device)
        engine(x).backward()
        engine.finish_grad_sync()
        ref(x).backward()
        worst = 0.0
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            grads = [torch.zeros_like(q.grad) for _ in range(2)]
            dist.all_gather(grads, q.grad)
            expected = (grads[0] + grads[1]) / (2 if average else 1)
            worst = max(worst, float((p.main_grad - expected).norm() / expected.norm()))
        result["average" if average else "sum"] = worst
    path = os.path.join(a.out, f"rank{rank}.json")
    with open(path, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
