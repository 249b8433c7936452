"""An engine's grad-ready reporter: each parameter's notifier, and batches of notifiers counted in one call.

The reporter is the object :mod:`cg_lightning.protocol` describes: the engine owns one
(``DataParallelEngine.grad_ready``) and hands it to the graph manager, so graph replays report to the engine
that owns the parameters, however many engines were built over the same model.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch.nn as nn

from ..protocol import report_each
from .bucket import Bucket


class Notifier:
    """One parameter's grad-ready occurrence, reported to its engine: called by the parameter's hook and by
    graph replays. Bound to its bucket and slot, so the hot path does no lookups."""

    __slots__ = ("engine", "param", "bucket", "slot")

    def __init__(self, engine, param: nn.Parameter, bucket: Bucket, slot: int) -> None:
        self.engine = engine
        self.param = param
        self.bucket = bucket
        self.slot = slot

    def __call__(self) -> None:
        engine = self.engine
        engine.reached = True
        observer = engine.ready_observer
        if observer is not None:
            observer(self.param)
        used = self.bucket.slot_used
        if used is not None:  # ddp.find_unused_parameters
            used[self.slot] = True
        if engine.sync_enabled and self.bucket.register_ready(self.slot):
            engine.dispatch_ready_prefix()


class GradReady:
    """Parameter -> :class:`Notifier` for the parameters of one engine."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._notifiers: Dict[nn.Parameter, Notifier] = {}

    def add(self, param: nn.Parameter, bucket: Bucket, slot: int) -> Notifier:
        """Make and keep ``param``'s notifier."""
        notify = self._notifiers[param] = Notifier(self.engine, param, bucket, slot)
        return notify

    def notifier(self, param: nn.Parameter) -> Optional[Notifier]:
        """The callable that reports ``param`` ready to this engine, or ``None`` (not one of its parameters,
        or the engine was closed)."""
        return self._notifiers.get(param)

    def clear(self) -> None:
        self._notifiers = {}

    def batches(self, notifiers: Sequence[Callable[[], None]]) -> bool:
        """Whether :meth:`batch` counts ``notifiers`` in one pass (all of them are this engine's)."""
        engine = self.engine
        return all(isinstance(n, Notifier) and n.engine is engine for n in notifiers)

    def batch(self, notifiers: Sequence[Callable[[], None]]) -> Callable[[], None]:
        """One callable with the effect of calling each of ``notifiers`` in order.

        When they are all this engine's, they are counted per bucket in one pass (:meth:`Bucket.register_many`)
        and complete buckets are dispatched after the whole batch is counted, in bucket order as always: a
        replay that reports 12 parameters makes one call instead of 12. With a ``ready_observer`` set, they are
        called one by one, so the observer sees every occurrence in order. Others are called one by one."""
        notifiers = list(notifiers)
        if not notifiers or not self.batches(notifiers):
            return report_each(notifiers)
        engine = self.engine
        groups: Dict[int, tuple] = {}
        for n in notifiers:
            groups.setdefault(id(n.bucket), (n.bucket, []))[1].append(n.slot)
        plan: List[tuple] = [(bucket, tuple(slots)) for bucket, slots in groups.values()]

        def report_all() -> None:
            engine.reached = True
            if engine.ready_observer is not None:
                for n in notifiers:
                    n()
                return
            for bucket, slots in plan:
                used = bucket.slot_used
                if used is not None:
                    for slot in slots:
                        used[slot] = True
            if not engine.sync_enabled:
                return
            complete = False
            for bucket, slots in plan:
                if bucket.register_many(slots):
                    complete = True
            if complete:
                engine.dispatch_ready_prefix()

        return report_all
