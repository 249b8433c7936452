"""Per-layer graph engine (torch only): the manager, backends and options here; capture, replay, recomputation and
discovery, splitting, segments and the whole step in subpackages of those names (``capture/``, ``replay/``,
``recompute/``, ``split/``, ``segments/``, ``step/``); every error in :mod:`.errors`.
"""

from .recompute.checkpointing import CheckpointWithoutOutput, checkpoint
from .errors import BufferReuseError, GraphCaptureError, GraphSignatureError, HostSyncError, SegmentError
from .graph_sets import GraphStats
from .manager import GraphManager
from .options import GraphOptions
from .replay.runner import LayerGraphRunner
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
