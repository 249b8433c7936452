"""Where a graphed call's parameter gradients go and which grad-ready notifications its backward replay fires.

Both are fixed at capture as values: the :class:`~.routing.Routing` (which parameters the captured backward
differentiates, which gradients it returns, adds into ``main_grad`` or only notifies) and the
:class:`~.replay_plan.ReplayPlan` (the recorded notifications, then those the replay reports itself:
:mod:`.direct_ready`). :class:`RoutedCall` holds them for :class:`~.runner.LayerGraphRunner` and answers questions
about them as lists.
"""

from __future__ import annotations

from typing import Callable, List, Sequence

import torch

from ... import protocol
from .replay_plan import ReplayPlan
from .routing import Routing


class RoutedCall:
    """The gradient routing (:attr:`routing`) and grad-ready replay plan (:attr:`plan`) of one graphed call;
    ``name`` (for messages) and ``grad_ready`` (the data-parallel engine's reporter, or ``None``) are the
    runner's."""

    name: str
    grad_ready: object
    routing: Routing
    plan: ReplayPlan

    @property
    def adds_into_main_grad(self) -> bool:
        """The captured backward adds some parameter gradient into ``main_grad`` (checked at every backward
        replay, so no list copy)."""
        return bool(self.routing.into_main_grad)

    @property
    def params_to_backprop(self) -> List[torch.nn.Parameter]:
        """The parameters the captured backward differentiates."""
        return list(self.routing.backprop)

    @property
    def hidden_params(self) -> List[torch.nn.Parameter]:
        """Those of :attr:`params_to_backprop` reached only inside recomputation regions."""
        return list(self.routing.hidden)

    @property
    def edge_params(self) -> List[torch.nn.Parameter]:
        """The parameters whose gradient slot the backward graph has (returned, or notification only)."""
        return list(self.routing.edges)

    @property
    def clone_slots(self) -> List[bool]:
        """Per edge parameter, whether its returned gradient is cloned."""
        return list(self.routing.clone)

    @property
    def apply_edges(self) -> tuple:
        """The parameters the replay node takes as inputs (autograd edges to their ``AccumulateGrad`` nodes)."""
        return self.routing.apply_edges

    @property
    def direct_params(self) -> List[torch.nn.Parameter]:
        """The parameters the replay reports ready itself (:mod:`.direct_ready`)."""
        return list(self.routing.direct)

    @property
    def main_grad_params(self) -> List[torch.nn.Parameter]:
        """Parameters whose gradient the captured backward adds into ``main_grad`` itself."""
        return list(self.routing.into_main_grad)

    def report_directly(self, params: Sequence[torch.nn.Parameter]) -> None:
        """From the next replay on, ``params`` (edge parameters of this runner whose gradient goes into
        ``main_grad`` in the graph) are no inputs of the replay node; the replay reports them ready itself
        (:mod:`.direct_ready`, which chooses them).

        Raises:
            ValueError: for a parameter that is not such an edge parameter or has no grad-ready reporter.
        """
        try:
            routing = self.routing.reporting_directly(params)
        except ValueError as exc:
            raise ValueError(f"graphed {self.name!r}: {exc}") from exc
        direct = list(routing.direct)
        notifiers = [protocol.notifier_of(self.grad_ready, p) for p in direct]
        if any(n is None for n in notifiers):
            raise ValueError(f"graphed {self.name!r}: a parameter without a grad-ready reporter (no DDP engine)")
        self.routing = routing
        self._unseen_if_frozen = self.hidden_params + direct  # disjoint: direct ones are eagerly visible
        self._set_plan(self.plan.reporting_directly(notifiers, self.grad_ready))

    def _set_plan(self, plan: ReplayPlan) -> None:
        """Make ``plan`` the one every backward replay fires (its batched report is kept at hand)."""
        self.plan = plan
        self._report_all = plan.report  # the recorded notifications + the direct ones, in one call

    @property
    def replay_plan(self) -> List[Callable[[], None]]:
        """The recorded and bypassed-region notifications each backward replay fires, in order."""
        return list(self.plan.notifications)

    @property
    def recorded_occurrences(self) -> List[torch.nn.Parameter]:
        """The parameters notified during the backward capture, duplicates and order kept."""
        return list(self.plan.recorded)
