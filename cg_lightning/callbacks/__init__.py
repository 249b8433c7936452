"""Lightning callbacks for graph training."""

from .monitor import GraphMonitor

__all__ = ["GraphMonitor"]
