"""Forward-only graphs for graphed layers called in eval mode without autograd (validation, test, predict,
the sanity check): ``graphs.capture_eval``.

Kept apart from the training graphs: their own memory pool, their own static buffers, keyed per layer by
the call's signature (argument shapes, dtypes, non-tensor values), its autocast settings and whether it
runs under ``torch.inference_mode``. Switching between training and evaluation therefore never touches a
training graph and never recaptures one.

Per key: the first call runs eagerly (it is the warmup, on the capture stream for CUDA), the second is
captured and every later one copies its tensor arguments into the static inputs and replays. Outputs are
cloned out of the static buffers by default, so a tensor a ``validation_step`` keeps (predictions
collected over an epoch) is not overwritten by the next replay (eager lifetime semantics, as for returned
parameter gradients: pytorch/pytorch#181723).
Outputs are rebuilt in the structure the capture returned, with its constant leaves (``None``, flags:
:mod:`.outputs`). A layer whose capture fails (a host sync, a submodule hook, an output leaf that is neither a
tensor nor such a constant), that modifies an input in place (seen in its warmup call) or that gets a
submodule hook after capture (checked at every replay) runs eagerly in eval from then on, with one warning
naming it: evaluation graphs are an optimisation and never stop a run. Capture restores RNG states and the
layer's buffers, so the call's replay is its only run.
Each layer keeps at most ``max_graphs`` keys; calls with further keys run eagerly.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
from .. import torch_compat

from .autocast import autocast_as, autocast_state
from .buffer_reuse import copy_into_static
from .capture.capture_order import preserved_training_state
from ..torch_compat import is_compiled
from .capture.host_sync import hook_dicts, hooks_inside, refuse_host_sync
from .errors import OutputStructureError
from .outputs import OutputStructure, split_outputs
from .signature import CallSignature


@dataclass
class _EvalEntry:
    signature: CallSignature
    autocast: tuple
    inference: bool
    calls: int = 0
    graph: object = None  # backends.CapturedGraph once captured
    static_inputs: List[torch.Tensor] = field(default_factory=list)
    outputs: Optional[OutputStructure] = None  # the output's structure and constant leaves (None, flags)
    hook_dicts: List[dict] = field(default_factory=list)  # re-checked at every replay (host_sync.hook_dicts)

    def matches(self, args: tuple, kwargs: dict, autocast: tuple, inference: bool) -> bool:
        return self.inference == inference and self.autocast == autocast and self.signature.matches(args, kwargs)


@dataclass
class _EvalLayer:
    entries: List[_EvalEntry] = field(default_factory=list)
    failure: Optional[str] = None
    full_warned: bool = False


class EvalGraphs:
    """Forward-only graphs of eval-mode calls, per layer and call key.

    Args:
        backend: the graph backend of the training graphs (``CudaBackend`` or ``EagerBackend``).
        max_graphs: most keys (captured or warming up) per layer, >= 1.
        clone_outputs: return copies of the static outputs (default) instead of views of graph memory
            that the layer's next replay overwrites.

    Counters: ``replays``, ``captures``, ``eager_calls`` and ``pool_bytes`` (device memory the captures
    allocated, CUDA only).
    """

    def __init__(self, backend, max_graphs: int = 4, clone_outputs: bool = True) -> None:
        self.backend = backend
        self.max_graphs = max_graphs
        self.clone_outputs = clone_outputs
        self.pool = None
        self._layers: Dict[int, _EvalLayer] = {}
        self.replays = 0
        self.captures = 0
        self.eager_calls = 0
        self.pool_bytes = 0

    def call(self, layer, args: tuple, kwargs: dict, stats):
        """:meth:`__call__` for a :class:`~.selection.GraphedLayer`, its eager calls, pool bytes, graphs and
        replays added to ``stats`` (:class:`~.graph_sets.GraphStats`)."""
        before = (self.eager_calls, self.pool_bytes)
        out = self(layer.name, layer.module, layer.forward, args, kwargs)
        stats.eager_calls += self.eager_calls - before[0]
        stats.pool_bytes += self.pool_bytes - before[1]
        stats.eval_graphs = self.captures
        stats.eval_replays = self.replays
        return out

    def __call__(self, name: str, module: torch.nn.Module, forward: Callable, args: tuple, kwargs: dict):
        """Run ``forward(*args, **kwargs)`` (``module``'s original forward) through its eval graph.

        Returns the layer's outputs (tensors, or nested tuples/lists/dicts of tensors and constants such as
        ``None``), equal to an eager call's. Never raises for capture problems: the layer then runs eagerly
        (one ``UserWarning``).
        """
        state = self._layers.setdefault(id(module), _EvalLayer())
        if state.failure is not None:
            return self._eager(forward, args, kwargs)
        autocast = autocast_state()
        inference = torch.is_inference_mode_enabled()
        entry = next((e for e in state.entries if e.matches(args, kwargs, autocast, inference)), None)
        if entry is None:
            if len(state.entries) >= self.max_graphs:
                if not state.full_warned:
                    state.full_warned = True
                    warnings.warn(f"cg_lightning: layer {name!r} has {self.max_graphs} eval graphs "
                                  "(graphs.max_graph_sets); eval calls with other arguments run eagerly.",
                                  stacklevel=3)
                return self._eager(forward, args, kwargs)
            entry = _EvalEntry(CallSignature(args, kwargs), autocast, inference)
            state.entries.append(entry)
        entry.calls += 1
        if entry.graph is None:
            if entry.calls == 1:  # warmup: eager, on the capture stream
                tensors = entry.signature.tensor_leaves(args, kwargs)
                before = [_snapshot(t) for t in tensors]
                with self.backend.warmup_stream():
                    out = self._eager(forward, args, kwargs)
                if any(_changed(t, b) for t, b in zip(tensors, before)):
                    self._fail(state, name, "it modifies an input in place, which a replay would do only to its "
                                            "static copy, not to the caller's tensor")
                return out
            try:
                self._capture(name, module, forward, entry, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - any capture failure: this layer stays eager in eval
                text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                self._fail(state, name, text)
                return self._eager(forward, args, kwargs)
        if any(entry.hook_dicts):
            self._fail(state, name, f"{', '.join(hooks_inside(module))} added after its capture would not run "
                                    "in a replay")
            return self._eager(forward, args, kwargs)
        return self._replay(entry, args, kwargs)

    # ----------------------------------------------------------------- internals
    @staticmethod
    def _fail(state: _EvalLayer, name: str, why: str) -> None:
        state.failure = why
        state.entries.clear()
        warnings.warn(f"cg_lightning: eval graph of layer {name!r} could not be captured or replayed ({why}); "
                      "the layer runs eagerly in eval mode from now on.", stacklevel=4)

    def _eager(self, forward: Callable, args: tuple, kwargs: dict):
        self.eager_calls += 1
        return forward(*args, **kwargs)

    def _capture(self, name, module, forward, entry: _EvalEntry, args: tuple, kwargs: dict) -> None:
        compiled = is_compiled(forward)
        hooks = hooks_inside(module)
        if hooks:
            raise RuntimeError(f"{', '.join(hooks)} would run once at capture and never at replay")
        entry.static_inputs = [t.detach().clone() for t in entry.signature.tensor_leaves(args, kwargs)]
        static_args, static_kwargs = entry.signature.rebuild(entry.static_inputs)

        def body():
            with autocast_as(entry.autocast):
                out = forward(*static_args, **static_kwargs)
            try:
                tensors, entry.outputs = split_outputs(out)
            except OutputStructureError as exc:
                raise RuntimeError(f"the layer {exc}") from None
            return tensors

        if self.pool is None:
            self.pool = self.backend.new_pool()
        before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        # the capture must change nothing: RNG states and the layer's buffers as before (the eager backend
        # runs the body once at capture; the replay that follows is this call's only run)
        with preserved_training_state(module, [module], restore_grads=False), refuse_host_sync(not compiled):
            entry.graph = self.backend.capture(body, self.pool)
        entry.hook_dicts = hook_dicts(module)
        if torch.cuda.is_available():
            self.pool_bytes += max(0, torch.cuda.memory_allocated() - before)
        self.captures += 1

    def _replay(self, entry: _EvalEntry, args: tuple, kwargs: dict):
        copy_into_static(entry.static_inputs, entry.signature.tensor_leaves(args, kwargs))
        entry.graph.replay()
        self.replays += 1
        outs = entry.graph.outputs
        if self.clone_outputs:
            outs = [o.clone() for o in outs]
        return entry.outputs.rebuild(outs)

    def clear(self) -> None:
        """Drop every eval graph (the pool is freed once nothing refers to it)."""
        self._layers.clear()
        self.pool = None


def _snapshot(t: torch.Tensor):
    """What tells whether ``t`` is modified in place: its version counter, or for an inference tensor (no
    counter) a copy."""
    return t.clone() if t.is_inference() else torch_compat.version(t)


def _changed(t: torch.Tensor, before) -> bool:
    if isinstance(before, torch.Tensor):
        return not torch.allclose(t, before, rtol=0, atol=0, equal_nan=True)
    return torch_compat.version(t) != before
