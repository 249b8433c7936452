"""The grad-ready notifications a graphed call fires after every backward replay: built once, as a value.

Grad-ready counts equal eager execution's, call by call (Megatron-LM PR #6242). In eager execution a
parameter reports ready once in the outer backward if that backward reaches it at all (autograd sums
every use before its ``AccumulateGrad`` node runs), plus once per nested recomputation backward that
uses it. A graphed call therefore

* gives the replay node an autograd edge only to the *eagerly visible* parameters (those an eager,
  un-bypassed forward of the call reaches from its outputs; found by one probe forward during warmup),
  so the outer backward reports them exactly as eager does, however many calls share them;
* records every notification fired during the backward capture (``CheckpointWithoutOutput``'s nested
  backwards), duplicates and order kept, filtered to nothing, and replays the list after each backward
  replay;
* adds one notification per parameter used inside each reentrant region that capture bypassed (eager
  execution would have run that region's nested backward).

Without ``accumulate_into_main_grad`` (``make_graphed_callables``) every parameter the backward
differentiates keeps its edge, since autograd must deliver its gradient; one recorded occurrence of each
hidden parameter is then absorbed by that edge.

A :class:`ReplayPlan` is built when the backward is captured (:meth:`ReplayPlan.at_capture`); choosing
parameters the replay reports directly (:mod:`.direct_ready`) gives a new value
(:meth:`ReplayPlan.reporting_directly`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import AbstractSet, Callable, Sequence, Set, Tuple

import torch

from ... import protocol
from .routing import Routing


def foreign_in(occurrences, routing: Routing) -> list:
    """Parameters a nested recomputation finalized (``(param, notify)`` pairs of ``occurrences``) that the
    call does not differentiate itself (``routing.backprop``), once each, in order."""
    mine = set(map(id, routing.backprop))
    seen: Set[int] = set()
    out = []
    for p, _ in occurrences:
        if id(p) not in mine and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


@dataclass(frozen=True)
class ReplayPlan:
    """What one graphed call reports after each backward replay (see the module docstring).

    ``notifications``: the recorded and bypassed-region notifications, in firing order; ``direct``: the
    notifiers of the parameters the replay reports directly; ``report``: both lists in one call (the
    reporter's batch); ``recorded``: the parameters notified during the backward capture, duplicates and order
    kept; ``foreign``: the parameters of other modules a nested recomputation finalized, once each.
    """

    notifications: Tuple[Callable[[], None], ...] = ()
    direct: Tuple[Callable[[], None], ...] = ()
    report: Callable[[], None] = protocol.report_each(())
    recorded: Tuple[torch.nn.Parameter, ...] = ()
    foreign: Tuple[torch.nn.Parameter, ...] = ()

    @classmethod
    def at_capture(cls, occurrences, routing: Routing, bypassed_regions: Sequence[AbstractSet[int]],
                   eager_visible: AbstractSet[int], grad_ready, direct: Sequence[Callable[[], None]] = ()
                   ) -> "ReplayPlan":
        """The plan of a backward whose capture recorded ``occurrences`` (``(param, notify)`` pairs).

        ``bypassed_regions``: ids of the parameters used in each reentrant region the capture bypassed;
        ``eager_visible``: ids of the leaves an eager forward reaches from the outputs; ``grad_ready``: the
        engine's reporter (or ``None``); ``direct``: notifiers of directly reported parameters.
        """
        events = list(occurrences)
        by_id = {id(p): p for p in routing.backprop}
        for region in reversed(bypassed_regions):  # nested backwards run in reverse region order
            for pid in region:
                param = by_id.get(pid)
                notify = protocol.notifier_of(grad_ready, param) if param is not None else None
                if notify is not None:
                    events.append((param, notify))
        edges = set(map(id, routing.edges))
        absorbed: Set[int] = set()
        plan = []
        for param, notify in events:
            # A parameter that eager's outer backward does not reach but that has an edge here (no
            # main_grad accumulation: autograd must deliver its gradient) reports once through the edge.
            if id(param) in edges and id(param) not in eager_visible and id(param) not in absorbed:
                absorbed.add(id(param))
                continue
            plan.append(notify)
        direct = tuple(direct)
        return cls(
            notifications=tuple(plan),
            direct=direct,
            report=protocol.batch_notifiers(grad_ready, plan + list(direct)),
            recorded=tuple(p for p, _ in occurrences),
            foreign=tuple(foreign_in(occurrences, routing)),
        )

    def reporting_directly(self, direct: Sequence[Callable[[], None]], grad_ready) -> "ReplayPlan":
        """This plan with ``direct`` (notifiers, where the parameters' ``AccumulateGrad`` nodes would have
        reported) fired after the recorded notifications, in the same call."""
        direct = tuple(direct)
        return replace(self, direct=direct,
                       report=protocol.batch_notifiers(grad_ready, list(self.notifications) + list(direct)))
