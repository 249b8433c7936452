"""Compare eager and graphed runs of examples/train_accelerate.py (``--out`` files).

``python scripts/accelerate_report.py OUT.md EAGER.pt GRAPHS.pt [EAGER.pt GRAPHS.pt ...]`` writes and prints a
Markdown table: per-step loss difference (max relative), final-weight difference (||a-b||/||b||, max over
tensors), the same without the key part of each fused ``qkv.bias`` (its true gradient is 0: softmax ignores
a shift shared by all keys, so AdamW turns rounding noise there into full-size steps of either sign), the three
worst tensors, and the graph counters of the graphed run. Exits 1 when a graphed run replayed no graph.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from tests.helpers import max_rel_diff, state_rel_diff, state_rel_diffs


def main(argv) -> int:
    out, files = argv[0], argv[1:]
    lines = ["| run | mixed precision | micro-batches | max rel loss diff | max rel weight diff | "
             "same, key bias left out | worst tensors | graph counters |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    ok = True
    for eager_path, cg_path in zip(files[::2], files[1::2]):
        name = os.path.basename(cg_path)
        if not (os.path.exists(eager_path) and os.path.exists(cg_path)):
            lines.append(f"| {name} | - | - | missing run | | | | |")
            ok = False
            continue
        eager, cg = torch.load(eager_path), torch.load(cg_path)
        stats = cg.get("stats") or {}
        ok &= bool(stats.get("forward_replays"))
        diffs = state_rel_diffs(cg["state"], eager["state"])
        worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
        no_key = max(state_rel_diffs(cg["state"], eager["state"], drop_key_bias=True).values())
        lines.append(f"| {name} | {cg['run'].get('mixed_precision')} | {len(cg['losses'])} | "
                     f"{max_rel_diff(cg['losses'], eager['losses']):.2e} | "
                     f"{state_rel_diff(cg['state'], eager['state']):.2e} | {no_key:.2e} | "
                     + ", ".join(f"{k} {v:.1e}" for k, v in worst) + f" | {stats} |")
    text = "\n".join(lines) + "\n"
    with open(out, "w") as f:
        f.write(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
