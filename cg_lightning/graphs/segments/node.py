"""One autograd node for a whole segment (``graphs.segments``), instead of one replay node per member.

With per-member nodes, each of the 12 block calls of a chained segment went through
``ReplayFunction.apply`` and left a backward node whose only work, for all but one, was an identity check
(in a profile of a replayed step the layer dispatch and the replay nodes were the largest host costs). Here the segment's first call applies :class:`SegmentFunction` once: its forward replays every
member (the first launches the segment's forward graph; the others only run their checks and return their
static outputs) and returns the outputs of *all* members, which therefore all have this node as
``grad_fn``. Each following member's call gets its output handed from the segment (:class:`HandedOutputs`)
after checking that it was called with exactly the previous member's output, unchanged.

The backward receives one gradient per member output. Only the last member's may be set; a gradient for an
intermediate output means it was used outside the chain (an auxiliary loss on a hidden state) after capture,
which the segment's backward graph never saw: :class:`~.errors.SegmentError` naming the layer, as before.
A gradient hook, or ``retain_grad()``, on an intermediate output would never run (no gradient is computed
for it outside the graph), so one found there at the backward is refused the same way. Then the members'
backward replays run in reverse order, exactly as their per-member nodes ran (same notifications, same
order); the node returns the first member's input gradients and every member's parameter-edge gradients.
"""

from __future__ import annotations

import operator
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.autograd.function import once_differentiable

from ...torch_compat import VERSION as _VERSION, grad_hooks
from ..buffer_reuse import check_shared_inputs
from ..replay.replay_node import check_leaves_accumulate, check_second_backward
from .chains import rng_moved, rng_state
from .context import has_context
from ..errors import SegmentError

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def hook_on_intermediate(runners: Sequence, follower) -> str:
    """The message for a gradient hook or ``retain_grad()`` found on the output that ``follower`` is handed."""
    prev = runners[runners.index(follower) - 1]
    return (
        f"graphed {prev.name!r} is inside a segment (graphs.segments=true): a gradient hook or retain_grad() was "
        "put on its output after capture; inside a segment no gradient is computed for that output outside the "
        "graph (the hook would see None or never run). Register it from the first training step on (the recorded "
        "steps then end the segment there), or set graphs.segments=false for this model."
    )


class HandedOutputs:
    """Per forward pass of one segment: for each following member, the tensor it must be called with (the
    previous member's output), the output to return and its parameters' version counters after the launch."""

    def __init__(self) -> None:
        self._pending: Dict[int, Tuple[torch.Tensor, object, tuple]] = {}
        #: the intermediate outputs, held until the backward (or the next pass) to look for hooks on them;
        #: they are views of the segment's static outputs, so holding them keeps no extra memory
        self.intermediate: List[torch.Tensor] = []
        self.rng: Optional[torch.Tensor] = None  # the device RNG state after the launch (members that draw)

    def start(self, runners: Sequence, outputs: Sequence, rng: Optional[torch.Tensor]) -> None:
        """After the launch: every member's ``outputs`` (structured as its layer returns them)."""
        expected = outputs[:-1]
        self._pending = {id(r): (x, out, tuple(map(_VERSION, r.module_params)))
                         for r, x, out in zip(runners[1:], expected, outputs[1:])}
        self.intermediate = list(expected)
        self.rng = rng

    def release(self) -> None:
        """Drop the held outputs (they reference the segment's node, which references this object)."""
        self._pending, self.intermediate = {}, []

    def pending(self, runner) -> bool:
        return id(runner) in self._pending

    def take(self, runner) -> Optional[Tuple[torch.Tensor, object, tuple]]:
        """``(expected input, output, parameter versions)`` for ``runner`` in this pass, or ``None`` if the
        segment did not launch for it (its first call ran eagerly, or ``runner`` was already called)."""
        return self._pending.pop(id(runner), None)


def launch(segment, tensors: Sequence[torch.Tensor], device: torch.device):
    """The segment's first call: apply :class:`SegmentFunction` and return the first member's output; the
    others wait in ``segment.handed`` for :func:`follow`.

    Raises:
        SegmentError: a member's parameter edge was frozen after capture (autograd would drop the whole chain,
            and the engine's missing-gradient error would name the other layers).
    """
    runners = segment.node_runners
    for r in runners:
        if not all(map(_REQUIRES_GRAD, r.apply_edges)):
            names = {id(p): n for n, p in r.module.named_parameters()}
            frozen = [names.get(id(p), "?") for p in r.apply_edges if not p.requires_grad]
            raise SegmentError(
                f"graphed {r.name!r} is inside a segment (graphs.segments=true) and its parameter(s) {frozen} "
                "were frozen after capture. Freezing or unfreezing parameters during training is not supported "
                "with graphed layers: do it before the first training step (or in a new fit)."
            )
    if segment.handed is not None:
        segment.handed.release()  # the previous pass's, if its backward never ran
    segment.handed = handed = HandedOutputs()  # the node's forward keeps it for its backward's checks
    # the members' parameter edges in reverse member order: a parameter that several members return a gradient
    # for (a block applied twice) gets the shares summed by autograd in the order eager backward delivers them,
    # the last call's first
    flat = SegmentFunction.apply(segment, *tensors, *[e for r in reversed(runners) for e in r.apply_edges])
    outputs, start = [], 0
    for r in runners:
        n = len(r.output_requires_grad)
        outputs.append(r.output_structure(flat[start:start + n]))
        start += n
    handed.start(runners, outputs, rng_state(device) if segment.members_draw else None)
    return outputs[0]


def follow(runner, args: tuple, kwargs: dict, device: torch.device):
    """A following member's call: the output :func:`launch` computed for it, or ``None`` when the segment did
    not launch in this pass (the caller then runs the layer eagerly; a member's output is never ``None``).

    Raises:
        SegmentError: naming the layer, when the call is not what the segment computed for it: another
            argument than the previous member's output itself, other arguments than the shared context of the
            segment's first call (:meth:`.context.SharedContext.check`), other autocast or train/eval settings, an
            in-place change of that output or of the layer's parameters since the launch, a gradient hook on
            that output, or (last member) a random draw between the calls of a segment whose layers draw.
    """
    segment = runner.segment
    entry = segment.handed.take(runner) if segment.handed is not None else None
    if entry is None:
        return None
    expected, out, versions = entry
    name = runner.name
    context = has_context(runner)
    if not args or args[0] is not expected or (not context and (kwargs or len(args) != 1)):
        raise SegmentError(
            f"graphed {name!r} is inside a segment (graphs.segments=true) whose graphs already ran for this pass, "
            "but it was not called with the previous layer's output itself (another tensor, a view or a detached "
            "copy of it, or extra arguments). A segment replays all or none of its layers. Keep the chain "
            "x = layer(x), or set graphs.segments=false for this model."
        )
    if context:
        segment.context.check(runner, args, kwargs)  # the first call's other arguments: SegmentError
    if not runner.settings.match():
        raise SegmentError(
            f"graphed {name!r} is inside a segment (graphs.segments=true) whose graphs already ran for this pass, "
            "but it was called under other settings than captured:\n  " + "\n  ".join(runner.mismatches(args, kwargs))
            + "\nA segment replays all or none of its layers. Set graphs.segments=false for this model."
        )
    check_shared_inputs(runner, args)  # changed in place since it was returned: SegmentError
    if grad_hooks(expected) or expected.retains_grad:
        raise SegmentError(hook_on_intermediate(segment.node_runners, runner))
    if tuple(map(_VERSION, runner.module_params)) != versions:
        raise SegmentError(
            f"graphed {name!r} is inside a segment (graphs.segments=true) and one of its parameters was changed in "
            "place after the segment's graphs ran this layer for this pass (at the segment's first call), e.g. "
            "clamped or renormalized between the layer calls. Change parameters outside the forward (before the "
            "step's first layer call), or set graphs.segments=false for this model."
        )
    if segment.handed.rng is not None and runner is segment.node_runners[-1] \
            and rng_moved(segment.handed.rng, rng_state(device)):
        raise SegmentError(
            f"graphed {name!r} is the last layer of a segment (graphs.segments=true) whose layers draw random "
            "numbers (dropout), and random numbers were drawn between its layer calls after capture: the "
            "segment's graphs made all its layers' draws at its first call, so the draws would come in another "
            "order than without graphs. Draw them before the segment's first layer or after its last one (or "
            "from the first training step on: the recorded steps then end the segment there), or set "
            "graphs.segments=false for this model."
        )
    return out


class SegmentFunction(torch.autograd.Function):
    """``apply(segment, *first_member_inputs, *edges of every member, last member first)`` -> every member's
    flat outputs, in member order. ``segment``: the forward :class:`~.graphs.SegmentState` with ``node_runners`` set."""

    @staticmethod
    def forward(ctx, segment, *tensors):
        ctx.set_materialize_grads(False)  # an output nobody used gets None: the intermediate outputs
        runners = segment.node_runners
        ctx.segment = segment
        ctx.backward_ran = False
        ctx.runners = runners
        ctx.runner = runners[0]
        outs = tensors[: runners[0].num_inputs]
        flat, sizes, generations, non_diff = [], [], [], []
        for r in runners:
            # a following member: the previous member's output, then its shared context (the static inputs the
            # launch filled: nothing to copy)
            x = outs if r is runners[0] else (*outs, *r.static_inputs[len(outs):])
            outs = r.replay_forward(x)
            generations.append(r.forward_generation)
            sizes.append(len(outs))
            non_diff.extend(o for o, g in zip(outs, r.output_requires_grad) if not g)
            flat.extend(outs)
        ctx.sizes = sizes
        ctx.generations = generations
        ctx.edge_counts = [len(r.apply_edges) for r in runners]
        ctx.intermediate = segment.handed
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(flat)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs):
        runners = ctx.runners
        check_second_backward(ctx, runners[-1])  # the member whose backward runs first
        check_leaves_accumulate(ctx, runners, sum(ctx.edge_counts))
        per_member, start = [], 0
        for size in ctx.sizes:
            per_member.append(grad_outputs[start:start + size])
            start += size
        for r, grads in zip(runners[:-1], per_member[:-1]):
            if any(g is not None for g in grads):
                raise SegmentError(
                    f"graphed {r.name!r} is inside a segment (graphs.segments=true): its output got a gradient "
                    "from outside the chain (it is also used elsewhere, e.g. kept for an auxiliary loss), but the "
                    "segment's backward graph computes that output's gradient from the next layer alone. Set "
                    "graphs.segments=false for this model."
                )
        handed, ctx.intermediate = ctx.intermediate, None
        held = handed.intermediate
        handed.release()
        for k, t in enumerate(held):
            if grad_hooks(t) or t.retains_grad:
                raise SegmentError(hook_on_intermediate(runners, runners[k + 1]))
        del held
        for r, generation in zip(runners, ctx.generations):
            r.check_generation(generation)
        results: List[tuple] = [()] * len(runners)
        for k in reversed(range(len(runners))):
            r = runners[k]
            grads = per_member[k] if k == len(runners) - 1 else r.static_grad_outputs
            results[k] = r.replay_backward(grads)
        first = results[0][: runners[0].num_inputs]
        edges = [g for r, res in zip(reversed(runners), reversed(results)) for g in res[r.num_inputs:]]
        return (None, *first, *edges)
