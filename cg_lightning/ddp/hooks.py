"""The engine's hook on each parameter's ``AccumulateGrad`` node: ``param.grad`` into ``main_grad``, then ready.

A hook on the node rather than a post-accumulate-grad hook: it fires even when a graph replay handed autograd no
gradient for the parameter (the graph wrote ``main_grad`` itself). Following :mod:`cg_lightning.protocol`, the
hook adds ``param.grad`` into ``main_grad`` unless a kernel already did (``grad_added_to_main_grad``; inside
the engine's ``grad_adds_batched`` it queues the addition for one multi-tensor kernel), drops
``param.grad`` and calls the parameter's notifier (:mod:`.grad_ready`). While graphs are built it only records
the occurrence (:mod:`cg_lightning.phase`); while the engine's ``hooks_armed`` is false it leaves ``param.grad``
to autograd.
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import torch
import torch.nn as nn

from .. import protocol
from ..phase import grad_ready_deferred, record_grad_ready
from .adoption import TRANSIENT_WRITE
from .errors import GradSyncError


def _hook(engine, param: nn.Parameter, notify: Callable[[], None]) -> Callable:
    grad_added, set_grad_added, main_grad = protocol.grad_added, protocol.set_grad_added, protocol.main_grad

    def hook(*_unused) -> None:
        if grad_ready_deferred():
            record_grad_ready(param, notify)
            return
        if not engine.hooks_armed:  # a backward the engine does not own: plain accumulation into param.grad
            return
        adds = engine.batched_adds
        if grad_added(param):
            if adds is not None and adds.written_outside(main_grad(param)):
                raise written_unzeroed(engine, param)
            set_grad_added(param, False)
            param.grad = None
        else:
            grad = param.grad
            if grad is None:  # after a graph replay: the graph wrote main_grad itself
                if adds is not None and adds.written_outside(main_grad(param)):
                    raise written_unzeroed(engine, param)
            else:
                if adds is None:
                    main_grad(param).add_(grad)
                else:  # launched with others before the bucket's all-reduce (DataParallelEngine.grad_adds_batched)
                    adds.add((main_grad(param),), (grad,))
                param.grad = None
        notify()

    return hook


def written_unzeroed(engine, param: nn.Parameter) -> GradSyncError:
    """The error for a ``main_grad`` written by a kernel or graph onto a buffer left unfilled (``fresh``), or onto a
    transient placeholder (:mod:`.adoption`)."""
    if engine.adoption.transient:
        why = f"while main_grad was a transient placeholder: {TRANSIENT_WRITE}"
    else:
        why = ("while the buffer was left unfilled for copied first shares (DataParallelEngine.grad_adds_batched("
               "fresh=True)); zero the buffer first and run the backward without fresh")
    return GradSyncError(f"the gradient of parameter {engine.names.get(param, '?')!r} reached main_grad without the "
                         f"engine's hook (a kernel or graph wrote it and set grad_added_to_main_grad) {why}")


class GradHooks:
    """One hook per trainable parameter of ``engine`` (a :class:`~.engine.DataParallelEngine` whose buckets and
    grad-ready reporter are built), each with its notifier from ``engine.grad_ready``.

    Args:
        engine: the engine; its ``params``, ``bucket_of``, ``grad_ready`` and ``hooks_armed`` are used.
        stream: the CUDA stream the ``AccumulateGrad`` nodes are created on (autograd runs each node on the
            stream it was created on: pass the graph capture stream), or ``None``: the current one.
    """

    def __init__(self, engine, stream: Optional["torch.cuda.Stream"] = None) -> None:
        self._handles: List = []
        self._accumulators: List = []  # kept alive: a node torch frees would take its hook with it
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for p in engine.params:
                protocol.set_grad_added(p, False)
                acc = p.view_as(p).grad_fn.next_functions[0][0]
                bucket = engine.bucket_of[p]
                notify = engine.grad_ready.add(p, bucket, bucket.slot_of[p])
                self._handles.append(acc.register_hook(_hook(engine, p, notify)))
                self._accumulators.append(acc)

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._accumulators = []
