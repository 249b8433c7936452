"""The gradient protocol between graphed layers, the data-parallel engine and optimizers, stated once.

Three attributes on ``torch.nn.Parameter`` carry it. Every module of ``cg_lightning`` reads and writes them
through the functions below, never directly (a test greps the package for that).

``param.main_grad``
    A view into the data-parallel engine's contiguous gradient buffer (:class:`~cg_lightning.ddp.buffer.GradBuffer`),
    same shape as the parameter, in the gradient dtype. Present exactly on the parameters an engine owns
    (trainable when it was built). It is the gradient the optimizer steps on (``param.grad`` only aliases it,
    or holds a cast copy, between the end of a backward and the next one).
``param.grad_added_to_main_grad``
    ``True`` when whoever produced ``param.grad`` (a fused kernel) already added that gradient into
    ``main_grad``. The engine's hook then drops ``param.grad`` instead of adding it, clears the flag and still
    reports the parameter ready. Graph replays do *not* set it: after a replay, ``param.grad`` holds only
    contributions from outside the graphs, which the hook must add.
``param.skip_backward_post_hook``
    Set by user code on a delayed weight-gradient parameter: its gradient reaches ``main_grad`` elsewhere, and
    a graph never clones the gradient it returns for it (TransformerEngine PR #2937). Absent means ``False``.

Invariants:

1. Every gradient contribution reaches ``main_grad`` exactly once, in the order eager autograd would sum it:
   either a captured backward adds it inside the graph (and returns ``None`` for that parameter), or autograd
   delivers it in ``param.grad`` and the engine's hook adds it.
2. A parameter reports ready as often as in eager execution, call by call (Megatron-LM PR #6242): once in the
   outer backward if it reaches the parameter, plus once per nested recomputation backward that uses it.
3. While graphs are built (:func:`cg_lightning.phase.grad_ready_deferred`) the hook neither adds nor counts;
   it hands its notification to the capture's recorder, and replays repeat the recorded notifications.

The grad-ready reporter
    An object owned by each data-parallel engine (``DataParallelEngine.grad_ready``), handed to the graph
    manager (``GraphManager.bind_grad_ready``) before capture. ``reporter.notifier(param)`` is the callable
    that reports ``param`` ready to that engine (``None`` for a parameter it does not own);
    ``reporter.batch(notifiers)`` is one callable with the effect of calling each of ``notifiers`` in order.
    Without a reporter (``make_graphed_callables``), :func:`batch_notifiers` calls them one by one.

Imports only torch.
"""

from __future__ import annotations

import operator
from typing import Callable, Optional, Sequence

import torch

Notifier = Callable[[], None]

#: C-level getter of ``param.main_grad``, for hot paths that map it over every parameter
MAIN_GRAD = operator.attrgetter("main_grad")


def main_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """``param.main_grad`` (raises ``AttributeError`` if no engine owns ``param``)."""
    return param.main_grad


def has_main_grad(param: torch.nn.Parameter) -> bool:
    """Whether a data-parallel engine gave ``param`` a ``main_grad``."""
    return hasattr(param, "main_grad")


def set_main_grad(param: torch.nn.Parameter, view: torch.Tensor) -> None:
    """Make ``view`` (a view into an engine's gradient buffer) ``param.main_grad``."""
    param.main_grad = view


def grad_added(param: torch.nn.Parameter) -> bool:
    """``param.grad_added_to_main_grad``: ``param.grad`` stands for work already in ``main_grad``."""
    return param.grad_added_to_main_grad


def set_grad_added(param: torch.nn.Parameter, flag: bool) -> None:
    """Set ``param.grad_added_to_main_grad``."""
    param.grad_added_to_main_grad = flag


def skips_backward_post_hook(param: torch.nn.Parameter) -> bool:
    """``param.skip_backward_post_hook`` (set by user code, so absent means ``False``)."""
    return getattr(param, "skip_backward_post_hook", False)


def _report_nothing() -> None:
    pass


def report_each(notifiers: Sequence[Notifier]) -> Notifier:
    """One callable that calls each of ``notifiers`` in order."""
    notifiers = list(notifiers)
    if not notifiers:
        return _report_nothing

    def report() -> None:
        for notify in notifiers:
            notify()

    return report


def batch_notifiers(reporter, notifiers: Sequence[Notifier]) -> Notifier:
    """``reporter.batch(notifiers)``, or :func:`report_each` without a reporter."""
    if reporter is None:
        return report_each(notifiers)
    return reporter.batch(notifiers)


def notifier_of(reporter, param: torch.nn.Parameter) -> Optional[Notifier]:
    """``reporter.notifier(param)``, or ``None`` without a reporter."""
    return None if reporter is None else reporter.notifier(param)
