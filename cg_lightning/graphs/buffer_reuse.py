"""Memory-saving mode for graphed callables replayed as a chain in a fixed order.

With callables ``f0, f1, ..., fn`` called as ``y = fn(...f1(f0(x)))`` and their backwards replayed in
reverse, three kinds of static memory need not exist separately (the idea of TransformerEngine's
``_reuse_graph_input_output_buffers``; the implementation here is this project's own):

* **static input of f(i+1) = static output of f(i)**: the output already lies in graph memory that stays
  unchanged until f(i)'s next forward replay, which is after f(i+1)'s backward; no copy at replay;
* **static grad-output of f(i) = static grad-input of f(i+1)**: the backward of f(i+1) writes the
  gradient exactly where f(i)'s backward reads it;
* **parameter-gradient outputs** of a backward graph are *released* once the graph is captured when the
  gradients are returned as clones (``clone_param_grads_on_return=True``): the runner keeps a
  non-owning alias, so later captures in the same pool (the earlier callables' backwards, which replay
  after this one) reuse that memory. The clone taken right after each replay makes that safe.

Shared inputs are a contract: calling f(i+1) with anything but f(i)'s output would overwrite memory that
f(i)'s backward may still read, so replay raises instead (:class:`BufferReuseError`).
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from ..torch_compat import non_owning_alias, version
from .errors import BufferReuseError, SegmentError


def copy_into_static(statics: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """Copy each argument into its graph's static input buffer, skipping one that already is that buffer
    (a chained or reused call hands the static tensor itself)."""
    todo = [(static, value) for static, value in zip(statics, values) if static.data_ptr() != value.data_ptr()]
    if todo:  # a chained segment member has nothing to copy: no no_grad context either (2-3 us per call)
        with torch.no_grad():
            for static, value in todo:
                static.copy_(value)


def _same_meta(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def share_inputs_with_previous_outputs(prev, runner) -> List[int]:
    """Make ``runner``'s static input ``j`` an alias of ``prev``'s forward output ``j`` where they match.

    Call after ``prev.capture_forward()`` and before ``runner.capture_forward()``. Returns the shared
    input positions (also stored as ``runner.shared_inputs``).
    """
    outs = prev.forward_outputs
    shared = {}
    for j, static in enumerate(runner.static_inputs):
        if j < len(outs) and outs[j] is not None and _same_meta(outs[j], static):
            shared[j] = outs[j].detach().requires_grad_(static.requires_grad)
    runner.share_inputs(prev, shared)
    return list(shared)


def share_grad_outputs_with_next_grad_inputs(runner, nxt) -> None:
    """Make ``runner``'s static grad-output ``k`` the buffer in which ``nxt``'s backward writes grad-input ``k``.

    Call after ``nxt.capture_backward()`` and before ``runner.capture_backward()``. Only positions where
    ``nxt``'s input ``k`` is ``runner``'s output ``k`` (see :func:`share_inputs_with_previous_outputs`).
    """
    outputs = nxt.backward_outputs
    if outputs is None:
        return
    grad_inputs = outputs[: len(nxt.static_inputs)]
    it = iter(grad_inputs)
    by_input = [next(it) if t.requires_grad else None for t in nxt.static_inputs]
    for k in nxt.shared_inputs:
        if k < len(runner.static_grad_outputs) and runner.static_grad_outputs[k] is not None:
            g = by_input[k]
            if g is not None and _same_meta(g, runner.static_grad_outputs[k]):
                runner.share_grad_output(k, g)


def release_param_grad_outputs(runner) -> int:
    """Replace the cloned parameter-gradient outputs of ``runner``'s backward graph by non-owning aliases.

    Only for the CUDA backend (the eager backend has no pool to give memory back to) and only slots that
    are cloned at every replay. Returns the bytes released.
    """
    outputs = runner.backward_outputs
    if outputs is None or runner.backend.name != "cuda":
        return 0
    n_in = len(outputs) - len(runner.edge_params)
    released = 0
    for k, clone in enumerate(runner.clone_slots):
        t = outputs[n_in + k]
        if clone and t is not None:
            runner.replace_param_grad_output(k, non_owning_alias(t))
            released += t.untyped_storage().nbytes()
    return released


def check_shared_inputs(runner, inputs: Sequence[torch.Tensor]) -> None:
    """Raise if a shared static input was handed another tensor, or the right one changed in place since the
    previous runner returned it (its version counter moved): :class:`~.segments.SegmentError` inside a
    segment, :class:`BufferReuseError` in make_graphed_callables' memory-saving mode."""
    prev = runner.shared_from
    for j in runner.shared_inputs:
        x = inputs[j]
        if x.data_ptr() != runner.static_inputs[j].data_ptr():
            problem = "was called with another tensor than the previous graphed call's output"
        elif prev is not None and j < len(prev.returned_versions) and version(x) != prev.returned_versions[j]:
            problem = "was handed the previous graphed call's output after it was changed in place"
        else:
            continue
        if runner.segment is not None:
            raise SegmentError(
                f"graphed {runner.name!r} is inside a segment (graphs.segments=true) and {problem} (tensor input "
                f"{j}); the segment's graph already computed it from the unchanged output. Keep the chain "
                "x = layer(x) free of in-place changes, or set graphs.segments=false for this model."
            )
        raise BufferReuseError(
            f"graphed callable {runner.name!r} (make_graphed_callables' reuse_graph_buffers=True) {problem} "
            f"(tensor input {j}): that output's graph memory is its static input. Call the callables as a chain "
            "in capture order without in-place changes between them, or capture with reuse_graph_buffers=False."
        )


__all__ = [
    "BufferReuseError",
    "check_shared_inputs",
    "release_param_grad_outputs",
    "share_grad_outputs_with_next_grad_inputs",
    "share_inputs_with_previous_outputs",
]
