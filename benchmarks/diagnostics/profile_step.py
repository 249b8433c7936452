"""Where a training step's time goes under one peer: host (Python) profile and device busy time.

On a GPU, from the repository root::

    python -m benchmarks.diagnostics.profile_step --size tiny --peer cudagraph_ddp --out benchmarks/results

Runs the Lightning peer (``cudagraph_ddp`` or ``lightning_ddp``) of :mod:`benchmarks.step_time` and, over
``--steps`` steps after ``--warmup``: (1) ``cProfile`` of the host thread, top functions by own time
(``tottime``) and cumulative time; (2) ``torch.profiler`` over the same number of further steps: summed
CUDA kernel time per step (device busy time) next to wall time per step. When wall time is far above the
device time the step is launch/host bound, and the host profile says where that time goes. Writes
``profile_<peer>_<size>_<gpu>_<yyyymmdd>.txt`` in ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from lightning.pytorch import Callback

from benchmarks.common import SIZES, VOCAB_SIZE, RunSettings, sync
from benchmarks.peers.cudagraph_ddp import GRAPHS_OF, strategy_for


class _Profiles(Callback):
    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.done = 0
        self.cprof = cProfile.Profile()
        self.torch_prof = None
        self.marks = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.done == self.warmup:
            sync(pl_module.device)
            self.marks["host_start"] = time.perf_counter()
            self.cprof.enable()
        if self.done == self.warmup + self.steps:
            self.cprof.disable()
            sync(pl_module.device)
            self.marks["host_end"] = time.perf_counter()
            self.torch_prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                                 torch.profiler.ProfilerActivity.CUDA])
            self.torch_prof.__enter__()
            self.marks["dev_start"] = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.done += 1
        if self.done == self.warmup + 2 * self.steps and self.torch_prof is not None:
            sync(pl_module.device)
            self.marks["dev_end"] = time.perf_counter()
            self.torch_prof.__exit__(None, None, None)


def _device_busy_us(events) -> float:
    """Microseconds during which at least one kernel or copy ran on the device (intervals merged)."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    busy, cur_start, cur_end = 0.0, None, None
    for start, end in spans:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        busy += cur_end - cur_start
    return busy


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.diagnostics.profile_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--peer", default="cudagraph_ddp", choices=[*GRAPHS_OF, "lightning_ddp"])
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--trace", action="store_true",
                    help="also export the torch.profiler Chrome trace and print its idle gaps (benchmarks.diagnostics.trace_gaps)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_step needs a CUDA GPU")
    import benchmarks.peers._lightning as lit

    s = RunSettings(device=torch.device("cuda"), size_name=a.size, size=SIZES[a.size], vocab_size=VOCAB_SIZE,
                    warmup=a.warmup + 2 * a.steps, steps=1, repeats=1)
    prof = _Profiles(a.warmup, a.steps)
    lit.fit_timed(s, strategy_for(a.peer), callbacks=[prof])
    host_ms = 1000 * (prof.marks["host_end"] - prof.marks["host_start"]) / a.steps
    wall_ms = 1000 * (prof.marks["dev_end"] - prof.marks["dev_start"]) / a.steps
    events = prof.torch_prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    busy_us = _device_busy_us(prof.torch_prof.events())
    buf = io.StringIO()
    from benchmarks import report

    env = report.environment(torch.device("cuda"))
    command = " ".join(["python", "-m", "benchmarks.diagnostics.profile_step", *(sys.argv[1:] if argv is None else argv)])
    print(f"# {report.stamp(env)}\n# command: {command}", file=buf)
    print(f"# profile of {a.peer}, size {a.size} ({SIZES[a.size]}), {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}", file=buf)
    print(f"wall ms/step under cProfile: {host_ms:.2f}; under torch.profiler: {wall_ms:.2f}; "
          f"device busy per step (union of kernel and copy intervals, all streams): {busy_us / 1000 / a.steps:.2f} ms; "
          f"summed kernel time per step: {kernel_us / 1000 / a.steps:.2f} ms (overlapping streams counted twice)",
          file=buf)
    for key in ("tottime", "cumulative"):
        print(f"\n## host functions by {key} ({a.steps} steps)\n", file=buf)
        pstats.Stats(prof.cprof, stream=buf).sort_stats(key).print_stats(a.top)
    print("\n## torch.profiler, top CPU ops by self time\n", file=buf)
    print(events.table(sort_by="self_cpu_time_total", row_limit=25), file=buf)
    os.makedirs(a.out, exist_ok=True)
    if a.trace:
        from benchmarks.diagnostics.trace_gaps import analyse

        trace = os.path.join(a.out, report.result_name(f"trace_{a.peer}", a.size, report.machine_slug(env), "json",
                                                        env["date"]))
        prof.torch_prof.export_chrome_trace(trace)
        print("\n" + analyse(trace, a.steps, 5.0), file=buf)
    text = buf.getvalue()
    path = os.path.join(a.out, report.result_name(f"profile_{a.peer}", a.size, report.machine_slug(env), "txt",
                                                   env["date"]))
    prof.cprof.dump_stats(path[:-4] + ".pstats")  # for pstats.Stats(...).print_callers() elsewhere
    with open(path, "w") as f:
        f.write(text)
    print(text[:6000])
    if a.trace:
        print(text[text.index("# device timeline"):][:6000])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
