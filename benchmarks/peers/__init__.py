"""The peers of the step-time benchmark, one module each, in the order they run.

Each module defines ``PEER``: a :class:`Peer` whose ``run(settings)`` trains the example GPT for
``settings.total_steps`` steps and returns a :class:`~benchmarks.common.PeerResult`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

from benchmarks.common import PeerResult, RunSettings


@dataclass(frozen=True)
class Peer:
    name: str
    run: Callable[[RunSettings], PeerResult]
    needs_cuda: bool
    description: str
    models: Tuple[str, ...] = ("gpt", "llama")  #: the models of ``benchmarks.models`` it runs (others: skipped)


def all_peers() -> Dict[str, Peer]:
    """Name -> peer, in run order."""
    from . import (
        compile_default,
        compile_reduce_overhead,
        cudagraph_ddp,
        lightning_ddp,
        torch_ddp,
        torch_ddp_graphed,
        whole_step_graph,
    )

    peers = [
        lightning_ddp.PEER,
        lightning_ddp.PEER_COMPILE,
        torch_ddp.PEER,
        torch_ddp_graphed.PEER,
        compile_default.PEER,
        compile_reduce_overhead.PEER,
        whole_step_graph.PEER,
        cudagraph_ddp.PEER,
        cudagraph_ddp.PEER_USER_COMPILE,
        cudagraph_ddp.PEER_STEP_OPT,
        cudagraph_ddp.PEER_USER_COMPILE_OPT,
        cudagraph_ddp.PEER_PER_LAYER,
        cudagraph_ddp.PEER_LAYERS,
        cudagraph_ddp.PEER_NOCACHE,
        cudagraph_ddp.PEER_OPT,
        cudagraph_ddp.PEER_GLUE,
        cudagraph_ddp.PEER_HEAD,
        cudagraph_ddp.PEER_WHOLE,
        cudagraph_ddp.PEER_COMPILE,
        cudagraph_ddp.PEER_WHOLE_COMPILE,
        cudagraph_ddp.PEER_STEP,
        cudagraph_ddp.PEER_STEP_COMPILE,
        cudagraph_ddp.PEER_DISTOPT,
    ]
    return {p.name: p for p in peers}


PEER_NAMES = (
    "lightning_ddp",
    "lightning_ddp_compile",
    "torch_ddp",
    "torch_ddp_graphed",
    "compile_default",
    "compile_reduce_overhead",
    "whole_step_graph",
    "cudagraph_ddp",
    "cudagraph_ddp_user_compile",
    "cudagraph_ddp_step_opt",
    "cudagraph_ddp_user_compile_opt",
    "cudagraph_ddp_per_layer",
    "cudagraph_ddp_layers",
    "cudagraph_ddp_nocache",
    "cudagraph_ddp_opt",
    "cudagraph_ddp_glue",
    "cudagraph_ddp_head",
    "cudagraph_ddp_whole",
    "cudagraph_ddp_compile",
    "cudagraph_ddp_whole_compile",
    "cudagraph_ddp_step",
    "cudagraph_ddp_step_compile",
    "cudagraph_ddp_distopt",
)
