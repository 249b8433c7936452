"""Data-parallel engine: contiguous ``main_grad`` buffers, buckets, grad-ready counting, all-reduce.

Imports only torch (and :mod:`cg_lightning.graphs.state` for the capture-time hook behaviour).
"""

from .engine import DataParallelEngine
from .errors import GradSyncError
from .options import DDPOptions

__all__ = ["DataParallelEngine", "DDPOptions", "GradSyncError"]
