"""Lightning callbacks for graph training."""

from .monitor import GraphMonitor
from .schedule import CUDAGraphCallback

__all__ = ["CUDAGraphCallback", "GraphMonitor"]
