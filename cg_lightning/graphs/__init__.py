"""Per-layer graph engine: capture state, backends, runners, replay node, discovery, recomputation.

Imports only torch.
"""

from .buffer_reuse import BufferReuseError
from .checkpointing import CheckpointWithoutOutput, checkpoint
from .graph_sets import GraphStats
from .manager import GraphManager
from .options import GraphOptions
from .guards import GraphCaptureError
from .runner import LayerGraphRunner
from .segments import SegmentError
from .signature import GraphSignatureError
from .state import is_graph_capturing, is_graph_warmup

__all__ = [
    "BufferReuseError",
    "CheckpointWithoutOutput",
    "GraphCaptureError",
    "GraphManager",
    "GraphOptions",
    "GraphSignatureError",
    "GraphStats",
    "LayerGraphRunner",
    "SegmentError",
    "checkpoint",
    "is_graph_capturing",
    "is_graph_warmup",
]
