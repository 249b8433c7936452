"""Process-wide graph-building phase: warmup and capture flags, and the grad-ready recorder.

Code that must behave differently while per-layer graphs are built (activation recomputation, the DDP
hooks, user code with host syncs) reads :func:`is_graph_warmup` and :func:`is_graph_capturing`. Both are
true during a layer's warmup passes (warmup is part of building a graph), only ``is_graph_capturing``
during the capture itself. Megatron-LM exposes the same two predicates for the same purpose.

The DDP engine's per-parameter hooks do not add or count while :func:`grad_ready_deferred` is true: the
graph code consumes ``param.grad`` itself and, during capture, the hook hands its grad-ready notification to
:func:`record_grad_ready` so that replays can repeat it (Megatron-LM PR #6242). The contract around it is
stated in :mod:`cg_lightning.protocol`.

Imports only torch: both ``cg_lightning.graphs`` and ``cg_lightning.ddp`` use it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

import torch

#: One recorded grad-ready occurrence: the parameter and the callable that reports it ready.
GradReadyOccurrence = Tuple[torch.nn.Parameter, Callable[[], None]]


@dataclass
class _GraphPhase:
    warmup: bool = False
    capturing: bool = False
    recorder: Optional[List[GradReadyOccurrence]] = None


_phase = _GraphPhase()


def is_graph_capturing() -> bool:
    """True while per-layer graphs are being built (warmup passes and capture)."""
    return _phase.capturing


def is_graph_warmup() -> bool:
    """True during the eager warmup passes that precede a layer's capture."""
    return _phase.warmup


def grad_ready_deferred() -> bool:
    """True when DDP hooks must neither add ``param.grad`` into ``main_grad`` nor count it ready.

    That is the case while graphs are built, which includes the eager backend re-running a captured body:
    the graph code itself moves the gradients into ``main_grad`` and replays the notifications.
    """
    return _phase.capturing or _phase.warmup


def record_grad_ready(param: torch.nn.Parameter, notify: Callable[[], None]) -> None:
    """Record one grad-ready occurrence of ``param`` if a capture is recording (else do nothing).

    Duplicates and order are kept: a parameter finalized twice inside one captured backward is recorded
    twice, so its replays report it twice, as eager execution does.
    """
    if _phase.recorder is not None:
        _phase.recorder.append((param, notify))


@contextlib.contextmanager
def _set(**values) -> Iterator[None]:
    old = {k: getattr(_phase, k) for k in values}
    for k, v in values.items():
        setattr(_phase, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(_phase, k, v)


def graph_warmup() -> contextlib.AbstractContextManager:
    """Context of a warmup pass: both :func:`is_graph_warmup` and :func:`is_graph_capturing` are true."""
    return _set(warmup=True, capturing=True)


def graph_capture() -> contextlib.AbstractContextManager:
    """Context of a forward or backward capture: :func:`is_graph_capturing` is true."""
    return _set(capturing=True)


@contextlib.contextmanager
def recording_grad_ready() -> Iterator[List[GradReadyOccurrence]]:
    """Collect every grad-ready occurrence reported through :func:`record_grad_ready` in this context."""
    occurrences: List[GradReadyOccurrence] = []
    with _set(recorder=occurrences):
        yield occurrences
