"""The strategy and callbacks for ``pytorch_lightning``, the standalone Lightning package.

``import cg_lightning`` registers ``strategy="cudagraph_ddp"`` with ``pytorch_lightning`` too, once it is
imported; a ``pytorch_lightning.Trainer`` only accepts strategy and callback objects built on its own package,
so the classes to construct by hand for it are these::

    import pytorch_lightning as pl
    from cg_lightning.trainer.pytorch_lightning import CUDAGraphCallback, CUDAGraphDDPStrategy, GraphMonitor

    trainer = pl.Trainer(strategy=CUDAGraphDDPStrategy(graphs={"warmup_steps": 2}), callbacks=[GraphMonitor()])

Each is the body of its ``lightning.pytorch`` namesake (:mod:`cg_lightning.trainer.strategy`,
:mod:`cg_lightning.callbacks`) on ``pytorch_lightning``'s base class, with that package's optimizer wrapper,
trainer states and rank-zero logging. ``pytorch_lightning`` is not a dependency of cg-lightning; this module
imports it (and, for the shared bodies, ``lightning.pytorch``). The YAML command line (``python -m cg_lightning``)
builds a ``lightning.pytorch`` Trainer only.
"""

from __future__ import annotations

from pytorch_lightning import Callback
from pytorch_lightning.accelerators import Accelerator
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ..registration import LightningNamespace
from ..callbacks.monitor import GraphMonitorMixin
from ..callbacks.schedule import CUDAGraphCallbackMixin
from .strategy import CUDAGraphDDPMixin

__all__ = ["CUDAGraphCallback", "CUDAGraphDDPStrategy", "GraphMonitor"]


class CUDAGraphDDPStrategy(CUDAGraphDDPMixin, DDPStrategy):
    __doc__ = f"""{CUDAGraphDDPMixin.__doc__.strip()}

    Built on ``pytorch_lightning``; for ``lightning.pytorch`` use :class:`cg_lightning.CUDAGraphDDPStrategy`.
    """

    _lightning_ns = LightningNamespace("pytorch_lightning", Accelerator, LightningOptimizer, TrainerFn.FITTING,
                                       rank_zero_info)


class CUDAGraphCallback(CUDAGraphCallbackMixin, Callback):
    __doc__ = CUDAGraphCallbackMixin.__doc__
    _rank_zero_warn = staticmethod(rank_zero_warn)


class GraphMonitor(GraphMonitorMixin, Callback):
    __doc__ = GraphMonitorMixin.__doc__
