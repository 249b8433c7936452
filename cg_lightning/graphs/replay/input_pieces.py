"""A graphed call's input gradients handed back piece by piece, in the order eager autograd adds them.

In eager backward a tensor used by several operations receives one gradient piece from each operation's
backward node, and autograd adds the pieces into the tensor's gradient one by one, in the order the nodes run,
together with the pieces from operations outside the graphed call: ``(outside + a) + b`` for a residual stream
``x + attn(norm(x))`` whose norm reads ``x`` twice. A captured backward returns one gradient per input, ``a + b``
summed inside the graph, which autograd then adds to the rest: ``outside + (a + b)``, another rounding. For a
selected layer called as ``x = layer(x)`` nothing outside uses ``x`` and the two agree; for the parts of a split
layer (:mod:`..split.splitting`) an outside use is the rule: a norm's input is also the residual.

So the backward body of such a call keeps the pieces apart (:class:`InputPieces`): a post hook on every autograd
node with an edge into a static input keeps what that node sends there, in the order the nodes run (edges of one
node in edge order, as autograd adds them). The backward graph returns an input's first piece in the input's
slot and the others in extra slots, and the replay node takes that input once more per extra slot
(:attr:`~.runner.LayerGraphRunner.piece_inputs`), so that autograd adds the pieces one by one, as eagerly. This
assumes that in the whole step's backward no node outside the call runs between two of its nodes that feed the
same input, as autograd's order (the most recently created ready node first) gives for straight-line code.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

Key = Tuple[int, int]  # (position of the node in the walk of :func:`consumers`, edge index)


def consumers(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> List[Tuple[object, list]]:
    """The autograd nodes below ``outputs`` with an edge into the ``AccumulateGrad`` node of an input that
    requires grad, each with its ``(edge index, input index)`` pairs, in a walk order that is the same for the
    same code (each node once; the wrappers are kept alive in the result)."""
    wanted = {id(t): i for i, t in enumerate(inputs) if t.requires_grad}
    found: List[Tuple[object, list]] = []
    seen: Dict[int, object] = {}
    stack = [o.grad_fn for o in reversed(outputs) if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        hits = []
        for k, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            variable = getattr(nxt, "variable", None)  # a torch autograd node: only AccumulateGrad nodes have one
            if variable is not None:
                if id(variable) in wanted:
                    hits.append((k, wanted[id(variable)]))
            elif id(nxt) not in seen:
                stack.append(nxt)
        if hits:
            found.append((node, hits))
    return found


class InputPieces:
    """Collects, during one ``torch.autograd.grad`` over a call's body (a context manager), the gradient piece
    each autograd node sends into a static input.

    Args:
        outputs, inputs: the body's differentiable outputs and its static inputs.
        layout: per input, the piece keys in the order a first collection saw them (``None``: this is the first;
            :attr:`layout` then holds its order, kept for every later run of the same body).
    """

    def __init__(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                 layout: Optional[List[List[Key]]] = None) -> None:
        self._nodes = consumers(outputs, inputs)
        self._inputs = len(inputs)
        self.layout = layout
        self.pieces: Dict[Key, torch.Tensor] = {}
        self._order: List[Tuple[Key, int]] = []
        self._handles: list = []

    def __enter__(self) -> "InputPieces":
        for n, (node, hits) in enumerate(self._nodes):
            self._handles.append(node.register_hook(self._hook(n, hits)))
        return self

    def _hook(self, n: int, hits: list):
        def keep(grad_inputs, grad_outputs):
            for k, i in hits:
                if grad_inputs[k] is not None:
                    self.pieces[(n, k)] = grad_inputs[k]
                    self._order.append(((n, k), i))
        return keep

    def __exit__(self, *exc) -> bool:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.layout is None:
            self.layout = [[] for _ in range(self._inputs)]
            for key, i in self._order:
                self.layout[i].append(key)
        return False

    def split(self, summed: Sequence[Optional[torch.Tensor]]) -> Tuple[list, list]:
        """Per input, its first piece (``summed[i]``, autograd's total, where it has at most one), then every
        further piece in order: the backward graph's input-gradient outputs. ``summed`` is indexed by input."""
        firsts = [self.pieces.get(keys[0]) if len(keys) > 1 else summed[i] for i, keys in enumerate(self.layout)]
        extras = [self.pieces.get(key) for keys in self.layout if len(keys) > 1 for key in keys[1:]]
        return firsts, extras


def piece_inputs(layout: Optional[List[List[Key]]]) -> List[int]:
    """The input index of every extra slot (the replay node takes that input once more per slot)."""
    if layout is None:
        return []
    return [i for i, keys in enumerate(layout) if len(keys) > 1 for _ in keys[1:]]
