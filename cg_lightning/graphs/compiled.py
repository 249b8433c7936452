"""``graphs.compile``: each graphed layer's forward compiled by ``torch.compile`` (without its own CUDA graphs),
then captured like any forward.

When the manager installs a layer (and each part of a split one), :func:`compiled_forward` wraps its forward in
``torch.compile(forward, backend=graphs.compile_backend, mode=graphs.compile_mode, dynamic=False)``. What follows:

* the first warmup step compiles (dynamo traces the forward, AOTAutograd splits forward and backward, Inductor
  writes fused kernels; the backward is compiled at its first run); later warmup steps run the compiled code;
* the capture's own eager passes (``graphs.num_warmup_iters``) call it on the tensors the capture records from,
  so a guard that fails there recompiles before stream capture begins, never inside it;
* a replay launches the captured kernels without entering Python: dynamo's guards are checked at capture and
  never per replay.

Inductor's own CUDA graphs (modes ``"reduce-overhead"``, ``"max-autotune"``) would capture inside this capture
and are refused (:data:`COMPILE_MODES`). A forward the user compiled already (``layer.forward =
torch.compile(layer.forward)``) is kept as it is, and so are the user's own kernels: the capture records whatever
the installed forward launches. Capturing the kernels of compiled regions is what torch's CUDA-graph trees do
for whole compiled graphs (``torch/_inductor/cudagraph_trees.py``); here the graph is the layer's, owned by the
data-parallel engine.

Imports only torch (and :mod:`cg_lightning.torch_compat`).
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional

import torch

from ..torch_compat import is_compiled
from .options import COMPILE_MODES



def compiled_forward(forward: Callable, backend: str, mode: str) -> Callable:
    """``forward`` compiled with ``torch.compile`` (static shapes: a new shape is a new graph set or runs eagerly
    under ``graphs.shape_policy``, so dynamic kernels would buy nothing), or ``forward`` itself when it is compiled
    already. ``backend``: a ``torch.compile`` backend name (``"inductor"``; ``"aot_eager"`` checks the path without
    code generation); ``mode``: one of :data:`COMPILE_MODES`, ``"default"`` passed as no mode.

    Raises:
        ValueError: ``mode`` would make Inductor capture CUDA graphs of its own.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"graphs.compile_mode: expected one of {COMPILE_MODES} (Inductor's own CUDA graphs would "
                         f"capture inside the layer graphs), got {mode!r}")
    if is_compiled(forward):
        return forward
    return torch.compile(forward, backend=backend, mode=None if mode == "default" else mode, dynamic=False)


def compile_wrapper(options) -> Optional[Callable[[Callable], Callable]]:
    """What ``graphs.compile`` does to each selected layer's ``forward`` (:func:`compiled_forward` under the
    options' backend and mode), or ``None`` with it off. ``options``: a :class:`~.options.GraphOptions`."""
    if not options.compile:
        return None
    return lambda forward: compiled_forward(forward, options.compile_backend, options.compile_mode)


class WarmupClock:
    """Host seconds of each warmup micro-batch (from one ``begin_step`` to the next), to report compile time as
    the first warmup step's excess over the last one (:attr:`compile_seconds`; the whole first step when only one
    was timed)."""

    def __init__(self) -> None:
        self.durations: List[float] = []
        self._started: Optional[float] = None

    def tick(self, warming_up: bool) -> None:
        """At the start of a micro-batch: close the previous one's interval; open one if this one warms up."""
        now = time.perf_counter()
        if self._started is not None:
            self.durations.append(now - self._started)
        self._started = now if warming_up else None

    @property
    def compile_seconds(self) -> float:
        if not self.durations:
            return 0.0
        rest = self.durations[-1] if len(self.durations) > 1 else 0.0
        return max(0.0, self.durations[0] - rest)
