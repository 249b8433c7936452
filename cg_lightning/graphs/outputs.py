"""The structure of a graphed call's outputs: tensors, and constant leaves kept from the capture.

A graph returns tensors only. A layer may return them inside tuples, lists, dicts or other registered pytree
nodes (Hugging Face registers its ``ModelOutput`` classes), among constant leaves: ``None`` for an attention
map not asked for (``(hidden, None)``, a T5 encoder block's ``(hidden, position_bias, None)``), flags, sizes,
names. :func:`split_outputs` records the structure of one call's output with its constants;
:meth:`OutputStructure.rebuild` puts the graph's static output tensors back in their slots and the recorded
constants everywhere else, so a replay returns what an eager call returns.

Only values whose identity cannot matter are kept as constants (:data:`CONSTANT_TYPES`): a replay hands every
caller the object of the capture. Any other leaf (a cache object filled in place, a module, a list subclass the
pytree does not know) raises :class:`OutputStructureError` naming its place in the output.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from .. import torch_compat
from .errors import OutputStructureError

#: leaf types a graphed call may return besides tensors: immutable values, kept from the capture
CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
                  torch.memory_format, type(Ellipsis))



class OutputStructure:
    """Where the tensors of one call's output go, and the constant leaves around them.

    Built by :func:`split_outputs`. ``num_tensors``: how many tensor leaves; ``single``: the output is one
    tensor (no pytree at replay); ``constants``: whether any non-tensor leaf was recorded.
    """

    def __init__(self, leaves: Sequence[object], spec) -> None:
        self.spec = spec
        self._template = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        self._slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.num_tensors = len(self._slots)
        self.constants = self.num_tensors != len(leaves)
        marker = object()
        self.single = len(leaves) == 1 and not self.constants and torch_compat.tree_unflatten([marker], spec) is marker

    def rebuild(self, tensors: Sequence[torch.Tensor]):
        """The output with ``tensors`` (``num_tensors`` of them, in flattening order) in the tensor slots."""
        if self.single:
            return tensors[0]
        if not self.constants:
            return torch_compat.tree_unflatten(list(tensors), self.spec)
        leaves = list(self._template)
        for i, t in zip(self._slots, tensors):
            leaves[i] = t
        return torch_compat.tree_unflatten(leaves, self.spec)


def split_outputs(out) -> Tuple[List[torch.Tensor], OutputStructure]:
    """``out``'s tensor leaves in flattening order, and its :class:`OutputStructure`.

    Raises:
        OutputStructureError: for a leaf of another type than a tensor or :data:`CONSTANT_TYPES` (the message
            names its type and place, e.g. ``output[2]``), or an output without any tensor.
    """
    leaves, spec = torch_compat.tree_flatten(out)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if len(tensors) != len(leaves):
        for path, x in torch_compat.tree_flatten_with_path(out)[0]:
            if not isinstance(x, torch.Tensor) and type(x) not in CONSTANT_TYPES:
                raise OutputStructureError(
                    f"returns a {type(x).__name__} at output{torch_compat.keystr(path)}: besides tensors a graphed "
                    "layer may return only constants (None, bool, int, float, str, torch.dtype, torch.device), "
                    "which a replay returns as captured; an object like this one may change between calls"
                )
    if not tensors:
        raise OutputStructureError(f"returns no tensor ({type(out).__name__}): a graph has nothing to return")
    return tensors, OutputStructure(leaves, spec)
