"""Host time per phase of a Lightning training step, without a profiler's overhead.

On a GPU, from the repository root::

    python -m benchmarks.diagnostics.host_phases --size tiny --peer cudagraph_ddp

A launch-bound step is as long as the host's work for it (the device waits on the host), and a profiler
inflates exactly that work (CUPTI adds host time to every launch, ``cProfile`` to every Python call). Here
``time.perf_counter`` marks at Lightning's hooks split each step, after ``--warmup`` steps, into: batch
fetch and transfer + loop (``loop``), ``training_step`` (``forward``), ``backward`` (the ``loss.backward()``
call, whose host work ends when the autograd engine has run every node on the host), the gap to
``on_before_optimizer_step`` (``after_backward``: the strategy's grad sync/exposure), and the optimizer step
and zero_grad (``optimizer``). Calls of a few functions are timed inside those phases too (host time of
``CUDAGraph.replay``, of ``SegmentFunction.apply``). No device synchronisation happens inside the window, so
a mark measures host work only; the device-synchronised wall time per step is printed next to it.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from lightning.pytorch import Callback

from benchmarks.common import SIZES, VOCAB_SIZE, RunSettings, sync
from benchmarks.models import LLAMA_VOCAB_SIZE, MODELS
from benchmarks.peers.cudagraph_ddp import GRAPHS_OF, strategy_for


class _Marks(Callback):
    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps, self.done = warmup, steps, 0
        self.step: Dict[str, float] = {}
        self.phases: Dict[str, List[float]] = collections.defaultdict(list)
        self.calls: Dict[str, float] = collections.defaultdict(float)
        self.counts: Dict[str, int] = collections.defaultdict(int)
        self.wall = (0.0, 0.0)
        self.origin = None  # (host time, device event) when the device was idle, at the window's start
        self.events: List[tuple] = []
        self.event_calls: set = set()

    @property
    def active(self) -> bool:
        return self.warmup <= self.done < self.warmup + self.steps

    def _mark(self, name: str) -> None:
        self.step[name] = time.perf_counter()
        self.event(name)

    def event(self, name: str) -> None:
        """Record a device event next to the host time: how far the device lags the host at this point."""
        if self.active and self.origin is not None:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append((name, time.perf_counter(), e))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.done == self.warmup:
            sync(pl_module.device)
            if pl_module.device.type == "cuda":
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                self.origin = (time.perf_counter(), e)
            self.wall = (time.perf_counter(), 0.0)
        if self.active and "end" in self.step:
            self.phases["loop"].append(time.perf_counter() - self.step["end"])
        self._mark("start")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._mark("before_backward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._mark("after_backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._mark("before_optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self.active:
            m = self.step
            self.phases["forward"].append(m["before_backward"] - m["start"])
            self.phases["backward"].append(m["after_backward"] - m["before_backward"])
            self.phases["after_backward"].append(m["before_optimizer"] - m["after_backward"])
            self.phases["optimizer"].append(now - m["before_optimizer"])
            self.phases["step"].append(now - m["start"])
        self.done += 1
        self.step = {"end": now}
        if self.done == self.warmup + self.steps:
            sync(pl_module.device)
            self.wall = (self.wall[0], time.perf_counter())

    def lags(self) -> Dict[str, List[float]]:
        """Per mark name: device time minus host time (us) since the window's start. About the launch latency
        (a few us) where the device waited for the host; large where the device was behind (host ahead)."""
        torch.cuda.synchronize()
        t0, e0 = self.origin
        out: Dict[str, List[float]] = collections.defaultdict(list)
        for name, t, e in self.events:
            out[name].append(1000.0 * e0.elapsed_time(e) - 1e6 * (t - t0))
        return out

    def timed(self, name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            if name in self.event_calls:
                self.event(name + " (entry)")
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.active:
                    self.calls[name] += time.perf_counter() - t
                    self.counts[name] += 1
                    if name in self.event_calls:
                        self.event(name + " (exit)")
        return wrapper


DEFAULT_TIMED = [
    "torch.cuda:CUDAGraph.replay",
    "cg_lightning.graphs.segments.node:SegmentFunction.apply",
    "cg_lightning.graphs.segments.node:SegmentFunction.forward",
    "cg_lightning.graphs.segments.node:SegmentFunction.backward",
    "cg_lightning.graphs.segments.node:launch",
    "cg_lightning.graphs.segments.node:follow",
    "cg_lightning.graphs.manager:GraphManager._dispatch",
    "cg_lightning.graphs.replay.set_replay:SetReplay.call",
    "cg_lightning.graphs.replay.set_replay:_members_match",
    "cg_lightning.graphs.segments.dispatch:follow",
    "cg_lightning.graphs.call_settings:CapturedSettings.match",
    "cg_lightning.graphs.manager:GraphManager.begin_step",
    "cg_lightning.graphs.manager:GraphManager.before_backward",
    "cg_lightning.graphs.replay.runner:LayerGraphRunner.replay_forward",
    "cg_lightning.graphs.replay.runner:LayerGraphRunner.replay_backward",
    "cg_lightning.ddp.engine:DataParallelEngine.forward",
    "cg_lightning.ddp.engine:DataParallelEngine.finish_grad_sync",
    "cg_lightning.ddp.engine:DataParallelEngine.expose_grads",
    "cg_lightning.ddp.engine:DataParallelEngine.zero_grad_buffer",
    "cg_lightning.ddp.engine:DataParallelEngine.dispatch_ready_prefix",
    "cg_lightning.trainer.strategy:CUDAGraphDDPStrategy.training_step",
    "cg_lightning.trainer.strategy:CUDAGraphDDPStrategy.optimizer_step",
    "cg_lightning.trainer.strategy:CUDAGraphDDPStrategy.post_backward",
    "cg_lightning.optim.fused_adam_step:CachedFusedAdamStep.step",
    "cg_lightning.examples.gpt:GPT.forward",
    "cg_lightning.examples.gpt:GPT.hidden",
    "benchmarks.common:lm_loss",
    "torch.optim.optimizer:Optimizer.zero_grad",
    "lightning.pytorch.strategies.strategy:Strategy.backward",
    "lightning.pytorch.core.module:LightningModule.backward",
]


def _patch(spec: str, marks: "_Marks"):
    """Wrap ``module:Qual.name`` with ``marks.timed``; returns what :func:`_restore` needs."""
    import importlib

    module, qual = spec.split(":")
    *path, name = qual.split(".")
    try:  # a name that this tree does not have (code moves between commits) is skipped
        owner = importlib.import_module(module)
        for part in path:
            owner = getattr(owner, part)
        getattr(owner, name)
    except (ImportError, AttributeError):
        print(f"host_phases: {spec} not found here; not timed", file=sys.stderr)
        return None
    raw = vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name)
    if isinstance(raw, staticmethod):
        new = staticmethod(marks.timed(qual, raw.__func__))
    elif isinstance(raw, classmethod) or raw is None:  # inherited classmethod (Function.apply): bind it
        new = marks.timed(qual, getattr(owner, name))
    else:
        new = marks.timed(qual, raw)
    setattr(owner, name, new)
    return owner, name, raw


def _restore(patched) -> None:
    for owner, name, raw in reversed([p for p in patched if p is not None]):
        if raw is None:
            delattr(owner, name)  # it was inherited
        else:
            setattr(owner, name, raw)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.diagnostics.host_phases", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--model", default="gpt", choices=MODELS)
    ap.add_argument("--peer", default="cudagraph_ddp", choices=[*GRAPHS_OF, "lightning_ddp"])
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--events", nargs="*", default=["launch", "SegmentFunction.backward", "CUDAGraph.replay"],
                    help="timed calls that also record a device event at entry and exit (see the lag table)")
    ap.add_argument("--time", nargs="*", default=DEFAULT_TIMED, metavar="MODULE:QUALNAME",
                    help="functions or methods whose calls are timed (inclusive host time)")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: only to try the script
    import benchmarks.peers._lightning as lit

    s = RunSettings(device=device, size_name=a.size, size=SIZES[a.size], model=a.model,
                    vocab_size=LLAMA_VOCAB_SIZE if a.model == "llama" else VOCAB_SIZE,
                    warmup=a.warmup + a.steps + 1, steps=1, repeats=1)
    marks = _Marks(a.warmup, a.steps)
    marks.event_calls = set(a.events)
    originals = [_patch(spec, marks) for spec in a.time]
    try:
        lit.fit_timed(s, strategy_for(a.peer, model=a.model), callbacks=[marks])
    finally:
        _restore(originals)
    wall_us = 1e6 * (marks.wall[1] - marks.wall[0]) / a.steps
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"# host time per phase: {a.peer}, size {a.size}, {where}, torch {torch.__version__}")
    print(f"device-synchronised wall time: {wall_us:.0f} us/step over {a.steps} steps\n")
    print("| phase | median us | mean us |\n| --- | ---: | ---: |")
    for name in ("loop", "forward", "backward", "after_backward", "optimizer", "step"):
        v = marks.phases[name]
        print(f"| {name} | {1e6 * statistics.median(v):.0f} | {1e6 * statistics.mean(v):.0f} |")
    print("\n| timed call (inclusive) | us per step | calls per step |\n| --- | ---: | ---: |")
    for name, total in sorted(marks.calls.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {1e6 * total / a.steps:.0f} | {marks.counts[name] / a.steps:.1f} |")
    if marks.origin is not None:
        print("\nDevice lag behind the host at each mark (device time of an event recorded there minus the host time "
              "it was recorded at, both since the window's start): a few us = the device was waiting for the host "
              "there; more = the device was still busy with earlier work (the host was ahead).\n")
        print("| mark | median lag us | mean | min | max |\n| --- | ---: | ---: | ---: | ---: |")
        order: Dict[str, int] = {}
        for i, (n, _, _) in enumerate(marks.events):
            order.setdefault(n, i)
        lags = marks.lags()
        for name, v in sorted(lags.items(), key=lambda kv: order.get(kv[0], 1e9)):
            print(f"| {name} | {statistics.median(v):.0f} | {statistics.mean(v):.0f} | {min(v):.0f} | {max(v):.0f} |")
        print("\nlag at each step's start (us), in step order: a steady rise means the device is the bottleneck:\n"
              + " ".join(f"{x:.0f}" for x in lags["start"]))


if __name__ == "__main__":
    main()
