"""Per-step losses of the plain-loop peers against the eager loop: is every peer training the same model?

``step_time`` reports each peer's last loss only; a peer whose loss drifts from eager's may be doing less (or
different) work than the others, which would make its timing unfair. This runs the eager plain loop and the
``torch.compile`` variants (default mode, and ``reduce-overhead`` with Inductor's CUDA-graph trees) for a few
steps on the same batches, with a synchronization after every step, and prints every step's loss and its
difference from eager's. On the first step it also compares every parameter's gradient with eager's, so a
gradient lost or changed inside a compiled graph shows up by name.

Usage (repository root; CUDA for the CUDA-graph trees): ``python -m benchmarks.peer_losses --size tiny --steps 16``;
save the printed report as ``peer_losses_<size>_<gpu>_<yyyymmdd>.txt`` and ``--json`` as the same name with ``.json``
(``benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional, Tuple

import torch

from benchmarks.common import SIZES, RunSettings, autocast, build_model, lm_loss, make_batches, make_optimizer

MODES = ("eager", "compile_default", "compile_reduce_overhead")


def _run(mode: str, s: RunSettings, steps: int, bf16: bool) -> Dict[str, object]:
    batches = make_batches(s)
    model = build_model(s)
    names = [n for n, _ in model.named_parameters()]
    if mode == "compile_default":
        fwd = torch.compile(model)
    elif mode == "compile_reduce_overhead":
        fwd = torch.compile(model, mode="reduce-overhead")
    else:
        fwd = model
    optimizer = make_optimizer(model.named_parameters(), s)
    losses: List[float] = []
    first_grads: Optional[List[Optional[torch.Tensor]]] = None
    for i in range(steps):
        x, y = batches[i % len(batches)]
        x, y = x.to(s.device), y.to(s.device)
        if mode == "compile_reduce_overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with autocast(s) if bf16 else torch.autocast(s.device.type, enabled=False):
            loss = lm_loss(fwd(x), y)
        loss.backward()
        if i == 0:
            first_grads = [None if p.grad is None else p.grad.detach().float().clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach().float().cpu()))
    if mode != "eager":
        torch._dynamo.reset()
    return {"losses": losses, "grads": first_grads, "names": names}


def compare(ref: Dict[str, object], run: Dict[str, object], bf16: bool) -> Tuple[List[float], List[str]]:
    """Per-step ``|loss - reference loss|``, and one line per parameter whose first-step gradient is missing,
    unexpected, or off by more than 5e-2 (bf16) or 1e-3 (fp32) relative (norm of the difference over the
    reference's norm)."""
    diffs = [abs(a - b) for a, b in zip(run["losses"], ref["losses"])]
    bad = []
    for name, g, r in zip(ref["names"], run["grads"], ref["grads"]):
        if (g is None) != (r is None):
            bad.append(f"{name}: {'missing' if g is None else 'unexpected'} gradient")
        elif g is not None:
            rel = float((g - r).norm() / r.norm().clamp_min(1e-30))
            if rel > (5e-2 if bf16 else 1e-3):
                bad.append(f"{name}: relative gradient difference {rel:.2e}")
    return diffs, bad


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--precision", nargs="+", default=["bf16-mixed", "32-true"], choices=["bf16-mixed", "32-true"])
    ap.add_argument("--json", default=None, help="also write the losses here")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = RunSettings(device=device, size_name=args.size, size=SIZES[args.size])
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from benchmarks import report

    env = report.environment(device)
    command = " ".join(["python", "-m", "benchmarks.peer_losses", *(sys.argv[1:] if argv is None else argv)])
    print(f"# {report.stamp(env)}\n# command: {command}")
    out: Dict[str, object] = {"run": {"stamp": report.stamp(env), "command": command, "environment": env}}
    for precision in args.precision:
        bf16 = precision == "bf16-mixed"
        runs = {mode: _run(mode, s, args.steps, bf16) for mode in args.modes}
        ref = runs[args.modes[0]]
        out[precision] = {m: r["losses"] for m, r in runs.items()}
        print(f"\n## {precision}, size {args.size}, {device} ({torch.__version__}); reference: {args.modes[0]}")
        print("| step | " + " | ".join(args.modes) + " |")
        print("| ---: | " + " | ".join("---:" for _ in args.modes) + " |")
        for i in range(args.steps):
            cells = [f"{runs[m]['losses'][i]:.4f}" for m in args.modes]
            print(f"| {i} | " + " | ".join(cells) + " |")
        for m in args.modes[1:]:
            diffs, bad = compare(ref, runs[m], bf16)
            print(f"{m}: max |loss - {args.modes[0]}| {max(diffs):.2e}, at the last step {diffs[-1]:.2e}")
            print(f"{m}: first-step gradients, {len(bad)} parameter(s) off: " + ("; ".join(bad[:8]) or "none"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
