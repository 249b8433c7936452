"""Recording the calls of an eagerly run training step, to capture them later.

In a recorded step (the last warmup step, or under ``shape_policy="recapture"`` a step with a new lead
signature) every call of a graphed layer runs eagerly through :func:`record_call`, which keeps in a
:class:`CallRecord` what capture needs: the layer, its call index in the step, the call's signature and
detached arguments, its autocast settings and the layouts of the gradients its output receives; with
``graphs.segments`` also the version counters, gradient hooks and random states around the call, from which
:func:`~.segments.find_segments` decides where segments end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from ... import torch_compat
from ..autocast import autocast_state
from ..recompute.discovery import autograd_edges
from ..replay.grad_layouts import watch_grad_layouts
from ..segments import rng_state
from ..segments.context import version as context_version
from ..signature import CallSignature


@dataclass
class CallRecord:
    """One eager call of a graphed layer, kept to capture it later (arguments detached)."""

    layer: object  # the :class:`~.selection.GraphedLayer` called
    index: int
    signature: CallSignature
    args: tuple
    kwargs: dict
    #: the call's output when it is one tensor (detached), kept until capture to find segments, and the
    #: version counters of its first tensor argument before the call and of its output after it (an
    #: in-place change between two calls breaks the chain)
    output: Optional[object] = None
    input_version: Optional[int] = None
    output_version: Optional[int] = None
    #: graphs.segments: the version counters of the call's tensor arguments after the first, before the call
    #: (``None`` for the other arguments; empty for a call with one argument): a segment's shared context
    #: changed in place between two calls ends the segment there (segments.shares_context)
    context_versions: tuple = ()
    #: the autocast settings in force at the call (:func:`.autocast.autocast_state`)
    autocast: Optional[tuple] = None
    #: graphs.segments: the output's autograd node (kept until capture), and whether the recorded step's
    #: backward reached that output from anywhere but the next call (segments.mark_outside_uses)
    output_node: Optional[object] = None
    output_used_elsewhere: bool = False
    #: graphs.segments: some recorded micro-batch showed a reason to end a segment after this call (set at
    #: capture from all recorded micro-batches: an outside use, a hook added or a random draw in between)
    ends_segment: bool = False
    #: graphs.segments: the random generator state of the layer's device just before and just after the call
    #: (a draw between two calls ends the segment: its graph would reserve both calls' draws at launch)
    rng_before: Optional[torch.Tensor] = None
    rng_after: Optional[torch.Tensor] = None
    #: graphs.segments: the gradient hooks (``register_hook`` handle ids) on the first argument when the call
    #: was made and on the output when it returned (a hook added in between ends the segment there)
    input_hooks: tuple = ()
    output_hooks: tuple = ()
    #: per flattened output, the strides of the gradient the recorded step's backward handed it (``None``
    #: where none came): the layout the backward graph's gradient-output buffers take, so a replay computes on
    #: the layout eager backward computes on (:func:`..replay.grad_layouts.static_grad_output_buffer`)
    grad_output_layouts: Optional[list] = None
    #: the autograd nodes of the inputs that require grad and of the outputs (kept until the step's backward),
    #: and whether that backward reached an input from outside the call as well as from two or more of its own
    #: nodes (:func:`mark_inputs_used_elsewhere`)
    input_nodes: tuple = ()
    output_nodes: tuple = ()
    input_used_elsewhere: bool = False


@dataclass
class StepRecord:
    """The calls of one eagerly run training step, under the step's lead signature."""

    lead: CallSignature
    calls: List[CallRecord] = field(default_factory=list)


def record_call(record: StepRecord, layer, index: int, args: tuple, kwargs: dict, segments: bool,
                device: torch.device):
    """Run call ``index`` of ``layer`` (a :class:`~.selection.GraphedLayer`) eagerly and append its
    :class:`CallRecord` to ``record``; returns the call's output."""
    call = CallRecord(layer, index, CallSignature(args, kwargs), _detach_tree(args), _detach_tree(kwargs),
                      autocast=autocast_state())
    record.calls.append(call)
    return run_recorded(call, layer.forward, args, kwargs, segments, device)


def run_recorded(record: CallRecord, forward: Callable, args: tuple, kwargs: dict, segments: bool,
                 device: torch.device):
    """Run a recorded call eagerly, ``forward(*args, **kwargs)``, and keep in ``record`` what its capture needs:
    its gradient layouts and, with ``segments``, the version counters, hooks and random states that decide
    where segments end."""
    if segments:
        if args and isinstance(args[0], torch.Tensor):
            record.input_version = torch_compat.version(args[0])
            record.input_hooks = tuple(torch_compat.grad_hooks(args[0]) or ())
        if kwargs or len(args) > 1:
            rest = torch_compat.tree_flatten((args, kwargs))[0][1:]
            record.context_versions = tuple(context_version(x) if isinstance(x, torch.Tensor) else None for x in rest)
        record.rng_before = rng_state(device)
    record.input_nodes = tuple(t.grad_fn for t in record.signature.tensor_leaves(args, kwargs)
                               if t.requires_grad and t.grad_fn is not None)
    out = forward(*args, **kwargs)
    if record.input_nodes:
        record.output_nodes = tuple(t.grad_fn for t in torch_compat.tree_flatten(out)[0]
                                    if isinstance(t, torch.Tensor) and t.grad_fn is not None)
    record.grad_output_layouts = watch_grad_layouts(out)  # before output_hooks: the hook is part of them
    if segments:
        record.rng_after = rng_state(device)
    if segments and isinstance(out, torch.Tensor):
        record.output = out.detach()  # held, so no later tensor can reuse its memory before capture
        record.output_version = torch_compat.version(out)
        record.output_node = out.grad_fn  # to see in this step's backward who else uses the output
        record.output_hooks = tuple(torch_compat.grad_hooks(out) or ())
    return out


def mark_inputs_used_elsewhere(loss: torch.Tensor, calls: List[CallRecord]) -> None:
    """Before the backward of a recorded step: set ``input_used_elsewhere`` on each call one of whose inputs
    the backward reaches both from outside the call (a hidden state kept for the loss, an encoder output that
    several decoder blocks read) and from two or more of the call's own nodes. Eager autograd adds those pieces
    one by one; such a call's capture hands them back one by one too (:mod:`..replay.input_pieces`) instead of summed.
    Drops the nodes."""
    root = getattr(loss, "grad_fn", None)
    watched = [c for c in calls if c.input_nodes and c.output_nodes]
    if root is not None and watched:
        owners: dict = {}  # id(input node) -> [(call, ids of the call's own nodes, [inside edges, outside edges])]
        alive = []  # the node wrappers whose ids are compared: kept until the walk ends (ids stay identities)
        for call in watched:
            stops = {id(n) for n in call.input_nodes}
            nodes = _nodes_above(call.output_nodes, stops)
            alive.append(nodes)
            own = {id(n) for n in nodes}
            for node in call.input_nodes:
                owners.setdefault(id(node), []).append((call, own, [0, 0]))
        for node, nxt in autograd_edges(root):
            for _, own, counts in owners.get(id(nxt), ()):
                counts[id(node) not in own] += 1
        for entries in owners.values():
            for call, _, (inside, outside) in entries:
                if inside >= 2 and outside >= 1:
                    call.input_used_elsewhere = True
    for call in calls:
        call.input_nodes = call.output_nodes = ()


def _nodes_above(outputs: Sequence[object], stops: set) -> List[object]:
    """The autograd nodes from ``outputs`` down to (not including) the nodes whose id is in ``stops``."""
    found = {id(n): n for n in outputs if id(n) not in stops}
    stack = list(found.values())
    while stack:
        for nxt, _ in stack.pop().next_functions:
            if nxt is not None and id(nxt) not in stops and id(nxt) not in found:
                found[id(nxt)] = nxt
                stack.append(nxt)
    return list(found.values())


def _detach_tree(tree):
    return torch_compat.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)
