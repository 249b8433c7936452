"""The layout of the gradient buffers a backward graph reads its output gradients from.

Eager backward computes a layer's backward on whatever layout the consumer of its output hands back (a
contiguous gradient for a transposed or channels-last output, say). A backward graph reads its gradient outputs
from buffers filled by copy; made with the outputs' own layout, a replay would compute on another memory order
than eager, and reductions would sum in another order (up to 1e-7 relative apart). The recorded step notes the
layouts (:func:`watch_grad_layouts`) and the capture allocates the buffers in them
(:func:`static_grad_output_buffer`).
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

import torch

from ... import torch_compat


def watch_grad_layouts(out) -> List[Optional[Tuple[int, ...]]]:
    """A list, one entry per tensor among the flattened outputs of an eager call (constant leaves such as
    ``None`` are skipped, as in the graph's outputs: :mod:`.outputs`), that the call's backward fills with the
    strides of the gradient each tensor receives (``None`` until then, or for tensors without one).

    Eager backward computes a layer's backward on whatever layout the consumer of its output hands back (a
    contiguous gradient for a transposed or channels-last output, say). A backward graph reads its gradient
    outputs from buffers filled by copy; made with the outputs' own layout, a replay would compute on another
    memory order than eager, and reductions would sum in another order (up to 1e-7 relative apart)."""
    leaves, _ = torch_compat.tree_flatten(out)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    layouts: List[Optional[Tuple[int, ...]]] = [None] * len(tensors)
    for i, t in enumerate(tensors):
        if t.requires_grad:
            t.register_hook(functools.partial(_note_layout, layouts, i))
    return layouts


def _note_layout(layouts: list, i: int, grad: Optional[torch.Tensor]) -> None:
    if grad is not None:  # a compiled function's output the loss does not reach is handed None
        layouts[i] = tuple(grad.stride())


def _dense_layout(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` lays ``shape`` out densely without overlap (a permutation of a contiguous layout)."""
    if len(shape) != len(stride):
        return False
    expected = 1
    for size, st in sorted(((n, s) for n, s in zip(shape, stride) if n != 1), key=lambda d: d[1]):
        if st != expected:
            return False
        expected *= size
    return True


def static_grad_output_buffer(output: torch.Tensor, layout: Optional[Sequence[int]]) -> torch.Tensor:
    """A zeroed buffer for the gradient of ``output``: in ``layout`` (the strides of the gradient eager backward
    handed this output, :func:`watch_grad_layouts`) when that is a dense layout of its shape, else in the
    output's own layout (``zeros_like``)."""
    if layout is not None and tuple(layout) != tuple(output.stride()) and _dense_layout(output.shape, layout):
        return torch.empty_strided(output.shape, tuple(layout), dtype=output.dtype, device=output.device).zero_()
    return torch.zeros_like(output)
