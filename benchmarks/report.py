"""Writing the step-time results: environment stamp, ratios, JSON, Markdown table, PNG bar chart."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = "lightning_ddp"
LIMIT = "whole_step_graph"
#: how the Markdown report names each model of ``benchmarks.models``
MODEL_TEXT = {"gpt": "the example GPT", "llama": "a transformers Llama"}
MODEL_CODE = {"gpt": "`cg_lightning.examples.gpt.GPT`",
              "llama": "`transformers.LlamaForCausalLM` (`benchmarks.models.LlamaLM`)"}
COMPILED = "compile_reduce_overhead"  #: the peer a user compares with first: torch.compile's own CUDA graphs
REFERENCES = (BASELINE, LIMIT, COMPILED)


# ----------------------------------------------------------------------------- environment


def _git(*args: str) -> Optional[str]:
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")  # read only: never refresh the shared index
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(device: torch.device) -> Dict[str, Any]:
    """Date, device, library versions and the cg_lightning commit the run measured."""
    import lightning

    try:
        import cg_lightning

        cg_version = getattr(cg_lightning, "__version__", None)
    except Exception as exc:  # noqa: BLE001 - the stamp must not end the run; the cudagraph_ddp row will say why
        cg_version = f"import failed: {type(exc).__name__}: {exc}"
    gpu = gpu_memory = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu, gpu_memory = props.name, round(props.total_memory / 2**30, 1)
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    if os.environ.get("CG_LIGHTNING_COMMIT"):  # a copy of the tree whose .git is not its own (the GPU machines)
        commit, status = os.environ["CG_LIGHTNING_COMMIT"], ""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device.type,
        "gpu": gpu,
        "gpu_memory_gib": gpu_memory,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "cg_lightning": {
            "version": cg_version,
            "commit": commit,
            "dirty": None if status is None else bool(status),
        },
    }


def gpu_slug(name: Optional[str], count: int = 1) -> str:
    """The ``<gpu>`` part of a result's file name: ``"NVIDIA H200"`` -> ``H200``, two of them ``H200x2``; no GPU:
    ``cpu``."""
    if not name:
        return "cpu"
    slug = re.sub(r"^(NVIDIA|AMD)\s+", "", name.strip())
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", slug).strip("-") or "gpu"
    return slug + (f"x{count}" if count > 1 else "")


def stamp(env: Dict[str, Any]) -> str:
    """One line with what a result file must carry: date, device, library versions, the commit measured."""
    cg = env["cg_lightning"]
    commit = (cg["commit"] or "unknown")[:12] + (" (uncommitted changes)" if cg.get("dirty") else "")
    return (f"{env['date']}; {env['gpu'] or env['device']}; torch {env['torch']}; Lightning {env['lightning']}; "
            f"Python {env['python']}; cg_lightning at {commit}")


def machine_slug(env: Dict[str, Any]) -> str:
    return gpu_slug(env.get("gpu"))


def result_name(what: str, size: str, gpu: str, ext: str = "", date: Optional[str] = None) -> str:
    """``<what>_<size>_<gpu>_<yyyymmdd>[.<ext>]``, the naming rule of ``benchmarks/results/`` (see
    ``benchmarks/README.md``). ``date``: ISO date or date-time (default: today, UTC)."""
    day = (date or datetime.now(timezone.utc).isoformat())[:10].replace("-", "")
    stem = "_".join(part.replace("_", "-") if i else part for i, part in enumerate((what, size, gpu)))
    return f"{stem}_{day}" + (f".{ext.lstrip('.')}" if ext else "")


# ----------------------------------------------------------------------------- ratios


def add_ratios(rows: List[Dict[str, Any]]) -> None:
    """``ratio_to_<peer>`` = this row's median ms/step / that peer's, same size (below 1: faster)."""
    medians = {(r["size"], r["peer"]): r["ms_per_step_median"] for r in rows if r.get("status") == "ok"}
    for r in rows:
        for ref in REFERENCES:
            base = medians.get((r["size"], ref))
            ok = r.get("status") == "ok" and base
            r[f"ratio_to_{ref}"] = r["ms_per_step_median"] / base if ok else None


# ----------------------------------------------------------------------------- JSON / Markdown / PNG


def write_json(doc: Dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
        f.write("\n")


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _cell(text: str, limit: int = 120) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _status(r: Dict[str, Any]) -> str:
    if r["status"] == "ok":
        note = r.get("extra", {}).get("note")
        return "ok" + (f" ({_cell(note, 60)})" if note else "")
    return _cell(f"{r['status']}: {r.get('reason', '')}")


def size_label(name: str, cfg: Dict[str, int]) -> str:
    return (
        f"{name} (d={cfg['d_model']}, {cfg['n_layer']} layers, {cfg['n_head']} heads, "
        f"T={cfg['block_size']}, B={cfg['batch_size']})"
    )


def command_line(doc: Dict[str, Any]) -> str:
    return " ".join(["python", "-m", f"benchmarks.{doc.get('benchmark', 'step_time')}", *doc.get("argv", [])])


def markdown(doc: Dict[str, Any]) -> str:
    env, st = doc["environment"], doc["settings"]
    cg = env["cg_lightning"]
    commit = (cg["commit"] or "unknown")[:12] + (" (uncommitted changes)" if cg.get("dirty") else "")
    where = env["gpu"] or env["device"]
    lines = [
        f"# Step time of {MODEL_TEXT.get(st.get('model', 'gpt'), st.get('model'))} on {where}",
        "",
        f"- date {env['date']}; {where}"
        + (f" ({env['gpu_memory_gib']} GiB)" if env.get("gpu_memory_gib") else "")
        + f"; torch {env['torch']} (CUDA {env['cuda']}); Lightning {env['lightning']}; "
        f"cg_lightning {cg['version']} at {commit}; Python {env['python']}",
        f"- command: `{command_line(doc)}`",
        f"- every peer: {MODEL_CODE.get(st.get('model', 'gpt'), st.get('model'))}, vocab {st['vocab_size']}, random tokens (seed {st['seed']}, "
        f"{st['data_batches']} batches cycled), {st['precision']}, {st['optimizer']}",
        f"- timing: median of {st['repeats']} windows of {st['steps']} steps after {st['warmup']} warmup steps, "
        "device synchronized at window boundaries only; min/max over the windows",
        "- ratios: this peer's median ms/step divided by the named peer's (below 1: faster than it)",
    ]
    if st.get("smoke"):
        lines.append("- SMOKE RUN on CPU: checks code paths only, the times mean nothing")
    expected = doc.get("rows_expected")
    if expected and len(doc["results"]) < expected:
        lines.append(f"- INCOMPLETE: the run stopped after {len(doc['results'])} of its {expected} rows")
    for size, cfg in doc["sizes"].items():
        rows = [r for r in doc["results"] if r["size"] == size]
        lines += [
            "",
            f"## {size_label(size, cfg)}",
            "",
            f"| peer | ms/step (median) | min | max | ÷ {BASELINE} | ÷ {LIMIT} | ÷ {COMPILED} | peak MiB "
            "| capture/compile s | final loss | status |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in rows:
            ok = r["status"] == "ok"
            lines.append(
                "| "
                + " | ".join(
                    [
                        r["peer"],
                        _num(r.get("ms_per_step_median") if ok else None, ".2f"),
                        _num(r.get("ms_per_step_min") if ok else None, ".2f"),
                        _num(r.get("ms_per_step_max") if ok else None, ".2f"),
                        _num(r.get(f"ratio_to_{BASELINE}"), ".2f"),
                        _num(r.get(f"ratio_to_{LIMIT}"), ".2f"),
                        _num(r.get(f"ratio_to_{COMPILED}"), ".2f"),
                        _num(r.get("peak_mem_mib") if ok else None, ".0f"),
                        _num(r.get("capture_s") if ok else None, ".2f"),
                        _num(r.get("final_loss") if ok else None, ".3f"),
                        _status(r),
                    ]
                )
                + " |"
            )
    lines += ["", "Peers:", ""]
    for name, desc in doc["peers"].items():
        lines.append(f"- `{name}`: {desc}")
    return "\n".join(lines) + "\n"


def write_png(doc: Dict[str, Any], path: str) -> Optional[str]:
    """Bar chart of median ms/step per peer, one panel per size, min/max as error bars. Returns the path,
    or None (with a message printed) when matplotlib is not installed or nothing succeeded."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("step_time: matplotlib is not installed, no PNG written (pip install matplotlib)", flush=True)
        return None
    sizes = list(doc["sizes"])
    panels = [(s, [r for r in doc["results"] if r["size"] == s and r["status"] == "ok"]) for s in sizes]
    panels = [(s, rows) for s, rows in panels if rows]
    if not panels:
        print("step_time: no successful peer, no PNG written", flush=True)
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.8), squeeze=False)
    for ax, (size, rows) in zip(axes[0], panels):
        names = [r["peer"] for r in rows]
        med = [r["ms_per_step_median"] for r in rows]
        err = [
            [m - r["ms_per_step_min"] for m, r in zip(med, rows)],
            [r["ms_per_step_max"] - m for m, r in zip(med, rows)],
        ]
        colors = ["tab:red" if n.startswith("cudagraph_ddp") else "tab:gray" if n == LIMIT else "tab:blue" for n in names]
        bars = ax.bar(range(len(rows)), med, yerr=err, capsize=3, color=colors)
        for bar, r in zip(bars, rows):
            ratio = r.get(f"ratio_to_{BASELINE}")
            label = f"{r['ms_per_step_median']:.1f}" + (f"\n({ratio:.2f}x)" if ratio is not None else "")
            top = max(bar.get_height(), r["ms_per_step_max"])
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, top), ha="center", va="bottom",
                        fontsize=7, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("ms per training step (median)")
        ax.set_title(size_label(size, doc["sizes"][size]), fontsize=9)
        ax.margins(y=0.18)
    env = doc["environment"]
    commit = (env["cg_lightning"]["commit"] or "unknown")[:10]
    fig.suptitle(
        f"{env['gpu'] or env['device']}: torch {env['torch']}, Lightning {env['lightning']}, "
        f"cg_lightning {commit}, {env['date'][:10]}  (in brackets: ms/step ÷ {BASELINE})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m benchmarks.report name WHAT SIZE EXT [--gpus N]`` prints a result file name by the rule, for the
    GPU visible here (``cpu`` without one); the shell scripts in ``scripts/`` name their outputs with it."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m benchmarks.report", description=main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    name = sub.add_parser("name", help="print <what>_<size>_<gpu>_<yyyymmdd>.<ext>")
    name.add_argument("what")
    name.add_argument("size")
    name.add_argument("ext")
    name.add_argument("--gpus", type=int, default=1, help="GPUs the result was measured on (default 1)")
    sub.add_parser("stamp", help="print one line: date, GPU, torch, Lightning, Python, cg_lightning commit")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if a.cmd == "stamp":
        print(stamp(environment(torch.device("cuda", 0) if cuda else torch.device("cpu"))))
        return 0
    gpu = torch.cuda.get_device_name(0) if cuda else None
    print(result_name(a.what, a.size, gpu_slug(gpu, a.gpus), a.ext))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
