"""Grad-ready reported by the replay itself for parameters only one graphed call reaches
(``graphs.direct_grad_ready``).

A replay node normally takes its layer's eagerly visible parameters as extra inputs, so that autograd runs
their ``AccumulateGrad`` nodes (and the DDP engine's hooks there) after the backward replay, exactly as in
eager execution. For a parameter whose gradient the captured backward already added into ``main_grad``,
that edge carries nothing but the notification, at the price of one autograd input, one
``AccumulateGrad`` node and one Python hook per parameter and step (at small model sizes the largest host
cost of a replayed step).

The replay can report such a parameter itself, but only if nothing else reaches its ``AccumulateGrad``:
eager autograd sums every use of a parameter before its node runs and reports it once per outer
backward, so a parameter also used outside the graphed layers (a tied head, a regulariser) or by two
graphed calls (a block applied twice) must keep its edge, or its count would double. Candidates are
therefore chosen from evidence, never guessed:

1. at capture: edge parameters whose gradient goes into ``main_grad`` inside the graph and that are an
   edge of exactly one runner of the graph set, a runner with an input that requires grad (without one,
   its parameter edges are what makes autograd run the replay's backward at all: an embedding);
2. at the first backward in which its runner replayed (the strategy hands the loss in; a step whose call
   ran eagerly leaves it pending): the autograd graph from the loss is walked once, and a candidate is
   confirmed only if its ``AccumulateGrad`` node has exactly one producer, the replay node of its own
   runner (or the one node of the segment it belongs to, :mod:`.segments.node`).

Confirmed parameters lose their edge from the next step on; the replay reports them after its backward
graph ran (after the recorded nested notifications, where their ``AccumulateGrad`` nodes would have run).
Freezing one of them afterwards is refused at the next replay (the graph would keep writing its
``main_grad``).
A later step that reaches one of them from elsewhere makes its count exceed the golden count, which the
DDP engine reports as an error naming the parameter (turn the option off for such a model).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Set, Tuple

import torch

from ..recompute.discovery import autograd_edges


def candidates(runners: Iterable) -> Dict[int, object]:
    """``id(param) -> runner`` for the parameters that may be reported by their runner's replay.

    ``runners``: the :class:`~.runner.LayerGraphRunner` of one graph set, after capture.
    """
    runners = list(runners)
    edge_count: Dict[int, int] = {}
    for r in runners:
        for p in r.edge_params:
            edge_count[id(p)] = edge_count.get(id(p), 0) + 1
    out: Dict[int, object] = {}
    for r in runners:
        if not any(t.requires_grad for t in r.static_inputs):
            # only its parameter edges make autograd run this replay's backward (an embedding: integer ids in)
            continue
        into_main_grad = set(map(id, r.main_grad_params))
        for p in r.edge_params:
            if id(p) in into_main_grad and edge_count[id(p)] == 1:
                out[id(p)] = r
    return out


def confirmed(loss: torch.Tensor, pending: Dict[int, object]) -> Dict[object, List[torch.nn.Parameter]]:
    """The candidates of ``pending`` whose only producer in ``loss``'s autograd graph is their runner's
    replay node, grouped by runner. One walk over the graph (every node once). Call it only for candidates
    whose runner replayed in this step: a runner whose call ran eagerly leaves no replay node to find."""
    producers: Dict[int, List[object]] = {}
    params: Dict[int, torch.nn.Parameter] = {}
    root = loss.grad_fn
    if root is None:
        return {}
    for node, nxt in autograd_edges(root):
        var = getattr(nxt, "variable", None)  # a torch autograd node: only AccumulateGrad nodes have one
        if var is not None and id(var) in pending:
            producers.setdefault(id(var), []).append(node)
            params[id(var)] = var
    out: Dict[object, List[torch.nn.Parameter]] = {}
    for pid, nodes in producers.items():
        runner = pending[pid]
        node = nodes[0]
        # a torch autograd node: only the replay nodes' contexts carry ``runner`` / ``runners``
        if len(nodes) == 1 and (getattr(node, "runner", None) is runner or runner in getattr(node, "runners", ())):
            out.setdefault(runner, []).append(params[pid])
    return out


def confirm_at_backward(loss: torch.Tensor, graph_set,
                        replayed: Set[int]) -> List[Tuple[object, List[torch.nn.Parameter]]]:
    """At the first backward of a step that replayed ``graph_set`` (a :class:`~.graph_sets.GraphSet`): decide the
    pending candidates of the runners that replayed in the step (``replayed``: their ids), one way or the other.
    Returns ``(runner, confirmed parameters)`` pairs for ``runner.report_directly`` at the next step's start;
    the decided candidates leave ``graph_set.direct_pending``, those of runners that ran eagerly stay. Nothing
    is decided (``[]``) without candidates, replays, or a ``loss`` with an autograd graph."""
    if not graph_set.direct_pending or not replayed:
        return []
    pending = {pid: r for pid, r in graph_set.direct_pending.items() if id(r) in replayed}
    if not pending or not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
        return []
    switch = list(confirmed(loss, pending).items())
    graph_set.direct_pending = {pid: r for pid, r in graph_set.direct_pending.items() if pid not in pending}
    return switch
