"""``graphs.whole_step`` under the Lightning strategy: each training step replayed from one graph.

The step function captured (:mod:`cg_lightning.graphs.whole_step`) is Lightning's own: the strategy's
``training_step`` (the precision plugin's autocast, the engine's forward, the module's ``training_step``), then
``main_grad`` zeroed, the precision plugin's ``backward`` and the engine's gradient sync. Lightning's closure runs
around it as always; where it would call the backward, the strategy only runs the ``on_before_backward`` and
``on_after_backward`` hooks and exposes the gradients again. Clipping, ``on_before_optimizer_step``, the optimizer
step (the cached fused Adam step, or the optimizer's own), schedulers, checkpoints and validation stay eager.

``self.log`` inside ``training_step`` is recorded at capture (a tensor logged is one of the graph's static
outputs) and issued again after every replay, so the progress bar and the loggers see every step's values.

What a replayed step cannot hold is refused before capture, with the reason in one warning, and the layers get
per-layer graphs instead: manual optimization, gradient accumulation, a GradScaler (``16-mixed``), the
distributed optimizer, a ``backward``, ``optimizer_zero_grad`` or ``on_before_zero_grad`` of the user's (they
would run once), a Python number or a torchmetrics ``Metric`` logged in ``training_step`` (it would be logged
unchanged every step), and a step whose capture fails (a host read such as ``.item()``, named with its line).
A batch of another signature runs its step eagerly (``shape_policy="eager"``, one warning), raises
(``"error"``) or is captured as a step graph of its own (``"recapture"``, up to ``max_graph_sets``).
"""

from __future__ import annotations

import copy
import os
import traceback
import warnings
from collections.abc import Mapping
from typing import Any, Callable, List, Optional, Tuple

import torch

from . import torch_compat
from .graphs import GraphSignatureError
from .graphs.host_sync import refuse_host_sync
from .graphs.whole_step import StepGraph, StepGraphs

_USER_HOOKS = ("backward", "optimizer_zero_grad", "on_before_zero_grad")  # would run at capture only


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


class StepCaptureRefused(RuntimeError):
    """The training step cannot be replayed from one graph; the message says why."""


def _overridden(obj: Any, name: str, base_names: Tuple[str, ...]) -> bool:
    """``obj``'s class defines ``name`` below every class named in ``base_names`` (Lightning's own)."""
    for klass in type(obj).__mro__:
        if name in klass.__dict__:
            return klass.__name__ not in base_names
    return False


def _raised_at(exc: BaseException) -> Optional[str]:
    """The innermost frame of ``exc``'s traceback outside torch and this package: the code that made the call that
    failed (``file:line in function: source``), or ``None``."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if not os.path.abspath(frame.filename).startswith(skip):
            found = frame
    if found is None:
        return None
    return f"{found.filename}:{found.lineno} in {found.name}: {(found.line or '').strip()}"


class _LogRecorder:
    """Stands in for ``LightningModule.log`` while the step function runs: keeps each call for later."""

    def __init__(self, calls: List[Tuple[tuple, dict]]) -> None:
        self.calls = calls

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, bool) or isinstance(value, (int, float)):
            raise StepCaptureRefused(
                f"training_step logs {name!r} as a Python number ({value!r}), which a replayed step would log "
                "unchanged every step; log a tensor, or log the number from on_train_batch_end")
        if not isinstance(value, torch.Tensor):
            raise StepCaptureRefused(
                f"training_step logs {name!r} as a {type(value).__name__} (a torchmetrics Metric updates state the "
                "graph would keep writing after the metric is reset); log a tensor, or update the metric in "
                "on_train_batch_end")
        self.calls.append(((name, value.detach()) + args, kwargs))


class LightningWholeStep:
    """The whole-step graphs of one fit under the Lightning strategy.

    Args:
        strategy: the :class:`~cg_lightning.strategy.CUDAGraphDDPMixin` (its driver, precision plugin, module).
        run_training_step: Lightning's ``DDPStrategy.training_step`` bound to the strategy.
        announce: prints one line on rank 0.

    Attributes:
        graphs: the :class:`~cg_lightning.graphs.whole_step.StepGraphs`, ``None`` once refused.
        refusal: why the step is not captured (``None`` while it is or will be).
    """

    def __init__(self, strategy: Any, run_training_step: Callable[..., Any], announce: Callable[[str], None]) -> None:
        self.strategy = strategy
        self.run_training_step = run_training_step
        self.announce = announce
        driver = strategy.driver
        options = strategy.graph_options
        self.options = options
        self.graphs: Optional[StepGraphs] = StepGraphs(driver.step_backend, options.max_graph_sets)
        self.stats = self.graphs.stats
        self.refusal: Optional[str] = None
        self._start_step: Optional[int] = None
        self._checked = False
        self._backward_done = False
        self._mismatch_warned = False
        driver.layers_paused = True

    # ----------------------------------------------------------------- refusals
    def _static_refusal(self) -> Optional[str]:
        strategy = self.strategy
        module = strategy.lightning_module
        trainer = module.trainer
        if not module.automatic_optimization:
            return "manual optimization: training_step calls the optimizers itself"
        if getattr(strategy.precision_plugin, "scaler", None) is not None:
            return "the GradScaler of 16-mixed checks the gradients for inf/NaN on the host every step"
        if getattr(strategy.engine, "shards", None) is not None:
            return "ddp.distributed_optimizer is not supported with a graph of the whole step yet"
        lightning_bases = ("LightningModule", "HooksMixin", "ModelHooks", "DataHooks", "CheckpointHooks",
                           "Callback")
        for name in _USER_HOOKS:
            if _overridden(module, name, lightning_bases):
                return f"{type(module).__name__}.{name} is overridden and would run only when the step is captured"
        for callback in trainer.callbacks:
            if _overridden(callback, "on_before_zero_grad", lightning_bases):
                return (f"the callback {type(callback).__name__} implements on_before_zero_grad, which would run "
                        "after the replayed backward instead of before it")
        return None

    def give_up(self, reason: str) -> None:
        """No whole-step graphs from now on: one warning, and the layers get per-layer graphs."""
        self.refusal = reason
        if self.graphs is not None:
            self.graphs.clear()
        self.graphs = None
        driver = self.strategy.driver
        driver.layers_paused = False
        then = ("The layers get per-layer graphs instead" if driver.graph_manager is not None
                else "It runs eagerly (no layers to graph)")
        what = "no longer replayed from" if self.stats.replays else "not captured as"
        warnings.warn(f"cg_lightning: graphs.whole_step: the training step is {what} one graph: {reason}. {then}.",
                      stacklevel=3)

    # ----------------------------------------------------------------- the step
    def training_step(self, args: tuple, kwargs: dict) -> Tuple[bool, Any]:
        """Lightning's training step, replayed or captured where due: ``(True, output)``; ``(False, None)``: the
        caller runs the step its usual way (warmup, a refused or eager step)."""
        self._backward_done = False
        if self.graphs is None:
            return False, None
        trainer = self.strategy.lightning_module.trainer
        if not self._checked:
            self._checked = True
            reason = self._static_refusal()
            if reason is not None:
                self.give_up(reason)
                return False, None
        if trainer.accumulate_grad_batches != 1:  # each step: a GradientAccumulationScheduler sets it per epoch
            self.give_up(f"gradient accumulation (accumulate_grad_batches={trainer.accumulate_grad_batches})")
            return False, None
        step = trainer.global_step
        if self._start_step is None:
            self._start_step = step
        if step < self._start_step + max(1, self.options.warmup_steps) or not args:
            return False, None
        batch, rest = args[0], args[1:]
        graphs = self.graphs
        graph = graphs.find(batch)
        if graph is None:
            if graphs.graphs and (self.options.shape_policy != "recapture" or graphs.full):
                return self._other_signature(batch)
            graph = self._capture(batch, rest, kwargs)
            if graph is None:
                return False, None
        else:
            graphs.replay(graph, batch)
        self._issue_logs(graph)
        self._backward_done = True
        return True, self._output(graph)

    def _capture(self, batch: Any, rest: tuple, kwargs: dict) -> Optional[StepGraph]:
        calls: List[Tuple[tuple, dict]] = []
        strategy = self.strategy
        module = strategy.lightning_module
        # a host read fails a CUDA capture; named here with its line. Only while the stream captures: code may skip
        # its reads then (transformers' mask checks do), not in the warmup run before; not on the eager backend,
        # where a replay runs the step again and reads the value anew.
        check_host_reads = not self.options.compile and self.graphs.backend.name == "cuda"

        def body(static_batch: Any) -> Any:
            calls.clear()
            module.log = _LogRecorder(calls)
            try:
                with refuse_host_sync(enabled=check_host_reads and torch.cuda.is_current_stream_capturing()):
                    out = self.run_training_step(static_batch, *rest, **kwargs)
            finally:
                del module.log
            loss = out.get("loss") if isinstance(out, Mapping) else out
            if not isinstance(loss, torch.Tensor):
                raise StepCaptureRefused(f"training_step returned {type(out).__name__} without a loss tensor")
            engine = strategy.engine
            engine.zero_grad_buffer()
            strategy.driver.before_backward(loss)
            strategy.precision_plugin.backward(loss, module, None)
            if engine.sync_enabled:
                engine.finish_grad_sync()
            return out

        try:
            graph = self.graphs.capture(body, batch, module, extras=calls)
        except Exception as exc:  # noqa: BLE001 - any failure: per-layer graphs, and this step runs eagerly
            strategy.engine.zero_grad_buffer()
            where = _raised_at(exc)
            self.give_up(f"capturing it failed: {type(exc).__name__}: {str(exc).rstrip('.')}"
                         + (f" (raised under {where})" if where else ""))
            return None
        stats = self.graphs.stats
        self.announce(f"cg_lightning: captured the whole training step (forward, loss, backward, gradient sync) as "
                      f"one graph with the {self.graphs.backend.name} backend in {stats.capture_seconds:.2f} s"
                      + (f" ({stats.captures} batch signatures)" if stats.captures > 1 else "")
                      + "; the optimizer step runs eagerly")
        return graph

    def _other_signature(self, batch: Any) -> Tuple[bool, Any]:
        lines = self.graphs.mismatches(batch)
        if self.options.shape_policy == "error":
            raise GraphSignatureError("cg_lightning: graphs.whole_step: the batch differs from the one the step "
                                      "graph was captured for: " + "; ".join(lines)
                                      + " (shape_policy='error'; pad batches to one shape, or set shape_policy to "
                                      "'eager' or 'recapture')")
        self.graphs.stats.eager_steps += 1
        if not self._mismatch_warned:
            self._mismatch_warned = True
            warnings.warn("cg_lightning: graphs.whole_step: a batch unlike the captured ones runs its step eagerly "
                          "(warned once): " + "; ".join(lines), stacklevel=4)
        return False, None

    def _issue_logs(self, graph: StepGraph) -> None:
        log = self.strategy.lightning_module.log
        for args, kwargs in graph.extras:
            log(*args, **kwargs)

    @staticmethod
    def _output(graph: StepGraph) -> Any:
        """The step's output; every tensor other than the loss (also in nested lists and dicts) is copied, since the
        next replay overwrites them and a callback may keep a step's outputs (Lightning copies the loss itself)."""
        out = graph.output()
        if isinstance(out, Mapping):
            out = copy.copy(out)
            for key in out:
                if key != "loss":
                    out[key] = torch_compat.tree_map(_copied, out[key])
        return out

    def take_backward(self) -> bool:
        """Whether the step just replayed (or captured) already ran the backward Lightning is about to ask for."""
        done, self._backward_done = self._backward_done, False
        return done

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()
        self.graphs = None
