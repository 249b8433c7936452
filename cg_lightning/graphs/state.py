"""The graph-building phase as the graph engine sees it (defined in :mod:`cg_lightning.phase`, which the DDP
engine shares)."""

from ..phase import (  # noqa: F401
    GradReadyOccurrence,
    grad_ready_deferred,
    graph_capture,
    graph_warmup,
    is_graph_capturing,
    is_graph_warmup,
    record_grad_ready,
    recording_grad_ready,
)

__all__ = [
    "GradReadyOccurrence",
    "grad_ready_deferred",
    "graph_capture",
    "graph_warmup",
    "is_graph_capturing",
    "is_graph_warmup",
    "record_grad_ready",
    "recording_grad_ready",
]
