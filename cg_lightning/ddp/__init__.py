"""Data-parallel engine: contiguous ``main_grad`` buffers, buckets, grad-ready counting, all-reduce.

Imports only torch (and the torch-only :mod:`cg_lightning.protocol` and :mod:`cg_lightning.phase`; its options are
checked by :mod:`cg_lightning.option_checks`, the check every options dataclass shares).
"""

from .engine import DataParallelEngine
from .errors import GradSyncError
from .options import DDPOptions
from .peers import PeerLostError

__all__ = ["DataParallelEngine", "DDPOptions", "GradSyncError", "PeerLostError"]
