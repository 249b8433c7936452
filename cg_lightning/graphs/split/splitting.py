"""The graph manager's selected layers, and splitting one that cannot be captured whole into its parts.

:class:`LayerSelection` installs the manager's dispatch as each selected layer's ``forward`` (moving a
checkpoint around ``__call__`` inside it, :mod:`..recompute.outer_checkpoint`) and gives the layers back at the end.

Under ``graphs.on_capture_error="split"``, a layer whose capture fails (or that an early refusal names) is split:
it is replaced in the selection by its direct children that hold trainable parameters
(:func:`~.selection.trainable_children`; the entries of an ``nn.ModuleList``/``nn.ModuleDict`` child count as
children, a container has no ``forward`` of its own). Its own forward, the code between the parts (residual
adds, reshapes, routing), runs eagerly from then on and calls the parts, each dispatched like a selected layer.
Nothing is excluded beforehand: every part is tried; one that fails again is split the same way, down to
:data:`MAX_SPLIT_DEPTH` splits below the selected layer, and one that cannot be split runs eagerly. A
mixture-of-experts decoder layer (transformers' Mixtral, Qwen2-MoE, Qwen3-MoE) is the case in point: its expert
dispatch reads data-dependent sizes on the host (``one_hot``, ``nonzero``, ``where``), so its attention, norms,
router and shared expert end up graphed and only the experts run eagerly.

The recorded steps hold no calls of new parts, so the manager drops its graph sets and records a step again
before it captures (:mod:`.manager`). Once a capture has tried every part, :meth:`LayerSelection.report` gives
one warning per split layer (layers whose parts fared alike share one): the cause, the parts graphed and the
parts that run eagerly, each with its cause.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch.nn as nn

from ..recompute import outer_checkpoint
from ...torch_compat import is_compiled
from ..capture.guards import failure_cause
from ..selection import GraphedLayer, trainable_children

#: how many times a selected layer's parts may be split in turn (a decoder layer, its MoE block, an expert list)
MAX_SPLIT_DEPTH = 3


class LayerSelection:
    """The layers one graph manager dispatches: the selected ones and, after splits, their parts.

    Args:
        selected: ``(qualified name, module)`` pairs (:func:`~.selection.select_layers`).
        make_dispatch: ``make_dispatch(layer)`` is the function installed as ``layer.module.forward``.
        wrap_forward: applied to each layer's own forward when it is installed (``graphs.compile``:
            :func:`~.compiled.compiled_forward`); ``None`` keeps it as it is.
    """

    def __init__(self, selected: Sequence[Tuple[str, nn.Module]],
                 make_dispatch: Callable[[GraphedLayer], Callable],
                 wrap_forward: Optional[Callable[[Callable], Callable]] = None) -> None:
        self._make_dispatch = make_dispatch
        self._wrap_forward = wrap_forward
        self.layers: List[GraphedLayer] = []
        self.held: List[nn.Module] = []  # layers whose checkpoint around __call__ moved inside (.outer_checkpoint)
        self._causes: Dict[int, str] = {}  # id(layer) -> why it was split or runs eagerly
        self._unreported: List[GraphedLayer] = []  # split layers not yet named in a warning
        self._suspended: List[Optional[Callable]] = []  # the dispatches while suspended (:meth:`suspend`)
        for name, module in selected:
            self.layers.append(self._install(name, module, None))

    def _install(self, name: str, module: nn.Module, parent: Optional[GraphedLayer]) -> GraphedLayer:
        own = module.__dict__.get("forward")
        forward = module.forward
        if self._wrap_forward is not None:
            forward = self._wrap_forward(forward)
        compiled = is_compiled(forward)
        if outer_checkpoint.checkpoints_around_call(module):  # transformers' checkpointing layers
            forward = outer_checkpoint.checkpointed_forward(module, forward)
            self.held.append(module)
        layer = GraphedLayer(name, module, forward, parent=parent, depth=0 if parent is None else parent.depth + 1,
                             own_forward=own, compiled=compiled)
        module.forward = self._make_dispatch(layer)
        return layer

    def remove(self) -> None:
        """Give every layer (parts included) its own ``forward`` back (the user's instance attribute where it had
        one), and checkpointing layers their function."""
        for layer in self.layers:
            if layer.own_forward is not None:
                layer.module.forward = layer.own_forward
            elif layer.module.__dict__.get("forward") is not None:
                del layer.module.forward
        for module in self.held:
            outer_checkpoint.release(module)

    def suspend(self) -> None:
        """Every layer's own ``forward`` back for a while, the dispatch kept for :meth:`resume`: a model the user
        compiled whole, run by a graph of the whole step, where dynamo would break its graph at each dispatch."""
        self._suspended = [layer.module.__dict__.get("forward") for layer in self.layers]
        for layer in self.layers:
            if layer.own_forward is not None:
                layer.module.forward = layer.own_forward
            elif layer.module.__dict__.get("forward") is not None:
                del layer.module.forward

    def resume(self) -> None:
        """The dispatch installed again after :meth:`suspend`."""
        for layer, dispatch in zip(self.layers, self._suspended):
            if dispatch is not None:
                layer.module.forward = dispatch
        self._suspended = []

    # ----------------------------------------------------------------- splitting
    def note(self, layer: GraphedLayer, exc: BaseException) -> None:
        """Remember why ``layer`` could not be captured (the operation and source line of a host sync)."""
        self._causes[id(layer)] = failure_cause(exc)

    def why_not_split(self, layer: GraphedLayer) -> str:
        """Why :meth:`split` would leave ``layer`` whole (``""``: it would not)."""
        if layer.depth >= MAX_SPLIT_DEPTH:
            return f"it is {layer.depth} splits below a selected layer already"
        if not self._parts(layer):
            return "none of its submodules hold trainable parameters to graph apart"
        return ""

    def split(self, layer: GraphedLayer) -> List[GraphedLayer]:
        """Replace ``layer`` by its parts (installed right after it); its own forward runs eagerly from now on.
        Returns the parts (empty, and nothing changed, when :meth:`why_not_split` names a reason)."""
        if self.why_not_split(layer):
            return []
        layer.failure = "split into its parts"
        layer.parts = [self._install(f"{layer.name}.{key}", module, layer) for key, module in self._parts(layer)]
        at = self.layers.index(layer) + 1
        self.layers[at:at] = layer.parts
        self._unreported.append(layer)
        return layer.parts

    def _parts(self, layer: GraphedLayer) -> List[Tuple[str, nn.Module]]:
        """Its children with trainable parameters, through containers, except modules that another layer still
        to be graphed holds (a shared module would be called from inside that layer's graph)."""
        others = {id(m) for other in self.layers if other is not layer and other.failure is None
                  for m in other.module.modules()}
        parts: List[Tuple[str, nn.Module]] = []
        for key, child in trainable_children(layer.module):
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                parts += [(f"{key}.{k}", c) for k, c in trainable_children(child)]
            else:
                parts.append((key, child))
        return [(key, m) for key, m in parts if not any(id(sub) in others for sub in m.modules())]

    # ----------------------------------------------------------------- reporting
    @property
    def unreported(self) -> bool:
        """Some split is not yet named in a warning (:meth:`report`)."""
        return bool(self._unreported)

    def will_report(self, layer: GraphedLayer) -> bool:
        """A warning still to come names ``layer``: it is a part of a split not yet reported."""
        return any(any(a is s for s in self._unreported) for a in _ancestors(layer))

    def report(self, graphed: Set[int]) -> List[str]:
        """The warnings for the splits not yet reported, once their parts were tried: one per split layer that
        is not itself a part of another such layer, one for several whose parts fared alike.
        ``graphed``: ``id(layer)`` of the layers with a captured call."""
        if not self._unreported:
            return []
        pending = set(map(id, self._unreported))
        tops = [s for s in self._unreported if not any(id(a) in pending for a in _ancestors(s))]
        self._unreported = []
        groups: Dict[tuple, List[GraphedLayer]] = {}
        for top in tops:
            groups.setdefault(self._outcome(top, graphed), []).append(top)
        return [self._message(tops, graphed) for tops in groups.values()]

    def _outcome(self, top: GraphedLayer, graphed: Set[int]) -> tuple:
        leaves = list(_leaves(top))
        return (type(top.module),
                tuple(_relative(leaf, top) for leaf in leaves if id(leaf) in graphed),
                tuple(_relative(leaf, top) for leaf in leaves if leaf.failure is not None),
                tuple(_relative(leaf, top) for leaf in leaves if leaf.failure is None and id(leaf) not in graphed))

    def _message(self, tops: List[GraphedLayer], graphed: Set[int]) -> str:
        top = tops[0]
        _, on, _, idle = self._outcome(top, graphed)
        off = [f"{_relative(leaf, top)} ({self._causes.get(id(leaf), leaf.failure)})"
               for leaf in _leaves(top) if leaf.failure is not None]
        names = ", ".join(repr(t.name) for t in tops)
        several = len(tops) > 1
        text = (f"cg_lightning: layer{'s' if several else ''} {names} could not be captured whole "
                f"(graphs.on_capture_error='split'). Cause{f' in {top.name!r}' if several else ''}: "
                f"{self._causes.get(id(top), top.failure)}. {'Their' if several else 'Its'} own forward now runs "
                f"eagerly (the code between the parts) and calls the parts, graphed separately. Graphed: "
                f"{', '.join(on) or 'none'}. Eager: {'; '.join(off) or 'none'}.")
        if idle:
            text += (f" Not graphed, as no call in the recorded step had autograd on (under no_grad or a reentrant "
                     f"checkpoint, or not called): {', '.join(idle)}.")
        return text


def _ancestors(layer: GraphedLayer) -> Iterator[GraphedLayer]:
    while layer.parent is not None:
        layer = layer.parent
        yield layer


def _leaves(layer: GraphedLayer) -> Iterator[GraphedLayer]:
    """The parts of ``layer`` that were not split further, in module order."""
    for part in layer.parts or ():
        if part.parts is None:
            yield part
        else:
            yield from _leaves(part)


def _relative(leaf: GraphedLayer, top: GraphedLayer) -> str:
    return leaf.name[len(top.name) + 1:]
