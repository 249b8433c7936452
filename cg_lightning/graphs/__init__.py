"""Per-layer graph engine: capture state, backends, runners, replay node, discovery, recomputation.

Imports only torch.
"""

from .checkpointing import CheckpointWithoutOutput, checkpoint
from .errors import BufferReuseError, GraphCaptureError, GraphSignatureError, HostSyncError, SegmentError
from .graph_sets import GraphStats
from .manager import GraphManager
from .options import GraphOptions
from .runner import LayerGraphRunner
from .state import is_graph_capturing, is_graph_warmup

__all__ = [
    "BufferReuseError",
    "CheckpointWithoutOutput",
    "GraphCaptureError",
    "GraphManager",
    "GraphOptions",
    "GraphSignatureError",
    "GraphStats",
    "HostSyncError",
    "LayerGraphRunner",
    "SegmentError",
    "checkpoint",
    "is_graph_capturing",
    "is_graph_warmup",
]
