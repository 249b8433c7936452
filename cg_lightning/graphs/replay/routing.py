"""Where each parameter gradient of a graphed call goes: decided once, at capture, as an immutable value.

For every parameter the captured backward differentiates (``backprop``: the layer's own parameters that its
outputs or its recomputation regions reach), a :class:`Routing` says

* whether the graph adds its gradient into ``main_grad`` itself (``into_main_grad``; the contract is
  :mod:`cg_lightning.protocol`), or returns it to autograd;
* whether the replay node takes it as an input (an *edge*: autograd then runs its ``AccumulateGrad`` node, and
  the DDP engine's hook there reports it ready, as in eager execution). Edges are the parameters whose gradient
  is returned, and those eager autograd reaches from the call's outputs (their notification rides the edge);
* whether a returned gradient is cloned (``clone``, one flag per edge);
* whether the replay reports it ready itself instead of through its edge (``direct``, chosen after capture by
  :mod:`.direct_ready`).

Changes after capture produce a new value (:meth:`Routing.summed_through_autograd`,
:meth:`Routing.reporting_directly`); nothing mutates one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import AbstractSet, Sequence, Tuple

import torch

from ... import protocol

Params = Tuple[torch.nn.Parameter, ...]


@dataclass(frozen=True)
class Routing:
    """The routing of one graphed call's parameter gradients (see the module docstring).

    ``backprop``: in differentiation order; ``hidden``: those reached only inside recomputation regions;
    ``into_main_grad``, ``edges``, ``direct``: subsets of ``backprop`` in its order; ``clone``: per edge.
    ``apply_edges`` (the replay node's parameter inputs) and ``returned`` (per such input, its edge slot and
    whether to clone it) follow from them.
    """

    backprop: Params
    hidden: Params
    into_main_grad: Params
    edges: Params
    clone: Tuple[bool, ...]
    direct: Params = ()
    apply_edges: Params = field(init=False)
    returned: Tuple[Tuple[int, bool], ...] = field(init=False)

    def __post_init__(self) -> None:
        direct = set(map(id, self.direct))
        object.__setattr__(self, "apply_edges", tuple(p for p in self.edges if id(p) not in direct))
        object.__setattr__(self, "returned", tuple(
            (k, clone) for k, (p, clone) in enumerate(zip(self.edges, self.clone)) if id(p) not in direct))

    @classmethod
    def at_capture(cls, backprop: Sequence[torch.nn.Parameter], visible: AbstractSet[int],
                   eager_visible: AbstractSet[int], accumulate_into_main_grad: bool, clone_returned: bool) -> "Routing":
        """The routing fixed when the forward is captured.

        ``visible``: ids of the leaves the captured (recomputation-bypassed) forward reaches from its outputs;
        ``eager_visible``: those an eager forward reaches (recomputation on); ``accumulate_into_main_grad``: add
        into ``main_grad`` where a parameter has one; ``clone_returned``: clone returned parameter gradients
        (never those of ``skip_backward_post_hook`` parameters).
        """
        backprop = tuple(backprop)
        into = tuple(p for p in backprop if accumulate_into_main_grad and protocol.has_main_grad(p))
        into_ids = set(map(id, into))
        edges = tuple(p for p in backprop if id(p) not in into_ids or id(p) in eager_visible)
        return cls(
            backprop=backprop,
            hidden=tuple(p for p in backprop if id(p) not in visible),
            into_main_grad=into,
            edges=edges,
            clone=tuple(clone_returned and not protocol.skips_backward_post_hook(p) for p in edges),
        )

    def summed_through_autograd(self, param_ids: AbstractSet[int]) -> "Routing":
        """This routing with the parameters of ``param_ids`` no longer added into ``main_grad`` by the graph
        (they are edges already: their gradients are returned and autograd sums them)."""
        return replace(self, into_main_grad=tuple(p for p in self.into_main_grad if id(p) not in param_ids))

    def reporting_directly(self, params: Sequence[torch.nn.Parameter]) -> "Routing":
        """This routing with ``params`` (edges whose gradient goes into ``main_grad``) reported by the replay
        itself, no longer inputs of the replay node.

        Raises:
            ValueError: for a parameter that is not such an edge.
        """
        chosen = set(map(id, params))
        if not chosen <= set(map(id, self.edges)) & set(map(id, self.into_main_grad)):
            raise ValueError("only edge parameters accumulated into main_grad can be reported by the replay")
        return replace(self, direct=tuple(p for p in self.edges if id(p) in chosen))
