"""The Lightning Fabric front end: ``Fabric(strategy="cudagraph_ddp")``, or :class:`CUDAGraphDDPStrategy` with
``graphs=`` / ``ddp=`` options (:mod:`.strategy`). ``import cg_lightning`` registers the strategy names with Fabric."""

from .strategy import CUDAGraphDDPStrategy

__all__ = ["CUDAGraphDDPStrategy"]
