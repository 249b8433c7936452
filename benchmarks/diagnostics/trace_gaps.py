"""Where the device waits: idle gaps and blocking runtime calls in a ``torch.profiler`` Chrome trace.

Usage (here or on the GPU machine)::

    python -m benchmarks.diagnostics.trace_gaps TRACE.json [--steps N] [--min-gap-us 5]

A step is device bound when the device never idles; every microsecond of idle time in a steady-state
window is host time the device waited for. This reads the trace that ``benchmarks.diagnostics.profile_step --trace``
exports and prints, per step: device busy and idle time (merged kernel/copy/memset intervals over all
streams); the idle gaps grouped by the host operator that launched the work which ended each gap (the
innermost ``cpu_op``/``user_annotation`` enclosing its runtime call, with its outer operators); and the
runtime calls that block the host (``*Synchronize``, long ``cudaMemcpyAsync``), which make the host wait
for the device and so turn host time into device idle time.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
from typing import Dict, List, Tuple

_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_HOST_CATS = {"cpu_op", "user_annotation", "python_function"}


def _load(path: str) -> List[dict]:
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _merged(spans: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[List[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _enclosing(host: Dict[int, List[dict]], tid: int, ts: float, end: float) -> List[str]:
    """Names of the host operators on thread ``tid`` enclosing [ts, end], outermost first."""
    return [e["name"] for e in host.get(tid, ()) if e["ts"] <= ts and e["ts"] + e["dur"] >= end]


def analyse(path: str, steps: int, min_gap_us: float, after_kernel: str = "") -> str:
    """The report (text). ``after_kernel``: drop the device work up to the end of the first kernel whose name
    contains it (a ``torch.cuda._sleep`` put in front of the window so the host runs ahead: what remains is the
    device's own time for the steps, its gaps included)."""
    events = _load(path)
    device = [e for e in events if e.get("cat") in _DEVICE_CATS]
    if after_kernel:
        marker = next((e for e in sorted(device, key=lambda e: e["ts"]) if after_kernel in e["name"]), None)
        if marker is not None:
            end = marker["ts"] + marker["dur"]
            device = [e for e in device if e["ts"] >= end]
    if not device:
        return f"{path}: no device events"
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    host: Dict[int, List[dict]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in _HOST_CATS:
            host[e["tid"]].append(e)
    for lst in host.values():
        lst.sort(key=lambda e: (e["ts"], -e["dur"]))
    by_corr = {e["args"].get("correlation"): e for e in runtime if "args" in e}

    busy = _merged([(e["ts"], e["ts"] + e["dur"]) for e in device])
    first, last = busy[0][0], busy[-1][1]
    busy_us = sum(b - a for a, b in busy)
    starts = sorted((e["ts"], i) for i, e in enumerate(device))
    start_ts = [s for s, _ in starts]
    lines = [
        f"# device timeline of {path}",
        f"span {(last - first) / 1000:.2f} ms over {steps} steps = {(last - first) / 1000 / steps:.3f} ms/step; "
        f"busy {busy_us / 1000 / steps:.3f} ms/step; idle {(last - first - busy_us) / 1000 / steps:.3f} ms/step",
    ]
    causes: Dict[str, List[float]] = collections.defaultdict(list)
    small = 0.0
    for (a0, a1), (b0, _) in zip(busy, busy[1:]):
        gap = b0 - a1
        if gap < min_gap_us:
            small += gap
            continue
        # the device work that ended this gap and the host call that launched it
        i = bisect.bisect_left(start_ts, b0)
        kernel = device[starts[min(i, len(starts) - 1)][1]]
        launch = by_corr.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            key = f"(no launch record) -> {kernel['name'][:60]}"
        else:
            chain = _enclosing(host, launch["tid"], launch["ts"], launch["ts"] + launch["dur"])
            key = " > ".join(chain[-3:]) if chain else "(no host op)"
            key = f"{key} [{launch['name']}] -> {kernel['name'][:50]}"
        causes[key].append(gap)
    lines.append(f"gaps under {min_gap_us:g} us: {small / steps:.1f} us/step in total")
    lines.append(f"device operations per step: {len(device) / steps:.0f} ("
                 + ", ".join(f"{c} {sum(1 for e in device if e.get('cat') == c) / steps:.0f}" for c in sorted(_DEVICE_CATS))
                 + ")")
    lines.append("\n## device time by operation (us per step, count per step)\n")
    by_name: Dict[str, List[float]] = collections.defaultdict(list)
    for e in device:
        by_name[e["name"][:200]].append(e["dur"])
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:40]:
        lines.append(f"{sum(durs) / steps:8.1f} {len(durs) / steps:5.1f}  {name}")
    lines.append(f"\n## idle gaps >= {min_gap_us:g} us, by what ended them (us per step, count per step, max us)\n")
    for key, gaps in sorted(causes.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{sum(gaps) / steps:8.1f} {len(gaps) / steps:5.1f} {max(gaps):8.1f}  {key}")

    lines.append("\n## host calls that block on the device (us per step, count per step), with their host ops\n")
    blocking: Dict[str, List[float]] = collections.defaultdict(list)
    for e in runtime:
        name = e["name"]
        if "Synchronize" in name or (name.startswith("cudaMemcpy") and e["dur"] > 20):
            chain = _enclosing(host, e["tid"], e["ts"], e["ts"] + e["dur"])
            blocking[f"{name} in {' > '.join(chain[-3:]) or '(no host op)'}"].append(e["dur"])
    if not blocking:
        lines.append("(none)")
    for key, durs in sorted(blocking.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{sum(durs) / steps:8.1f} {len(durs) / steps:5.1f}  {key}")

    lines.append("\n## runtime calls by host time (us per step, count per step)\n")
    calls: Dict[str, List[float]] = collections.defaultdict(list)
    for e in runtime:
        calls[e["name"]].append(e["dur"])
    for name, durs in sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:15]:
        lines.append(f"{sum(durs) / steps:8.1f} {len(durs) / steps:5.1f}  {name}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.diagnostics.trace_gaps", description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=1, help="steps the trace covers (figures are per step)")
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    a = ap.parse_args(argv)
    print(analyse(a.trace, a.steps, a.min_gap_us))


if __name__ == "__main__":
    main()
