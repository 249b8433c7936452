"""The classes to construct by hand for a standalone ``pytorch_lightning.Trainer``; defined in
:mod:`cg_lightning.trainer.pytorch_lightning`, importable from here as documented."""

from .trainer.pytorch_lightning import CUDAGraphCallback, CUDAGraphDDPStrategy, GraphMonitor

__all__ = ["CUDAGraphCallback", "CUDAGraphDDPStrategy", "GraphMonitor"]
