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
from typing import Callable, List, Optional

import torch

from .. import torch_compat
from .autocast import autocast_state
from .grad_layouts import watch_grad_layouts
from .segments import rng_state
from .segments.context import version as context_version
from .signature import CallSignature


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
    #: the layout eager backward computes on (:func:`.grad_layouts.static_grad_output_buffer`)
    grad_output_layouts: Optional[list] = None


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
    out = forward(*args, **kwargs)
    record.grad_output_layouts = watch_grad_layouts(out)  # before output_hooks: the hook is part of them
    if segments:
        record.rng_after = rng_state(device)
    if segments and isinstance(out, torch.Tensor):
        record.output = out.detach()  # held, so no later tensor can reuse its memory before capture
        record.output_version = torch_compat.version(out)
        record.output_node = out.grad_fn  # to see in this step's backward who else uses the output
        record.output_hooks = tuple(torch_compat.grad_hooks(out) or ())
    return out


def _detach_tree(tree):
    return torch_compat.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)
