"""cg-lightning: per-layer CUDA graphs under an exact data-parallel engine, for Lightning and Accelerate.

``import cg_lightning`` registers the Lightning strategy name ``"cudagraph_ddp"``.
"""

from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry

from . import callbacks  # noqa: F401  (cg_lightning.callbacks)

from .ddp import DataParallelEngine, DDPOptions, GradSyncError
from .graphs import (
    BufferReuseError,
    CheckpointWithoutOutput,
    GraphCaptureError,
    GraphOptions,
    GraphSignatureError,
    SegmentError,
    checkpoint,
    is_graph_capturing,
    is_graph_warmup,
)
from .graphs.callables import make_graphed_callables
from .strategy import CUDAGraphDDPStrategy

CUDAGraphDDPStrategy.register_strategies(_StrategyRegistry)

__version__ = "0.1.0"

__all__ = [
    "BufferReuseError",
    "CUDAGraphDDPStrategy",
    "CheckpointWithoutOutput",
    "DDPOptions",
    "DataParallelEngine",
    "GradSyncError",
    "GraphCaptureError",
    "GraphOptions",
    "GraphSignatureError",
    "SegmentError",
    "checkpoint",
    "is_graph_capturing",
    "is_graph_warmup",
    "make_graphed_callables",
]
