"""Compare saved training runs of tests/scripts/train_parity.py: ``python scripts/parity_report.py OUT.md NAME=REF.pt,CG.pt ...``.

For each pair: max relative per-step loss difference, max relative final-weight difference (||a-b||/||b|| over
tensors), the graph counters of the cudagraph_ddp run, and the set of grad-ready counts it saw. Writes a
Markdown table to OUT.md and prints it.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from tests.helpers import max_rel_diff, state_rel_diff, state_rel_diffs


def main(argv) -> None:
    out, pairs = argv[0], argv[1:]
    lines = ["| case | steps | max rel loss diff | max rel weight diff | same, key bias left out | worst tensor | captured "
             "| forward replays | ready counts seen |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |"]
    for item in pairs:
        name, files = item.split("=", 1)
        ref_path, cg_path = files.split(",")
        if not (os.path.exists(ref_path) and os.path.exists(cg_path)):
            lines.append(f"| {name} | - | missing run | | | | | | |")
            continue
        ref, cg = torch.load(ref_path), torch.load(cg_path)
        stats = cg.get("stats") or {}
        counts = sorted({v for c in cg.get("ready_counts", []) for v in c.values()})
        diffs = state_rel_diffs(cg["state"], ref["state"])
        worst = max(diffs, key=diffs.get)
        no_key = max(state_rel_diffs(cg["state"], ref["state"], drop_key_bias=True).values())
        lines.append(
            f"| {name} | {len(cg['losses'])} | {max_rel_diff(cg['losses'], ref['losses']):.2e} | "
            f"{state_rel_diff(cg['state'], ref['state']):.2e} | {no_key:.2e} | {worst} {diffs[worst]:.1e} | "
            f"{stats.get('captured_runners')} | "
            f"{stats.get('forward_replays')} | {counts} |"
        )
    text = "\n".join(lines) + "\n"
    with open(out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
