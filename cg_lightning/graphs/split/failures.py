"""What becomes of a layer that cannot be captured: ``graphs.on_capture_error``.

A layer fails when its capture raises :class:`~..capture.guards.GraphCaptureError` (a host sync, a CPU tensor, an output
leaf that is neither a tensor nor a constant: :mod:`.outputs`) or when an early refusal names it (hooks inside it, an enclosing non-reentrant
checkpoint). ``"raise"`` lets the error stop training. ``"eager"`` runs the layer eagerly from then on, with
one warning (:meth:`CaptureFailures.mark_failed`). ``"split"`` replaces the layer by its parts
(:mod:`.splitting`); a part that cannot be split in turn runs eagerly, named in the split's warning, which
:meth:`CaptureFailures.report` gives once a capture has tried every part.
"""

from __future__ import annotations

import warnings
from typing import Set

from .. import observer_hooks
from ..capture import guards
from ..graph_sets import GraphSetCache, GraphStats
from ..options import GraphOptions
from ..selection import GraphedLayer
from .splitting import LayerSelection


class CaptureFailures:
    """The ``on_capture_error`` policy of one graph manager, over its ``selection``, graph-set ``cache`` and
    ``stats``. :attr:`reselected` is set when a layer was split (the manager then records the step again:
    its records hold no calls of the new parts) until :meth:`take_split` or the manager clears it."""

    def __init__(self, options: GraphOptions, selection: LayerSelection, cache: GraphSetCache,
                 stats: GraphStats) -> None:
        self.options = options
        self.selection = selection
        self.cache = cache
        self.stats = stats
        self.reselected = False
        self.capture_after = -1  #: steps up to this one record again (a split changed the selection)
        #: transformers' output hooks inside the layers, noted by :meth:`refuse_early`
        self.observers = observer_hooks.ObserverWatch()

    def take_split(self, last_recording_step: int) -> bool:
        """Whether a layer was split since the last call: then every graph set is dropped (none holds calls of
        the new parts) and steps up to ``last_recording_step`` record before one captures."""
        if not self.reselected:
            return False
        self.reselected = False
        self.cache.clear()
        self.capture_after = max(self.capture_after, last_recording_step)
        return True

    def split_at_active_observers(self) -> None:
        """Fail every layer with an active observer hook inside (transformers collecting outputs from inside it),
        so that under ``"split"`` the hooked submodules become graphed parts whose own hooks run around their
        replays; :attr:`observers` then holds the hooks inside the layers still graphed."""
        for layer in list(self.selection.layers):
            if layer.failure is None and observer_hooks.any_active(observer_hooks.observers_inside(layer.module)):
                self.failed(layer, guards.GraphCaptureError(guards.observer_inside(layer.name)))
        self.observers.renote(layer.module for layer in self.selection.layers if layer.failure is None)

    def refuse_early(self, layer: GraphedLayer, at_call: bool) -> None:
        """What capture would refuse and can be seen before it, refused now: hooks in the layer (at setup, at the
        start of a step after hooks were added, at every recorded call), an enclosing non-reentrant checkpoint
        (at every recorded call: ``at_call``). Notes the observer hooks inside the layer (:attr:`observers`).

        Raises:
            GraphCaptureError: under ``on_capture_error="raise"``, naming the layer and the hooks.
        """
        if layer.failure is not None:
            return
        self.observers.note(layer.module)
        try:
            guards.refuse_capture_only_hooks(layer.name, layer.module)
        except guards.GraphCaptureError as exc:
            if self.options.capture_error_policy == "raise":
                raise
            self.failed(layer, exc)
            return
        try:
            if at_call:
                guards.refuse_saved_tensor_hooks(layer.name)
        except guards.GraphCaptureError as exc:
            if self.options.capture_error_policy == "raise":
                raise
            self.failed(layer, exc, splittable=False)  # its parts would run under the same checkpoint

    def failed(self, layer: GraphedLayer, exc: BaseException, splittable: bool = True) -> bool:
        """``layer`` could not be captured (``on_capture_error`` ``"eager"`` or ``"split"``). Under ``"split"``
        it is split into its parts (unless ``splittable`` is false: the cause would hold for them too), which are
        checked for early refusals at once; returns ``True`` then. Else it runs eagerly from now on."""
        self.selection.note(layer, exc)
        why = ""
        if self.options.capture_error_policy == "split":
            why = self.selection.why_not_split(layer) if splittable else "its parts would meet the same cause"
            if not why:
                self.cache.forget_layer(layer)
                self.stats.split_layers.append(layer.name)
                self.reselected = True
                for part in self.selection.split(layer):
                    self.refuse_early(part, at_call=False)
                return True
        self.mark_failed(layer, exc, warn=not self.selection.will_report(layer), why=f": {why}" if why else "")
        return False

    def mark_failed(self, layer: GraphedLayer, exc: BaseException, warn: bool = True, why: str = "") -> None:
        """``layer`` runs eagerly from now on, with one warning naming the cause unless ``warn`` is false (a part
        of a split layer whose warning is still to come names it). ``why``: why ``"split"`` left it whole."""
        layer.failure = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        self.cache.forget_layer(layer)
        self.stats.failed_layers.append(layer.name)
        self.stats.captured_runners = len(self.cache.all_runners())
        if warn:
            warnings.warn(
                f"cg_lightning: layer {layer.name!r} could not be captured and runs eagerly from now on "
                f"(graphs.on_capture_error={self.options.capture_error_policy!r}{why}); the other layers stay "
                f"graphed. Cause: {layer.failure}",
                stacklevel=6,
            )

    def report(self, pending_only: bool = False) -> None:
        """After a capture that split nothing more: one warning per split layer not yet reported
        (:meth:`~.splitting.LayerSelection.report`), and ``stats.graphed_parts``; nothing when ``pending_only``
        and no split is waiting for its warning."""
        if pending_only and not self.selection.unreported:
            return
        graphed: Set[int] = {key[0] for graph_set in self.cache.sets for key in graph_set.runners}
        for message in self.selection.report(graphed):
            warnings.warn(message, stacklevel=5)
        self.stats.graphed_parts = [p.name for p in self.selection.layers
                                    if p.parent is not None and id(p) in graphed]
