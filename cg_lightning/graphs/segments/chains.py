"""Finding segments: which consecutive recorded calls chain (the rules are in :mod:`cg_lightning.graphs.segments`)."""

from __future__ import annotations

from typing import List, Sequence, Set, Tuple

import torch

from ...torch_compat import global_module_hooks, module_hooks, tree_flatten
from ..recompute.discovery import autograd_edges
from ..signature import _same_value

#: the types of the non-tensor arguments a segment's members may share (a cache or any other mutable object: no)
CONSTANTS = (type(None), bool, int, float, str)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def find_segments(calls: Sequence) -> List[List[int]]:
    """Split recorded calls (``CallRecord`` with ``output`` kept) into runs where each call's first argument
    is the previous call's output and its other arguments are the run's shared context (:func:`shares_context`);
    returns lists of indices into ``calls``, singletons included, in order."""
    segments: List[List[int]] = []
    for i, call in enumerate(calls):
        if segments and i > 0 and _chains(calls[i - 1], call):
            segments[-1].append(i)
        else:
            segments.append([i])
    return segments


def _chains(prev, call) -> bool:
    out = prev.output
    if out is None or not call.args or not isinstance(call.args[0], torch.Tensor):
        return False
    if not shares_context(prev, call):
        return False
    if call.input_version is None or call.input_version != prev.output_version:
        return False  # changed in place between the two calls
    if prev.ends_segment or breaks_between(prev, call):
        return False
    if _module_hooks_between(prev.layer.module, call.layer.module):
        return False  # a hook between the two calls would run when the segment already computed both
    return _same_tensor(call.args[0], out)


def shares_context(prev, call) -> bool:
    """Every argument of recorded ``call`` after its first is shared context: the same as the corresponding
    argument of ``prev`` (same structure of ``(args, kwargs)``): a tensor with the same storage, shape, strides and
    dtype that requires no gradient and was not changed in place between the two calls, or an equal constant
    (``None``, a bool, int, float or string). Pairwise: a call with context follows one with the same context,
    back to the run's first call, so that context existed before the run's first member ran. True for a call
    whose only argument is its first (whatever ``prev`` was called with)."""
    if not call.kwargs and len(call.args) == 1:
        return True
    a, b = prev.signature, call.signature
    if a.spec != b.spec or prev.context_versions != call.context_versions:
        return False
    theirs, _ = tree_flatten((prev.args, prev.kwargs))
    ours, _ = tree_flatten((call.args, call.kwargs))
    for i in range(1, len(ours)):
        x, y = ours[i], theirs[i]
        if b.is_tensor[i]:
            if not a.is_tensor[i] or a.metas[i].requires_grad or b.metas[i].requires_grad or not _same_tensor(x, y):
                return False
        elif a.is_tensor[i] or type(x) not in CONSTANTS or not _same_value(x, y):
            return False
    return True


def breaks_between(prev, call) -> bool:
    """What one recorded micro-batch shows between two consecutive calls that rules out chaining them: the
    backward reached ``prev``'s output from elsewhere, a gradient hook was added on it, or a random draw
    happened in between (the segment's graph reserves every member's draws at launch)."""
    return prev.output_used_elsewhere or call.input_hooks != prev.output_hooks or _random_draw_between(prev, call)


def _module_hooks_between(first: torch.nn.Module, second: torch.nn.Module) -> bool:
    a, b = module_hooks(first), module_hooks(second)
    return bool(
        b.get("forward_pre_hooks") or a.get("forward_hooks")
        or a.get("backward_hooks") or a.get("backward_pre_hooks")
        or b.get("backward_hooks") or b.get("backward_pre_hooks")
        or any(global_module_hooks().values())
    )


def _random_draw_between(prev, call) -> bool:
    return rng_moved(prev.rng_after, call.rng_before)


def draws(call) -> bool:
    """The recorded call drew random numbers from the device's default generator (dropout inside it)."""
    return rng_moved(call.rng_before, call.rng_after)


def rng_moved(a, b) -> bool:
    """Two :func:`rng_state` snapshots differ (``None``: not taken, nothing to tell)."""
    return a is not None and b is not None and not torch.equal(a, b)


def rng_state(device: torch.device) -> torch.Tensor:
    """The state of the default random generator of ``device`` (CUDA: seed and offset; CPU: the whole
    Mersenne state), to compare around recorded calls."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def mark_outside_uses(loss: torch.Tensor, calls: Sequence) -> int:
    """Evidence from a recorded (eager) step, before its backward: sets ``output_used_elsewhere`` on each
    call whose output chains into the next call (:func:`find_segments`) but also reaches ``loss`` by another
    path (an auxiliary loss, a list of hidden states, a skip connection over several blocks), so that
    :func:`find_segments` ends the segment there instead of the first replayed backward raising
    ``SegmentError``. Returns how many calls were marked.

    ``calls``: the step's ``CallRecord`` list, each with ``output`` and ``output_node`` (the output's
    ``grad_fn``) kept. One walk over the loss's autograd graph, plus one over each next call's own nodes;
    every visited node wrapper is kept alive so that ``id`` stays an identity (torch creates wrappers on
    access, and a new one may reuse a freed one's address).
    """
    root = loss.grad_fn
    if root is None:
        return 0
    targets = {}  # id(output node of call k) -> (call k, nodes of call k+1's own graph)
    for prev, call in zip(calls, calls[1:]):
        if prev.output_node is not None and call.output_node is not None and _chains(prev, call):
            targets[id(prev.output_node)] = (prev, _nodes_between(call.output_node, prev.output_node))
    if not targets:
        return 0
    marked = 0
    for node, nxt in autograd_edges(root):
        target = targets.get(id(nxt))
        if target is not None and id(node) not in target[1] and not target[0].output_used_elsewhere:
            target[0].output_used_elsewhere = True
            marked += 1
    return marked


def segment_ends(loss: torch.Tensor, calls: Sequence) -> Set[Tuple[int, int]]:
    """Before the backward of a recorded micro-batch: :func:`mark_outside_uses` on its ``calls``, then
    ``(id(layer), index)`` of every call after which this micro-batch shows a reason to end a segment
    (:func:`breaks_between`). Under gradient accumulation the graph manager keeps what any recorded micro-batch
    showed: the capture sees only the last one's calls."""
    mark_outside_uses(loss, calls)
    return {(id(prev.layer), prev.index) for prev, call in zip(calls, calls[1:]) if breaks_between(prev, call)}


def _nodes_between(start, stop) -> dict:
    """``id -> node`` for the nodes reachable from ``start`` without passing through ``stop`` (a call's own
    autograd graph, from its output node back to its input's), wrappers kept alive."""
    found = {id(start): start}
    for _, nxt in autograd_edges(start, stop=stop):
        if nxt is not stop:
            found[id(nxt)] = nxt
    return found
