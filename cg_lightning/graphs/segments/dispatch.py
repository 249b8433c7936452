"""A segment member's call at replay (``graphs.segments``): launch, handed output, or eager.

:class:`~..set_replay.SetReplay` hands a call here when its runner belongs to a segment. The segment's first
call launches it (:func:`launch`: one autograd node for all members, :mod:`.node`). A following member
(:func:`follow`) gets the output the launch computed for it, after the checks of :func:`.node.follow`, or runs
eagerly when the segment's first call ran eagerly in this pass: a segment replays all or none of its calls. A
segment whose backward stays one graph per member (a member's output needs no gradient) has no such node: its
first call launches the forward graph from its own replay node, and each following member replays its own node
(:func:`follow` returns :data:`NOT_HANDED`).

``replay`` below is the step's :class:`~..set_replay.SetReplay`; of it these functions use ``device``,
``count_replay(runner)`` and ``eager(layer, args, kwargs)``. ``layer`` is a :class:`~..selection.GraphedLayer`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ... import torch_compat
from . import node
from .context import has_context
from ..errors import SegmentError

#: what :func:`follow` returns when the member replays through its own node
NOT_HANDED = object()


def launch(replay, segment, tensors: Sequence[torch.Tensor], args: tuple, kwargs: dict):
    """The first call of a segment replayed through one autograd node: its output (:func:`.node.launch`)."""
    start(segment, args, kwargs)
    out = node.launch(segment, tensors, replay.device)
    replay.count_replay(segment.node_runners[0])
    return out


def start(segment, args: tuple, kwargs: dict) -> None:
    """At a segment's launch (its first call, ``args`` and ``kwargs``): keep its shared context, if its members
    take one, for the following members' checks (:class:`.context.SharedContext`)."""
    if segment.context is not None:
        segment.context.start(args, kwargs)


def follow(replay, layer, runner, args: tuple, kwargs: dict):
    """A following member's call: its handed output, an eager call when the segment's first call ran eagerly
    in this pass, or :data:`NOT_HANDED` (a segment without one node whose launch ran: the member replays its
    own node).

    Raises:
        SegmentError: naming the layer, when it got a forward pre-hook after capture, or when the call is not
            what the segment computed for it (:func:`.node.follow`; without one node: other arguments than the
            shared context of the segment's first call, :meth:`.context.SharedContext.check`).
    """
    if torch_compat.module_hooks(layer.module)["forward_pre_hooks"]:
        raise SegmentError(
            f"graphed {layer.name!r} is inside a segment (graphs.segments=true) and got a forward pre-hook "
            "after capture: the segment's graph ran this layer at the segment's first call, before the hook. "
            "Register the hook before the first training step (the segment then ends before this layer), or "
            "set graphs.segments=false for this model."
        )
    segment = runner.segment
    if segment.node_runners is not None:
        out = node.follow(runner, args, kwargs, replay.device)
        if out is None:  # the segment's first call ran eagerly in this pass: so does the rest
            return replay.eager(layer, args, kwargs)
        _done(segment, runner)
        replay.count_replay(runner)
        return out
    if not segment.launched_for(runner):
        return replay.eager(layer, args, kwargs)
    if has_context(runner):  # the segment's graph ran this member on the first call's shared context
        segment.context.check(runner, args, kwargs)
    _done(segment, runner)
    return NOT_HANDED


def _done(segment, runner) -> None:
    """After the checks of a following member's call: the last member's releases the shared context."""
    if segment.context is not None and runner is segment.member_runners[-1]:
        segment.context.release()


def refuse_other_arguments(layer, runner, args: tuple, kwargs: dict) -> None:
    """Raise for a following member, replaying its own node, whose call differs from the captured one: the
    segment's graph already ran it for this pass.

    Raises:
        SegmentError: always, listing the differences.
    """
    raise SegmentError(
        f"graphed {layer.name!r} is inside a segment (graphs.segments=true) whose graphs already ran "
        "for this pass, but it was called with other arguments than captured:\n  "
        + "\n  ".join(runner.mismatches(args, kwargs))
        + "\nA segment replays all or none of its layers. Set graphs.segments=false for this model."
    )


def refuse_pending_member(layer, runner) -> None:
    """Raise if ``runner`` (the one of ``layer``'s next call in this step, or ``None``) is a following member
    that its segment already ran for this pass, while ``layer`` is called in eval mode or without gradients
    in the middle of a training forward.

    Raises:
        SegmentError: naming the layer.
    """
    segment = runner.segment if runner is not None else None
    if segment is None or segment.handed is None or not segment.handed.pending(runner):
        return
    raise SegmentError(
        f"graphed {layer.name!r} is inside a segment (graphs.segments=true) whose graphs already ran it for this "
        f"pass, but it was called {'in eval mode' if not layer.module.training else 'with gradients disabled'}. "
        "A segment replays all or none of its layers; set graphs.segments=false for this model."
    )
