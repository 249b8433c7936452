"""What binding every ``AccumulateGrad`` node to the graph capture stream costs per step (an experiment).

The DDP engine creates each parameter's ``AccumulateGrad`` node on the capture stream
(``DataParallelEngine(grad_accumulator_stream=...)``), because a captured recomputation backward runs those
nodes inside the capture, where a node bound to the legacy default stream fails. Every eagerly computed
gradient (embeddings, head, norms) then crosses streams, and torch >= 2.10 warns once ("The AccumulateGrad
node's stream does not match ...", pytorch PR #166136).

This runs ``benchmarks.step_time`` with the engine as shipped (``--binding capture``) or with every node bound to
the current stream (``--binding current``: capture then fails, since even a captured ``torch.autograd.grad``
syncs a leaf's gradient onto its node's stream), or with only the parameters outside the graphed blocks bound to
the current stream (``--binding glue-current``), so the bindings can be compared side by side; run both bindings alternately, in
separate processes, to average out host drift. The stream-mismatch warning is reported as seen or not.

Usage (repository root, GPU): ``python -m benchmarks.diagnostics.accumulator_stream --binding current -- --sizes tiny
--peers cudagraph_ddp --out OUT``
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binding", choices=["capture", "current", "glue-current"], required=True)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for benchmarks.step_time (after --)")
    args = ap.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    import cg_lightning.trainer.strategy as strategy_module

    if args.binding == "current":
        shipped = strategy_module.DataParallelEngine

        class CurrentStreamEngine(shipped):
            def __init__(self, module, options=None, process_group=None, grad_accumulator_stream=None):
                super().__init__(module, options, process_group, grad_accumulator_stream=None)

        strategy_module.DataParallelEngine = CurrentStreamEngine
    elif args.binding == "glue-current":
        shipped = strategy_module.DataParallelEngine

        class GlueOnCurrentStreamEngine(shipped):
            """The nodes of parameters outside the graphed blocks made on the current stream first (and kept
            alive), so the engine's creation under the capture stream finds them instead of making new ones."""

            def __init__(self, module, options=None, process_group=None, grad_accumulator_stream=None):
                graphed = {id(p) for name, m in module.named_modules() if re.fullmatch(r"model\.blocks\.\d+", name)
                           for p in m.parameters()}
                self_nodes = [p.view_as(p).grad_fn.next_functions[0][0] for p in module.parameters()
                              if p.requires_grad and id(p) not in graphed]
                super().__init__(module, options, process_group, grad_accumulator_stream=grad_accumulator_stream)
                self._glue_nodes = self_nodes
                print(f"accumulator_stream: {len(self_nodes)} parameter(s) outside the blocks on the current stream")

        strategy_module.DataParallelEngine = GlueOnCurrentStreamEngine
    from benchmarks.step_time import main as step_time_main

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rc = step_time_main(rest)
    mismatch = [w for w in seen if "AccumulateGrad node's stream" in str(w.message)]
    print(f"accumulator_stream: binding {args.binding}: stream-mismatch warning "
          f"{'seen' if mismatch else 'not seen'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
