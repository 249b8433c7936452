"""CPU checks of the step-time benchmark (``benchmarks/``): the smoke run and the error and skip rows.

Times are not checked (they belong to GPU runs); these tests check that every peer gets a row, that the
peers able to run on a CPU train the same problem, and that a failing peer does not end the run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys

import pytest

from benchmarks.peers import PEER_NAMES, Peer
from tests.helpers import ROOT, subprocess_env

CPU_PEERS = ("lightning_ddp", "torch_ddp", "cudagraph_ddp", "cudagraph_ddp_layers", "cudagraph_ddp_nocache",
             "cudagraph_ddp_opt", "cudagraph_ddp_glue", "cudagraph_ddp_head")
CUDA_PEERS = ("torch_ddp_graphed", "compile_reduce_overhead", "whole_step_graph")
RESULT_NAME = re.compile(r"^(?P<what>[a-z0-9_-]+)_(?P<size>[a-z0-9-]+)_(?P<gpu>[A-Za-z0-9.]+)_(?P<date>\d{8})$")


def _result_stem(folder, what: str, size: str) -> str:
    """The one JSON result in ``folder``, named ``<what>_<size>_<gpu>_<yyyymmdd>`` (benchmarks/README.md)."""
    stems = sorted(p.stem for p in folder.glob("*.json"))
    assert len(stems) == 1, stems
    m = RESULT_NAME.match(stems[0])
    assert m and (m["what"], m["size"], m["gpu"]) == (what, size, "cpu"), stems[0]
    return stems[0]


@pytest.mark.timeout(180)
def test_smoke_run_writes_a_row_per_peer(tmp_path):
    env = subprocess_env()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.step_time", "--smoke", "--out", str(tmp_path)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=110,
        )
    except subprocess.TimeoutExpired as exc:  # normally ~5 s; show where it stalled (faulthandler dump)
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        raise AssertionError(f"smoke run stalled:\n{out[-2000:]}\n{err[-6000:]}") from exc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stem = _result_stem(tmp_path, "step_time", "tiny-smoke")
    doc = json.loads((tmp_path / f"{stem}.json").read_text())

    assert [r["peer"] for r in doc["results"]] == list(PEER_NAMES)  # one row per peer, in run order
    assert {r["size"] for r in doc["results"]} == {"tiny_smoke"}
    rows = {r["peer"]: r for r in doc["results"]}
    for name in CUDA_PEERS:
        assert rows[name]["status"] == "skipped" and rows[name]["reason"] == "needs CUDA", rows[name]
    for name in CPU_PEERS:
        r = rows[name]
        assert r["status"] == "ok", r.get("traceback", r)
        assert len(r["ms_per_step_repeats"]) == 2 and r["ms_per_step_median"] > 0
        assert r["ms_per_step_min"] <= r["ms_per_step_median"] <= r["ms_per_step_max"]
        assert math.isfinite(r["final_loss"]) and r["peak_mem_mib"] is None  # no CUDA memory on a CPU
        assert r["ratio_to_lightning_ddp"] > 0 and r["ratio_to_whole_step_graph"] is None
    assert rows["lightning_ddp"]["ratio_to_lightning_ddp"] == 1.0

    # Same model, data order and optimizer: after three steps the losses agree.
    losses = [rows[name]["final_loss"] for name in CPU_PEERS]
    assert max(losses) - min(losses) < 1e-3, losses

    stats = rows["cudagraph_ddp_per_layer"]["extra"]["graph_stats"]
    assert stats["backend"] == "eager" and stats["captured_runners"] == 2 and stats["forward_replays"] > 0
    step = rows["cudagraph_ddp"]["extra"]["step_graph_stats"]  # the default: the whole step as one graph
    assert step["captures"] == 1 and step["replays"] > 0 and step["refusal"] is None, step
    assert rows["cudagraph_ddp"]["capture_s"] is not None

    env_doc = doc["environment"]
    for key in ("date", "torch", "lightning", "cg_lightning"):
        assert env_doc[key], key
    assert "commit" in env_doc["cg_lightning"]

    md = (tmp_path / f"{stem}.md").read_text()
    for name in PEER_NAMES:
        assert f"| {name} |" in md
    assert "skipped: needs CUDA" in md
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    assert "- command: `python -m benchmarks.step_time --smoke --out " in md
    assert (tmp_path / f"{stem}.png").exists() == has_mpl


def test_failing_peer_is_an_error_row(tmp_path, monkeypatch):
    from benchmarks import step_time
    from benchmarks.peers import torch_ddp

    def broken(settings):
        raise RuntimeError("peer broke on purpose")

    monkeypatch.setattr(torch_ddp, "PEER", Peer("torch_ddp", broken, needs_cuda=False, description="broken"))
    rc = step_time.main(
        ["--smoke", "--peers", "torch_ddp,whole_step_graph", "--no-png", "--tag", "t", "--out", str(tmp_path)]
    )
    assert rc == 0
    stem = _result_stem(tmp_path, "step_time-t", "tiny-smoke")
    doc = json.loads((tmp_path / f"{stem}.json").read_text())
    rows = {r["peer"]: r for r in doc["results"]}
    assert list(rows) == ["torch_ddp", "whole_step_graph"]
    assert rows["torch_ddp"]["status"] == "error"
    assert "peer broke on purpose" in rows["torch_ddp"]["reason"] and "Traceback" in rows["torch_ddp"]["traceback"]
    assert rows["whole_step_graph"]["status"] == "skipped"
    assert "error: RuntimeError: peer broke on purpose" in (tmp_path / f"{stem}.md").read_text()


def test_a_run_stopped_part_way_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    """A run killed at a time limit (the second peer here never returns) has already written the first peer's
    row to the JSON and the Markdown, and the Markdown says the run is incomplete."""
    from benchmarks import step_time
    from benchmarks.peers import torch_ddp

    class Stopped(BaseException):
        pass

    def stopped(settings):
        raise Stopped()

    monkeypatch.setattr(torch_ddp, "PEER", Peer("torch_ddp", stopped, needs_cuda=False, description="stopped"))
    with pytest.raises(Stopped):
        step_time.main(["--smoke", "--peers", "whole_step_graph,torch_ddp,lightning_ddp", "--no-png", "--tag", "t",
                        "--out", str(tmp_path)])
    stem = _result_stem(tmp_path, "step_time-t", "tiny-smoke")
    doc = json.loads((tmp_path / f"{stem}.json").read_text())
    assert [r["peer"] for r in doc["results"]] == ["whole_step_graph"] and doc["rows_expected"] == 3
    text = (tmp_path / f"{stem}.md").read_text()
    assert "INCOMPLETE: the run stopped after 1 of its 3 rows" in text and "whole_step_graph" in text


def test_unknown_peer_or_size_is_refused():
    from benchmarks import step_time

    with pytest.raises(SystemExit) as exc:
        step_time.parse_args(["--peers", "nope"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        step_time.parse_args(["--sizes", "huge"])
    assert exc.value.code == 2
    a = step_time.parse_args(["--sizes", "tiny,small", "--peers", "cudagraph_ddp", "lightning_ddp"])
    assert a.sizes == ["tiny", "small"] and a.peers == ["cudagraph_ddp", "lightning_ddp"]
    assert (a.warmup, a.steps, a.repeats, a.vocab) == (10, 30, 5, 50304)


def test_trace_gaps_reads_busy_idle_and_what_ended_each_gap(tmp_path):
    """benchmarks.diagnostics.trace_gaps on a hand-made Chrome trace: merged busy time over two streams, the idle gap
    attributed to the host operator whose launch ended it, a blocking synchronize listed with its operator, and
    ``after_kernel`` dropping everything up to the end of a marker kernel."""
    import json

    from benchmarks.diagnostics.trace_gaps import analyse

    ev = [
        {"ph": "X", "cat": "cpu_op", "name": "outer", "ts": 0, "dur": 200, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 60, "dur": 20, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 62, "dur": 5, "tid": 1,
         "args": {"correlation": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 100, "dur": 50, "tid": 1,
         "args": {"correlation": 8}},
        {"ph": "X", "cat": "kernel", "name": "spin_kernel", "ts": 0, "dur": 10, "tid": 9, "args": {"correlation": 5}},
        {"ph": "X", "cat": "kernel", "name": "k0", "ts": 10, "dur": 20, "tid": 9, "args": {"correlation": 6}},
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 20, "dur": 20, "tid": 10, "args": {"correlation": 9}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 70, "dur": 30, "tid": 9, "args": {"correlation": 7}},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    text = analyse(str(path), steps=1, min_gap_us=5.0)
    # busy: [0, 40] merged over both streams + [70, 100]; span 100; idle 30, ended by the mm launch
    assert "span 0.10 ms over 1 steps" in text and "busy 0.070 ms/step; idle 0.030 ms/step" in text, text
    assert "30.0   1.0     30.0  outer > aten::mm [cudaLaunchKernel] -> gemm" in text, text
    assert "50.0   0.1" not in text and "cudaStreamSynchronize in outer" in text, text
    later = analyse(str(path), steps=1, min_gap_us=5.0, after_kernel="spin")
    # from the end of spin_kernel (10): busy [10, 40] + [70, 100] over a span of 90
    assert "span 0.09 ms" in later and "busy 0.060 ms/step" in later, later


def test_peak_memory_names_what_is_live_at_the_peak():
    """benchmarks.diagnostics.peak_memory on a hand-made allocator trace: the peak is found by replaying allocations
    and completed frees (a free of memory allocated before the trace is ignored), and the live allocations are
    grouped by their innermost frame outside torch, largest first."""
    from benchmarks.diagnostics.peak_memory import MIB, peak_report

    def frames(name):
        return [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
                {"filename": "/repo/model.py", "line": 7, "name": name},
                {"filename": "/repo/loop.py", "line": 3, "name": "fit"}]

    trace = [
        {"action": "free_completed", "addr": 99, "size": 5 * MIB},
        {"action": "alloc", "addr": 1, "size": 2 * MIB, "frames": frames("forward")},
        {"action": "alloc", "addr": 2, "size": 3 * MIB, "frames": frames("backward"), "stream": 255},
        {"action": "free_requested", "addr": 1, "size": 2 * MIB},
        {"action": "alloc", "addr": 3, "size": 1 * MIB, "frames": frames("forward")},
        {"action": "free_completed", "addr": 1, "size": 2 * MIB},
        {"action": "alloc", "addr": 4, "size": 1 * MIB, "frames": frames("forward")},
    ]
    peak, lines = peak_report(trace)
    assert peak == 6 * MIB, lines  # 2 + 3 + 1 live before the first completed free
    assert lines[0] == "peak 6 MiB of traced allocations, 3 live", lines
    assert lines[1] == "reached in: /repo/loop.py:3 fit > /repo/model.py:7 forward", lines
    assert lines[2] == "by stream: None: 3.0 MiB in 2, 0xff: 3.0 MiB in 1", lines
    assert lines[3].split() == ["3.0", "MiB", "2", "x", "/repo/model.py:7", "forward",
                                "[/x/torch/nn/functional.py:1", "linear]"], lines
    assert lines[4].split()[:5] == ["3.0", "MiB", "1", "x", "/repo/model.py:7"] and "backward" in lines[4], lines


def test_peer_losses_compares_losses_and_names_a_lost_gradient():
    """benchmarks.peer_losses on the CPU (eager loop only: a compiled run needs a C++ toolchain): two eager runs
    agree exactly; a run with one gradient dropped or changed is reported by parameter name."""
    import torch

    from benchmarks.common import SIZES, RunSettings
    from benchmarks.peer_losses import _run, compare

    s = RunSettings(device=torch.device("cpu"), size_name="tiny", size=dict(SIZES["tiny"], n_layer=2))
    ref = _run("eager", s, steps=2, bf16=False)
    again = _run("eager", s, steps=2, bf16=False)
    diffs, bad = compare(ref, again, bf16=False)
    assert diffs == [0.0, 0.0] and bad == [] and len(ref["losses"]) == 2
    broken = dict(again, grads=list(again["grads"]))
    broken["grads"][1] = None
    broken["grads"][2] = broken["grads"][2] * 1.01
    _, bad = compare(ref, broken, bf16=False)
    assert bad == [f"{ref['names'][1]}: missing gradient",
                   f"{ref['names'][2]}: relative gradient difference 1.00e-02"]


@pytest.mark.timeout(180)
def test_accumulator_stream_experiment_runs_the_patched_engine(tmp_path):
    """benchmarks.diagnostics.accumulator_stream swaps the strategy's engine and runs step_time (smoke, CPU): the peer gets
    an ok row and the glue parameters (5 at this size: embeddings, final norm, head) are the ones rebound."""
    env = subprocess_env()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.diagnostics.accumulator_stream", "--binding", "glue-current", "--", "--smoke",
         "--peers", "cudagraph_ddp", "--no-png", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "accumulator_stream: 5 parameter(s) outside the blocks on the current stream" in proc.stdout
    assert "accumulator_stream: binding glue-current: stream-mismatch warning not seen" in proc.stdout
    stem = _result_stem(tmp_path, "step_time", "tiny-smoke")
    row = json.loads((tmp_path / f"{stem}.json").read_text())["results"][0]
    assert row["peer"] == "cudagraph_ddp" and row["status"].startswith("ok")
