"""What the device does per training step under one peer, and how long it idles: ``torch.profiler`` with
device activity only, over ``--steps`` steady-state steps, summarised by :mod:`benchmarks.diagnostics.trace_gaps`.

On a GPU, from the repository root::

    python -m benchmarks.diagnostics.device_work --size tiny --peers whole_step_graph cudagraph_ddp compile_reduce_overhead

Comparing a peer with ``whole_step_graph`` (the same kernels in one graph) separates extra device work
(copies, ``main_grad`` additions, memsets: more operations or more busy time) from idle time (gaps).

``--host-ahead-ms``: a ``torch.cuda._sleep`` of that long is put in front of the window, so the host queues the
window's steps while the device sleeps (the profiler's own host overhead then cannot starve the device); the
report starts after the sleep kernel: the device's own time per step, with the gaps that remain when it never
waits for the host.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from lightning.pytorch import Callback

from benchmarks.common import SIZES, VOCAB_SIZE, RunSettings, sync
from benchmarks.diagnostics.trace_gaps import analyse
from benchmarks.models import LLAMA_VOCAB_SIZE, MODELS


def _profiler():
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])


_CYCLES_PER_MS = 2_000_000  # torch.cuda._sleep counts clock cycles; about 2 GHz


def _sleep(ms: float) -> None:
    if ms > 0:
        torch.cuda._sleep(int(ms * _CYCLES_PER_MS))


class _Window(Callback):
    def __init__(self, warmup: int, steps: int, ahead_ms: float = 0.0) -> None:
        self.warmup, self.steps, self.done, self.prof, self.ahead_ms = warmup, steps, 0, None, ahead_ms

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.done == self.warmup:
            sync(pl_module.device)
            self.prof = _profiler()
            self.prof.__enter__()
            _sleep(self.ahead_ms)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.done += 1
        if self.done == self.warmup + self.steps:
            sync(pl_module.device)
            self.prof.__exit__(None, None, None)


#: peers timed by a plain loop (``benchmarks.common.time_loop``): profiled by swapping their module's loop
_PLAIN_LOOP = ("whole_step_graph", "compile_reduce_overhead", "compile_default", "torch_ddp", "torch_ddp_graphed")


def _plain_loop(s: RunSettings, peer_name: str, warmup: int, steps: int, ahead_ms: float = 0.0):
    import importlib

    peer = importlib.import_module(f"benchmarks.peers.{peer_name}")
    box = {}

    def time_loop(step, batches, _s):
        for i in range(warmup):
            loss = step(batches[i % len(batches)])
        sync(s.device)
        with _profiler() as prof:
            _sleep(ahead_ms)
            for i in range(steps):
                loss = step(batches[i % len(batches)])
            sync(s.device)
        box["prof"] = prof
        from benchmarks.common import LoopTiming
        return LoopTiming([1.0], 0.0, [], loss)

    original = peer.time_loop
    peer.time_loop = time_loop
    try:
        peer.run(s)
    finally:
        peer.time_loop = original
    return box["prof"]


def _lightning(s: RunSettings, peer: str, warmup: int, steps: int, ahead_ms: float = 0.0):
    import benchmarks.peers._lightning as lit
    from benchmarks.peers.cudagraph_ddp import strategy_for

    window = _Window(warmup, steps, ahead_ms)
    lit.fit_timed(s, strategy_for(peer, model=s.model), callbacks=[window])
    return window.prof


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.diagnostics.device_work", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--model", default="gpt", choices=MODELS)
    ap.add_argument("--peers", nargs="+", default=["whole_step_graph", "cudagraph_ddp"])
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"),
                    help="folder for device_work_<size>_<gpu>_<yyyymmdd>.txt (default benchmarks/results)")
    ap.add_argument("--host-ahead-ms", type=float, default=0.0)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("device_work needs a CUDA GPU")
    os.makedirs(a.out, exist_ok=True)
    from benchmarks import report

    env = report.environment(torch.device("cuda"))
    what = "device_work" + ("-llama" if a.model == "llama" else "")
    path = os.path.join(a.out, report.result_name(what, a.size, report.machine_slug(env), "txt", env["date"]))
    command = " ".join(["python", "-m", "benchmarks.diagnostics.device_work", *(sys.argv[1:] if argv is None else argv)])
    sections = [f"# {report.stamp(env)}\n# command: {command}\n"]
    for peer in a.peers:
        s = RunSettings(device=torch.device("cuda"), size_name=a.size, size=SIZES[a.size], model=a.model,
                        vocab_size=LLAMA_VOCAB_SIZE if a.model == "llama" else VOCAB_SIZE,
                        warmup=a.warmup + a.steps + 1, steps=1, repeats=1)
        ahead = a.host_ahead_ms
        prof = (_plain_loop(s, peer, a.warmup, a.steps, ahead) if peer in _PLAIN_LOOP
                else _lightning(s, peer, a.warmup, a.steps, ahead))
        trace = os.path.join(a.out, f"device_{peer}_{a.size}.json")
        prof.export_chrome_trace(trace)
        text = (f"\n# {peer}" + (f" (host ahead: {ahead:g} ms device sleep first)" if ahead else "") + "\n"
                + analyse(trace, a.steps, 5.0, after_kernel="spin" if ahead else ""))
        print(text)
        sections.append(text)
        os.remove(trace)
        from benchmarks.common import free_memory
        free_memory(s.device)
    with open(path, "w") as f:
        f.write("\n".join(sections) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
