"""Parameter discovery: which of a layer's parameters its captured backward must produce gradients for.

A parameter used only inside activation recomputation (``CheckpointWithoutOutput``) has no autograd edge
from the layer's outputs: the forward ran it under ``no_grad``. During warmup recomputation is bypassed,
so the same parameter is reachable from the warmup outputs. ``params_to_backprop`` is the union of both
reachable sets, filtered to the parameters the layer owns, in ``layer.parameters()`` order so capture and
replay share one positional layout (Megatron-LM PR #6373).
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch


def reachable_leaves(outputs: Iterable[torch.Tensor]) -> Set[int]:
    """``id`` of every leaf tensor whose ``AccumulateGrad`` node is reachable from ``outputs``."""
    return {id(t) for t in leaf_tensors(outputs)}


def leaf_tensors(outputs: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """Every leaf tensor (one with an ``AccumulateGrad`` node) reachable from ``outputs``, each once."""
    found: Dict[int, torch.Tensor] = {}
    # Python wrappers of autograd nodes are created on access and may die, and a dead wrapper's id can
    # be reused by another node: keep every visited wrapper alive so ``id`` stays a valid identity.
    seen: Dict[int, object] = {}
    stack = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    for o in outputs:
        if isinstance(o, torch.Tensor) and o.grad_fn is None and o.requires_grad:
            found.setdefault(id(o), o)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # a torch autograd node: only AccumulateGrad nodes have one
        if isinstance(variable, torch.Tensor):
            found.setdefault(id(variable), variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())


def autograd_edges(root, stop: Optional[object] = None) -> Iterator[Tuple[object, object]]:
    """Every edge ``(node, next_node)`` of the autograd graph below the node ``root``, each node expanded once
    (``stop``, if given, is not expanded). Python wrappers of autograd nodes are created on access and may
    die, and a dead wrapper's id can be reused by another node: every visited wrapper is kept alive until
    the walk ends, so ``id`` stays an identity for the caller too."""
    seen: Dict[int, object] = {id(root): root}
    stack = [root]
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            yield node, nxt
            if nxt is not stop and id(nxt) not in seen:
                seen[id(nxt)] = nxt
                stack.append(nxt)


def leaves_inside(outputs: Iterable[torch.Tensor], inputs: Iterable[torch.Tensor]) -> Set[int]:
    """``id`` of the leaves reachable from ``outputs`` without passing through ``inputs``.

    Applied to a reentrant recomputation region run without checkpointing: the leaves found are those
    the region's own nested backward would finalize in eager execution (the region's inputs are detached
    there, so nothing upstream of them belongs to that backward).
    """
    stop_nodes: Set[int] = set()
    stop_leaves: Set[int] = set()
    keep: Dict[int, object] = {}
    for t in inputs:
        if t.grad_fn is not None:
            stop_nodes.add(id(t.grad_fn))
            keep[id(t.grad_fn)] = t.grad_fn
        else:
            stop_leaves.add(id(t))
    found: Set[int] = set()
    seen: Dict[int, object] = {}
    stack = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or id(node) in stop_nodes:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # a torch autograd node: only AccumulateGrad nodes have one
        if isinstance(variable, torch.Tensor):
            if id(variable) not in stop_leaves:
                found.add(id(variable))
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def params_to_backprop(owned: Sequence[torch.nn.Parameter], *reachable: Set[int]) -> List[torch.nn.Parameter]:
    """The parameters of ``owned`` (in its order) that require grad and appear in any ``reachable`` set."""
    union: Set[int] = set().union(*reachable)
    return [p for p in owned if p.requires_grad and id(p) in union]


def owned_parameters(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """``module.parameters()`` (recursive, de-duplicated), in order."""
    return list(module.parameters())
