"""Step time of the example GPT or a transformers Llama under twenty-three training setups, side by side in one process.

On a GPU, from the repository root::

    python -m benchmarks.step_time --sizes tiny small compute          # all peers, 5 x 30 timed steps
    python -m benchmarks.step_time --sizes tiny --peers lightning_ddp cudagraph_ddp --repeats 7
    python -m benchmarks.step_time --model llama --sizes tiny small      # the same peers on a transformers Llama
    python -m benchmarks.step_time --smoke --out /tmp/bench             # CPU, 2 steps a peer: code paths only

Peers (same model, random-token data, bf16 autocast over fp32 weights, AdamW(fused=True) on GPU):

* ``lightning_ddp``: Lightning ``strategy="ddp"``, eager; ``lightning_ddp_compile``: the same with the model wrapped
  in ``torch.compile`` inside the LightningModule.
* ``torch_ddp``: plain loop over torch ``DistributedDataParallel`` (world size 1), eager.
* ``torch_ddp_graphed``: the same with ``torch.cuda.make_graphed_callables`` on every block (GPT only: its blocks
  take one tensor).
* ``compile_default``: ``torch.compile(model)``, plain loop; ``compile_reduce_overhead``: with
  ``mode="reduce-overhead"`` (Inductor's CUDA graphs too).
* ``whole_step_graph``: forward, backward and optimizer step in one CUDA graph (the limit).
* ``cudagraph_ddp``: Lightning with this project's strategy and its defaults (segments, direct grad-ready, the
  fused AdamW step on cached tensor lists); ``cudagraph_ddp_layers``: one graph per block call, those three off;
  ``cudagraph_ddp_nocache``: the defaults with ``optimizer.step()`` as is; ``cudagraph_ddp_opt``: the defaults
  plus the optimizer step replayed from a graph (``graphs.capture_optimizer=True``, opt-in);
  ``cudagraph_ddp_glue``: the defaults plus the embeddings, final norm and head graphed (``graphs.layers``);
  ``cudagraph_ddp_head``: the defaults plus the final norm and head graphed (the blocks' segment continues there);
  ``cudagraph_ddp_whole``: the whole forward one graphed call; ``cudagraph_ddp_compile`` and
  ``cudagraph_ddp_whole_compile``: those with ``graphs.compile`` (Inductor's kernels captured in the graphs).

Each peer runs ``--warmup`` steps, then ``--repeats`` windows of ``--steps`` steps; the device is synchronized at
window boundaries only. Reported per size and peer: median ms/step, min/max over the windows, ratios to
``lightning_ddp`` and to ``whole_step_graph``, peak memory, capture/compile time and the last loss. A peer that
fails becomes an error row; peers that need CUDA are skipped on a CPU. Output:
``step_time_<sizes>_<gpu>_<yyyymmdd>`` (``benchmarks/README.md``) as ``.json``, ``.md`` and ``.png`` (when
matplotlib is installed) in ``--out``.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import statistics
import sys
import traceback
from typing import Any, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: python benchmarks/step_time.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks import report
from benchmarks.common import (
    SIZES,
    SMOKE_SIZE,
    SMOKE_SIZE_NAME,
    SMOKE_VOCAB_SIZE,
    VOCAB_SIZE,
    RunSettings,
    destroy_process_group,
    free_memory,
    mib,
    optimizer_description,
)
from benchmarks.models import LLAMA_VOCAB_SIZE, MODELS
from benchmarks.peers import PEER_NAMES, Peer, all_peers

DEFAULTS = dict(warmup=10, steps=30, repeats=5)
SMOKE_DEFAULTS = dict(warmup=1, steps=1, repeats=2)


def _names(values: Optional[Sequence[str]]) -> List[str]:
    """Accept ``a b``, ``a,b`` or a mix."""
    return [v for value in (values or []) for v in value.split(",") if v]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.step_time", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="gpt", choices=MODELS,
                    help="the example GPT or a transformers Llama of the same size (default gpt)")
    ap.add_argument("--sizes", nargs="+", default=None, metavar="SIZE",
                    help=f"model sizes, of {', '.join(SIZES)} (default: all)")
    ap.add_argument("--peers", nargs="+", default=None, metavar="PEER",
                    help=f"peers to run, in the order given, of: {', '.join(PEER_NAMES)} (default: all, in this order)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10; smoke 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps per timed window (default 30; smoke 1)")
    ap.add_argument("--repeats", type=int, default=None, help="timed windows (default 5; smoke 2)")
    ap.add_argument("--vocab", type=int, default=None,
                    help=f"vocabulary size (default {VOCAB_SIZE} for the GPT, {LLAMA_VOCAB_SIZE} for the Llama)")
    ap.add_argument("--seed", type=int, default=0, help="model init and data seed (default 0)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--graph-warmup-steps", type=int, default=None,
                    help="cudagraph_ddp: eager steps before capture, graphs.warmup_steps (default 2; smoke 1)")
    ap.add_argument("--out", default=os.path.join(report.ROOT, "benchmarks", "results"),
                    help="output folder (default benchmarks/results)")
    ap.add_argument("--tag", default="", help="variant of the run, put after step_time in the file names")
    ap.add_argument("--no-png", action="store_true", help="do not draw the bar chart")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of the code paths: tiny size shrunk further, 2 timed steps a peer; "
                         "peers needing CUDA are reported as skipped")
    a = ap.parse_args(argv)

    a.sizes = _names(a.sizes)
    if a.smoke:
        if a.sizes:
            ap.error("--smoke runs its own size; leave out --sizes")
        a.sizes = [SMOKE_SIZE_NAME]
    else:
        a.sizes = a.sizes or list(SIZES)
        bad = [s for s in a.sizes if s not in SIZES]
        if bad:
            ap.error(f"unknown size(s) {bad}; choose from {list(SIZES)}")
    a.peers = _names(a.peers) or list(PEER_NAMES)
    bad = [p for p in a.peers if p not in PEER_NAMES]
    if bad:
        ap.error(f"unknown peer(s) {bad}; choose from {list(PEER_NAMES)}")
    for key, value in (SMOKE_DEFAULTS if a.smoke else DEFAULTS).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.vocab is None:
        a.vocab = SMOKE_VOCAB_SIZE if a.smoke else (LLAMA_VOCAB_SIZE if a.model == "llama" else VOCAB_SIZE)
    if a.graph_warmup_steps is None:
        a.graph_warmup_steps = 1 if a.smoke else 2
    if a.warmup < 1 or a.steps < 1 or a.repeats < 1:
        ap.error("--warmup, --steps and --repeats must be >= 1")
    return a


def settings_for(a: argparse.Namespace, size_name: str, device: torch.device) -> RunSettings:
    size = SMOKE_SIZE if size_name == SMOKE_SIZE_NAME else SIZES[size_name]
    return RunSettings(
        device=device, size_name=size_name, size=dict(size), vocab_size=a.vocab, warmup=a.warmup,
        steps=a.steps, repeats=a.repeats, seed=a.seed, lr=a.lr, cg_warmup_steps=a.graph_warmup_steps,
        model=a.model,
    )


def run_peer(peer: Peer, s: RunSettings) -> Dict[str, Any]:
    """Run one peer; never raises (a failure is an error row). Frees memory before and after."""
    row: Dict[str, Any] = {"size": s.size_name, "peer": peer.name}
    if peer.needs_cuda and not s.is_cuda:
        row.update(status="skipped", reason="needs CUDA")
        return row
    if s.model not in peer.models:
        row.update(status="skipped", reason=f"runs only on {', '.join(peer.models)}")
        return row
    free_memory(s.device)
    if s.is_cuda:
        torch.cuda.reset_peak_memory_stats(s.device)
        row["mem_at_start_mib"] = mib(torch.cuda.memory_allocated(s.device))
    try:
        result = peer.run(s)
    except Exception as exc:  # noqa: BLE001 - any failure of a peer is reported, the run goes on
        row.update(status="error", reason=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        result = None
    finally:
        cleanup_error = _cleanup(s, row)
    if cleanup_error:
        row["cleanup_error"] = cleanup_error
    if result is None:
        return row
    ms = result.ms_per_step
    row.update(
        status="ok",
        ms_per_step_median=statistics.median(ms),
        ms_per_step_min=min(ms),
        ms_per_step_max=max(ms),
        ms_per_step_repeats=ms,
        peak_mem_mib=mib(torch.cuda.max_memory_allocated(s.device)) if s.is_cuda else None,
        capture_s=result.capture_s,
        capture_what=result.capture_what,
        warmup_s=result.warmup_s,
        final_loss=result.final_loss,
        extra=result.extra,
    )
    return row


def _cleanup(s: RunSettings, row: Dict[str, Any]) -> Optional[str]:
    """Destroy a process group a peer left (Lightning keeps its own until exit), free memory; put the cuBLAS
    workspaces the peer's streams held into ``row["cublas_workspaces_mib"]`` (part of its peak)."""

    def free() -> None:
        row["cublas_workspaces_mib"] = mib(free_memory(s.device)) if s.is_cuda else None

    problems = []
    for what, fn in (("process group", destroy_process_group), ("memory", free)):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{what}: {type(exc).__name__}: {exc}")
    return "; ".join(problems) or None


def _print_row(row: Dict[str, Any]) -> None:
    head = f"[{row['size']}] {row['peer']}:"
    if row["status"] != "ok":
        print(f"{head} {row['status']}: {row.get('reason', '')}", flush=True)
        return
    mem = f", peak {row['peak_mem_mib']:.0f} MiB" if row.get("peak_mem_mib") is not None else ""
    cap = f", capture/compile {row['capture_s']:.2f} s" if row.get("capture_s") is not None else ""
    print(
        f"{head} {row['ms_per_step_median']:.2f} ms/step (min {row['ms_per_step_min']:.2f}, "
        f"max {row['ms_per_step_max']:.2f}){mem}{cap}, last loss {row['final_loss']}",
        flush=True,
    )


def main(argv=None) -> int:
    a = parse_args(argv)
    if not a.smoke:
        return _run(a, argv)
    # A smoke run takes seconds; if one ever stalls, every thread's stack goes to stderr for the test. The watchdog
    # ends with the run: left armed in a process that goes on (a test calling main()), its thread would dump the
    # stacks of threads still running Python, which can crash the interpreter.
    faulthandler.dump_traceback_later(60, exit=False)
    try:
        return _run(a, argv)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _run(a: argparse.Namespace, argv) -> int:
    device = torch.device("cpu") if a.smoke or not torch.cuda.is_available() else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not a.smoke and (a.repeats < 5 or a.steps < 30):
        print(f"step_time: note: {a.repeats} windows of {a.steps} steps is below the 5 x 30 the results "
              "should be quoted with", flush=True)
    peers = all_peers()
    env = report.environment(device)
    sizes = {size_name: settings_for(a, size_name, device) for size_name in a.sizes}
    first = sizes[a.sizes[0]]
    rows: List[Dict[str, Any]] = []
    doc = {
        "benchmark": "step_time",
        "argv": sys.argv[1:] if argv is None else list(argv),
        "environment": env,
        "settings": {
            "model": a.model,
            "smoke": a.smoke,
            "vocab_size": a.vocab,
            "seed": a.seed,
            "data_batches": first.data_batches,
            "precision": "bf16-mixed (torch.autocast bfloat16 over fp32 weights)",
            "optimizer": optimizer_description(first),
            "warmup": a.warmup,
            "steps": a.steps,
            "repeats": a.repeats,
            "cudagraph_ddp_graph_warmup_steps": a.graph_warmup_steps,
            "lightning_module": ("cg_lightning.examples.gpt.GPTLightningModule" if a.model == "gpt" else
                                 "a LightningModule holding benchmarks.models.LlamaLM")
                                + " with training_step = cross-entropy of model(x) as in the plain loops, no per-step "
                                  "self.log",
            "data_loading": "pre-made CPU batches (pinned on GPU), moved with .to(device, non_blocking=True); "
                            "Lightning: DataLoader(batch_size=None), use_distributed_sampler=False",
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        },
        "sizes": {name: s.size for name, s in sizes.items()},
        "peers": {name: peers[name].description for name in a.peers},
        "rows_expected": len(a.sizes) * len(a.peers),
        "results": rows,
    }
    os.makedirs(a.out, exist_ok=True)
    what = "step_time" + ("-llama" if a.model == "llama" else "") + (f"-{a.tag}" if a.tag else "")
    stem = os.path.join(a.out, report.result_name(what, "-".join(a.sizes), report.machine_slug(env), date=env["date"]))
    # The files are rewritten after every row, so a run stopped part-way (a time limit on a lent GPU) keeps the rows
    # it finished; the Markdown names a run that did not finish.
    for size_name in a.sizes:
        for name in a.peers:
            row = run_peer(peers[name], sizes[size_name])
            rows.append(row)
            _print_row(row)
            report.add_ratios(rows)
            text = _write(doc, stem)
    written = [stem + ".json", stem + ".md"]
    if not a.no_png:
        png = report.write_png(doc, stem + ".png")
        if png:
            written.append(png)
    print("\n" + text, flush=True)
    print("step_time: wrote " + ", ".join(written), flush=True)
    failed = [f"{r['size']}/{r['peer']}" for r in rows if r["status"] == "error"]
    if failed:
        print(f"step_time: {len(failed)} peer(s) failed: {', '.join(failed)} (tracebacks in the JSON)",
              file=sys.stderr, flush=True)
    return 0


def _write(doc: Dict[str, Any], stem: str) -> str:
    """``stem``.json and ``stem``.md from ``doc`` as it stands; returns the Markdown."""
    report.write_json(doc, stem + ".json")
    text = report.markdown(doc)
    with open(stem + ".md", "w") as f:
        f.write(text)
    return text


if __name__ == "__main__":
    raise SystemExit(main())
