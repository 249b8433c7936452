"""What is allocated at a peer's peak: the live allocations at the moment of ``max_memory_allocated``, by source.

On a GPU, from the repository root::

    python -m benchmarks.diagnostics.peak_memory --model llama --sizes small \\
        --peers compile_reduce_overhead cudagraph_ddp_user_compile -- --warmup 4 --steps 2 --repeats 1

Each peer of :mod:`benchmarks.step_time` runs as there, with PyTorch's allocator history on
(``torch.cuda.memory._record_memory_history``, Python stacks; see PyTorch's "Understanding CUDA Memory Usage").
The history is replayed, allocation by allocation, to find the moment allocated bytes peak; the allocations
live at that moment are grouped by the innermost frame of their stack that lies outside ``torch/`` (the code
that asked for them), and the largest groups are printed with the innermost frame of all and the phase the
peak fell in (the outermost frames of the peak's own allocation). Recording slows the host; read sizes, not
times.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

MIB = 1024 * 1024


def _where(frame: dict) -> str:
    path = frame.get("filename", "?")
    for root in ("site-packages/", "dist-packages/", os.getcwd() + "/"):
        if root in path:
            path = path.split(root, 1)[1]
    return f"{path}:{frame.get('line', '?')} {frame.get('name', '?')}"


def _owner(frames: Sequence[dict]) -> str:
    """The innermost frame outside torch (frames come innermost first), else the innermost."""
    for frame in frames:
        path = frame.get("filename", "")
        if "/torch/" not in path and not path.startswith("<"):
            return _where(frame)
    return _where(frames[0]) if frames else "(no stack)"


def peak_report(trace: List[dict], top: int = 20) -> Tuple[int, List[str]]:
    """Replay one device's allocator trace; return the peak bytes and the lines that describe it."""
    live: Dict[int, dict] = {}
    now = peak = 0
    at_peak: Dict[int, dict] = {}
    peak_event: Optional[dict] = None
    for event in trace:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            now += event["size"]
            if now > peak:
                peak, at_peak, peak_event = now, dict(live), event
        elif action == "free_completed":
            if live.pop(event["addr"], None) is not None:
                now -= event["size"]
    groups: Dict[str, List[int]] = collections.defaultdict(lambda: [0, 0])
    inner: Dict[str, str] = {}
    streams: Dict[object, List[int]] = collections.defaultdict(lambda: [0, 0])
    for event in at_peak.values():
        streams[event.get("stream")][0] += event["size"]
        streams[event.get("stream")][1] += 1
        frames = event.get("frames") or []
        key = _owner(frames)
        groups[key][0] += event["size"]
        groups[key][1] += 1
        inner.setdefault(key, _where(frames[0]) if frames else "")
    lines = [f"peak {peak / MIB:.0f} MiB of traced allocations, {len(at_peak)} live"]
    if peak_event is not None:
        outer = [_where(f) for f in (peak_event.get("frames") or [])[::-1]
                 if "/torch/" not in f.get("filename", "") and not f.get("filename", "").startswith("<")]
        lines.append("reached in: " + " > ".join(outer[-6:]))
    lines.append("by stream: " + ", ".join(
        f"{stream if stream is None else hex(stream)}: {size / MIB:.1f} MiB in {count}"
        for stream, (size, count) in sorted(streams.items(), key=lambda kv: -kv[1][0])))
    for key, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {size / MIB:9.1f} MiB {count:6d} x  {key}   [{inner[key]}]")
    return peak, lines


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=20, help="groups printed per peer")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for benchmarks.step_time")
    args, known = ap.parse_known_args(argv)
    rest = known + [a for a in args.rest if a != "--"]
    from benchmarks import step_time

    a = step_time.parse_args(rest)
    if not torch.cuda.is_available():
        print("peak_memory: needs a CUDA GPU")
        return 2
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    peers = step_time.all_peers()
    for size_name in a.sizes:
        s = step_time.settings_for(a, size_name, device)
        for name in a.peers:
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                     max_entries=2_000_000)
            try:
                row = step_time.run_peer(peers[name], s)
                snapshot = torch.cuda.memory._snapshot()
            finally:
                torch.cuda.memory._record_memory_history(enabled=None)
            print(f"[{size_name}] {name}: {row['status']}, max_memory_allocated "
                  f"{row.get('peak_mem_mib') or 0:.0f} MiB, {row.get('ms_per_step_median') or 0:.2f} ms/step "
                  f"(recording on) {row.get('reason', '')}", flush=True)
            _, lines = peak_report(snapshot["device_traces"][device.index], args.top)
            print("\n".join(lines), flush=True)
            print(f"cuBLAS workspaces the peer's streams held: {row.get('cublas_workspaces_mib') or 0:.0f} MiB",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
