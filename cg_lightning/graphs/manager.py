"""The per-layer graph manager: records eager calls, captures every graphed call of a step, replays.

Schedule (driven by :meth:`GraphManager.begin_step`, called at the start of every training micro-batch):

* While ``global_step < warmup_steps`` layers run eagerly and each training call is recorded (layer,
  call index within the step, signature, arguments); each step's record replaces the previous one.
* At the first graphed call of the first step with ``global_step >= warmup_steps``, every recorded call
  gets a :class:`LayerGraphRunner`: all are warmed up, their forwards captured in call order, then
  their backwards in reverse order, into one memory pool, so replays in the same order are safe.
  ``main_grad``, module buffers and RNG states are restored afterwards: capture changes no training state.
* From then on the i-th call of a layer in a step replays runner (layer, i). A call whose arguments
  differ from the captured ones follows ``shape_policy``; layers in eval mode and calls under
  ``no_grad`` run eagerly.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .backends import make_backend
from .capture import capture_in_order
from .options import GraphOptions
from .replay import ReplayFunction
from .runner import LayerGraphRunner
from .selection import select_layers
from .signature import CallSignature, GraphSignatureError


@dataclass
class GraphStats:
    """Counters for monitoring: graphs captured, replays, eager fallbacks, capture time (seconds)."""

    backend: str = ""
    captured_runners: int = 0
    forward_replays: int = 0
    eager_calls: int = 0
    fallback_calls: int = 0
    capture_seconds: float = 0.0


@dataclass
class _Layer:
    name: str
    module: nn.Module
    forward: object  # the original bound forward
    warned: bool = False


@dataclass
class _Record:
    layer: _Layer
    index: int
    signature: CallSignature
    args: tuple
    kwargs: dict


class GraphManager:
    """Graphs the selected layers of ``model`` and replays them during training.

    Args:
        model: the module whose layers are graphed (their ``forward`` is replaced until :meth:`remove`).
        options: :class:`GraphOptions`.
        device: the training device (picks the backend for ``backend="auto"``).
        accumulate_into_main_grad: captured backwards add weight gradients into ``param.main_grad``
            (the DDP engine's buffer) instead of returning them.

    Raises:
        ValueError: if ``options.layers`` matches no module.
    """

    def __init__(
        self,
        model: nn.Module,
        options: GraphOptions,
        device: torch.device,
        *,
        accumulate_into_main_grad: bool = True,
    ) -> None:
        self.model = model
        self.options = options
        self.device = device
        self.accumulate_into_main_grad = accumulate_into_main_grad
        self.backend = make_backend(options.backend, device) if options.enabled else None
        self.pool = None
        self.stats = GraphStats(backend=self.backend.name if self.backend is not None else "")
        self.layers: List[_Layer] = []
        for name, module in select_layers(model, options.layers):
            layer = _Layer(name, module, module.forward)
            module.forward = self._make_dispatch(layer)
            self.layers.append(layer)
        self.runners: Dict[Tuple[int, int], LayerGraphRunner] = {}
        self.captured = False
        self._global_step = 0
        self._calls: Dict[int, int] = {}
        self._records: List[_Record] = []
        self._in_training_step = False

    # ----------------------------------------------------------------- schedule
    def begin_step(self, global_step: int) -> None:
        """Start of a training micro-batch: reset call indices; keep only this step's records."""
        self._global_step = global_step
        self._calls = {}
        self._in_training_step = True
        if not self.captured and not self.capture_due:
            self._records = []  # keep only the last eager step's calls

    def end_step(self) -> None:
        self._in_training_step = False

    @property
    def capture_due(self) -> bool:
        return (
            self.backend is not None
            and not self.captured
            and self._global_step >= max(1, self.options.warmup_steps)
        )

    def remove(self) -> None:
        """Restore every layer's original ``forward`` and drop the graphs."""
        for layer in self.layers:
            if layer.module.__dict__.get("forward") is not None:
                del layer.module.forward
        self.runners.clear()
        self._records = []

    # ----------------------------------------------------------------- dispatch
    def _make_dispatch(self, layer: _Layer):
        def forward(*args, **kwargs):
            return self._dispatch(layer, args, kwargs)

        return forward

    def _dispatch(self, layer: _Layer, args: tuple, kwargs: dict):
        graphable = (
            self.backend is not None
            and self._in_training_step
            and layer.module.training
            and torch.is_grad_enabled()
        )
        if not graphable:
            self.stats.eager_calls += 1
            return layer.forward(*args, **kwargs)
        key = id(layer)
        index = self._calls.get(key, 0)
        self._calls[key] = index + 1
        if not self.captured:
            if self.capture_due and self._records:
                self.capture()
            else:
                self._records.append(
                    _Record(layer, index, CallSignature(args, kwargs), _detach_tree(args), _detach_tree(kwargs))
                )
                self.stats.eager_calls += 1
                return layer.forward(*args, **kwargs)
        runner = self.runners.get((key, index))
        if runner is None or not runner.signature.matches(args, kwargs):
            return self._fallback(layer, index, runner, args, kwargs)
        tensors = runner.signature.tensor_leaves(args, kwargs)
        flat = ReplayFunction.apply(runner, *tensors, *runner.edge_params)
        self.stats.forward_replays += 1
        return runner.output_structure(flat)

    def _fallback(self, layer: _Layer, index: int, runner: Optional[LayerGraphRunner], args, kwargs):
        if runner is None:
            why = [f"call #{index} of this layer in a step was never captured (captured calls: "
                   f"{sum(1 for k in self.runners if k[0] == id(layer))})"]
        else:
            why = runner.signature.mismatches(args, kwargs)
        if self.options.shape_policy == "error":
            raise GraphSignatureError(
                f"layer {layer.name!r} was called with arguments its graph was not captured for:\n  "
                + "\n  ".join(why)
                + "\nUse fixed shapes (e.g. drop_last=True), or graphs.shape_policy='eager' to run such calls eagerly."
            )
        if not layer.warned:
            layer.warned = True
            warnings.warn(
                f"cg_lightning: layer {layer.name!r} runs eagerly for a call its graph was not captured for ("
                + "; ".join(why) + "). Further such calls of this layer are not reported.",
                stacklevel=3,
            )
        self.stats.fallback_calls += 1
        return layer.forward(*args, **kwargs)

    # ----------------------------------------------------------------- capture
    def capture(self) -> None:
        """Warm up and capture every call recorded in the last eager step (see module docstring)."""
        import time

        start = time.perf_counter()
        if self.pool is None:
            self.pool = self.backend.new_pool()
        runners = [
            LayerGraphRunner(
                r.layer.name,
                r.layer.module,
                r.layer.forward,
                r.signature,
                r.args,
                r.kwargs,
                self.backend,
                self.pool,
                accumulate_into_main_grad=self.accumulate_into_main_grad,
                clone_param_grads_on_return=False,
                num_warmup_iters=self.options.num_warmup_iters,
            )
            for r in self._records
        ]
        capture_in_order(runners, self.model, [r.layer.module for r in self._records])
        for r, runner in zip(self._records, runners):
            self.runners[(id(r.layer), r.index)] = runner
        self._records = []
        self.captured = True
        self.stats.captured_runners = len(self.runners)
        self.stats.capture_seconds += time.perf_counter() - start


def _detach_tree(tree):
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)
