"""Hugging Face Accelerate integration: per-layer graphs and the exact DDP engine in an Accelerate loop.

Two lines change in an Accelerate script::

    from cg_lightning.accelerate import CUDAGraphAccelerator
    accelerator = CUDAGraphAccelerator(graphs={"warmup_steps": 2})   # instead of Accelerator()

Launch it as before (``accelerate launch``, ``torchrun``, ``python``). A rank that fails is named in a
``PeerLostError`` on the others; ``accelerator.check_preemption()`` and ``exit_preempted()`` stop every process
on SIGTERM after the same step (:mod:`.faults`). Accelerate is imported only in
this subpackage; :mod:`cg_lightning.graphs` and :mod:`cg_lightning.ddp` import only torch.
"""

from .accelerator import CUDAGraphAccelerator
from ..lifecycle import GraphedDataParallel
from .optimizer import GradBufferOptimizer

__all__ = ["CUDAGraphAccelerator", "GradBufferOptimizer", "GraphedDataParallel"]
