"""cg-lightning: per-layer CUDA graphs under an exact data-parallel engine, for Lightning and Accelerate.

``import cg_lightning`` registers the Lightning strategy name ``"cudagraph_ddp"`` with ``lightning.pytorch`` and,
when it is installed, ``pytorch_lightning``: at once for a package already imported, otherwise as soon as it is
(:mod:`.registration`). ``CUDAGraphDDPStrategy`` below is the ``lightning.pytorch`` class; the
``pytorch_lightning`` one is in :mod:`cg_lightning.pytorch_lightning`. The public names are resolved on first use
(PEP 562), so ``import cg_lightning.graphs`` or ``cg_lightning.ddp`` loads torch only, never Lightning,
Accelerate, OmegaConf or jsonargparse.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, List

from .registration import register_with_lightning

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "BufferReuseError": "cg_lightning.graphs",
    "CUDAGraphDDPStrategy": "cg_lightning.trainer.strategy",
    "CheckpointWithoutOutput": "cg_lightning.graphs",
    "DDPOptions": "cg_lightning.ddp",
    "DataParallelEngine": "cg_lightning.ddp",
    "GradSyncError": "cg_lightning.ddp",
    "GraphCaptureError": "cg_lightning.graphs",
    "GraphOptions": "cg_lightning.graphs",
    "GraphSignatureError": "cg_lightning.graphs",
    "PeerLostError": "cg_lightning.ddp",
    "SegmentError": "cg_lightning.graphs",
    "checkpoint": "cg_lightning.graphs",
    "is_graph_capturing": "cg_lightning.graphs",
    "is_graph_warmup": "cg_lightning.graphs",
    "make_graphed_callables": "cg_lightning.graphs.callables",
    "pad_to_multiple": "cg_lightning.collate",
}

#: subpackages and modules reachable as attributes of the package (``cg_lightning.callbacks``)
_SUBMODULES = frozenset({
    "accelerate", "callbacks", "cli", "collate", "ddp", "distributed_optimizer", "errors", "graphs", "optim", "options",
    "phase", "protocol", "pytorch_lightning", "torch_compat", "trainer",
})

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names resolve through __getattr__
    from .ddp import DataParallelEngine, DDPOptions, GradSyncError, PeerLostError  # noqa: F401
    from .graphs import (  # noqa: F401
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
    from .collate import pad_to_multiple  # noqa: F401
    from .graphs.callables import make_graphed_callables  # noqa: F401
    from .trainer.strategy import CUDAGraphDDPStrategy  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)


register_with_lightning()
