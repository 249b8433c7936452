"""Segments: consecutive graphed calls that feed each other, captured as one forward and one backward graph.

Per-layer graphs cost one graph launch per layer call and direction (24 launches for 12 blocks) plus a
copy of each input into its static buffer. When call k+1's first argument is call k's output (the plain
``for block in blocks: x = block(x)``) and its other arguments, if any, are a *shared context* (below), the
calls form a *segment*: their static buffers are chained as in :mod:`.buffer_reuse` (input of k+1 = output
of k; grad-output of k = grad-input buffer of k+1) and their forward bodies are captured into one graph,
their backward bodies (in reverse) into another. The segment's first call applies one autograd node for all
members (:mod:`.node`): it launches the forward graph and returns every member's static output; the following
calls get theirs handed over after checking they were called with the previous member's output.
That node's backward launches the backward graph once and replays the members' grad-ready notifications in
reverse member order, as their own nodes would have. (When a member's output needs no gradient, the
backward stays one graph per member and each call keeps its own replay node.)

Shared context (:mod:`.context`): Hugging Face decoder layers are called as ``h = layer(h, attention_mask=m,
position_embeddings=(cos, sin), position_ids=p, use_cache=False)``, every argument after ``h`` the same for all
layers of a forward. A call chains to the previous one when each argument after its first, at the same place in
the same structure of ``(args, kwargs)``, is the same as the previous call's, and so the same as the segment's
first call's: a tensor with the same storage, shape, strides and dtype, not changed in place between the calls
and requiring no gradient, or an equal constant (``None``, a bool, int, float or string; any other object, a
cache included, ends the segment). Such a tensor existed before the segment's first member ran, so no member
produced it. The following members' static inputs for it are the first member's: the launch copies it in once,
with the first call's own arguments. A context tensor that requires grad ends the segment: its gradient is the
sum of every member's share, which eager autograd adds up outside the layers, while the segment's backward graph
returns only the first member's input gradients (rotary position embeddings from a module without parameters,
and attention masks, require none).

What must hold, and is checked at every replay (``SegmentError`` otherwise, naming the layer): a following
member is called with the previous member's output itself (not a view or a detached copy), unchanged (the
same version counter: an in-place change between the two calls is caught), with no other arguments than
the shared context of the segment's first call in this pass (the same tensors, unchanged since the launch and
requiring no gradient, and equal constants; another mask object, even with equal values, is refused); no
intermediate output gets a gradient from outside the chain (an intermediate output used elsewhere would add
gradient the graph never saw), a gradient hook or ``retain_grad()`` (which would see no gradient); and no
following member got a forward pre-hook. A segment replays all or none of its calls: when its first call
runs eagerly (shape policy), so do the others in that pass.

Found at capture, from the recorded (eager) steps (:func:`find_segments`): two calls chain only if the
second's first argument is the first's output (storage, version counter) and its other arguments are the
shared context (:func:`~.chains.shares_context`), the recorded backward reached that
output through the second call alone (:func:`mark_outside_uses`, in any recorded micro-batch, when the
strategy hands the loss in), no gradient hook was added on it in between, no random draw happened in
between (the segment's graph reserves every member's draws at launch), and neither a forward pre-hook of
the second layer nor a forward hook of the first would run between them.

Modules: :mod:`.chains` finds the segments in the recorded calls, :mod:`.graphs` captures their members into
one graph per direction, :mod:`.context` shares and checks the members' shared context, :mod:`.node` replays a
segment through one autograd node, :mod:`.dispatch` routes a member's call at replay (launch, handed output, or
eager with the rest of its pass).
"""

from .chains import breaks_between, draws, find_segments, mark_outside_uses, rng_moved, rng_state, segment_ends
from .context import SharedContext, has_context, share_context_inputs
from ..errors import SegmentError
from .graphs import SegmentState, members_capturing, segment_capture

__all__ = [
    "SegmentError",
    "SegmentState",
    "SharedContext",
    "breaks_between",
    "draws",
    "find_segments",
    "has_context",
    "mark_outside_uses",
    "members_capturing",
    "rng_moved",
    "rng_state",
    "segment_capture",
    "segment_ends",
    "share_context_inputs",
]
