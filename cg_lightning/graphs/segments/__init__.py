"""Segments: consecutive graphed calls that feed each other, captured as one forward and one backward graph.

Per-layer graphs cost one graph launch per layer call and direction (24 launches for 12 blocks) plus a
copy of each input into its static buffer. When call k+1's only tensor argument is call k's output (the
plain ``for block in blocks: x = block(x)``), the calls form a *segment*: their static buffers are chained
as in :mod:`.buffer_reuse` (input of k+1 = output of k; grad-output of k = grad-input buffer of k+1) and
their forward bodies are captured into one graph, their backward bodies (in reverse) into another. The
segment's first call applies one autograd node for all members (:mod:`.node`): it launches the
forward graph and returns every member's static output; the following calls get theirs handed over after
checking they were called with the previous member's output.
That node's backward launches the backward graph once and replays the members' grad-ready notifications in
reverse member order, as their own nodes would have. (When a member's output needs no gradient, the
backward stays one graph per member and each call keeps its own replay node.)

What must hold, and is checked at every replay (``SegmentError`` otherwise, naming the layer): a following
member is called with the previous member's output itself (not a view or a detached copy), unchanged (the
same version counter: an in-place change between the two calls is caught), with no other arguments; no
intermediate output gets a gradient from outside the chain (an intermediate output used elsewhere would add
gradient the graph never saw), a gradient hook or ``retain_grad()`` (which would see no gradient); and no
following member got a forward pre-hook. A segment replays all or none of its calls: when its first call
runs eagerly (shape policy), so do the others in that pass.

Found at capture, from the recorded (eager) steps (:func:`find_segments`): two calls chain only if the
second's argument is the first's output (storage, version counter), the recorded backward reached that
output through the second call alone (:func:`mark_outside_uses`, in any recorded micro-batch, when the
strategy hands the loss in), no gradient hook was added on it in between, no random draw happened in
between (the segment's graph reserves every member's draws at launch), and neither a forward pre-hook of
the second layer nor a forward hook of the first would run between them.

Modules: :mod:`.chains` finds the segments in the recorded calls, :mod:`.graphs` captures their members into
one graph per direction, :mod:`.node` replays a segment through one autograd node, :mod:`.dispatch` routes a
member's call at replay (launch, handed output, or eager with the rest of its pass).
"""

from .chains import breaks_between, draws, find_segments, mark_outside_uses, rng_moved, rng_state, segment_ends
from .errors import SegmentError
from .graphs import SegmentState, members_capturing, segment_capture

__all__ = [
    "SegmentError",
    "SegmentState",
    "breaks_between",
    "draws",
    "find_segments",
    "mark_outside_uses",
    "members_capturing",
    "rng_moved",
    "rng_state",
    "segment_capture",
    "segment_ends",
]
