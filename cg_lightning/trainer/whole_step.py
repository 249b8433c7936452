"""The whole training step replayed from one graph under the Lightning strategy (``graphs.whole_step``).

The step function captured is Lightning's own training step, backward and gradient sync (:mod:`.step_function`).
Lightning's closure runs around it as always; where it would call the backward, the strategy only runs the
``on_before_backward`` and ``on_after_backward`` hooks and exposes the gradients again. Clipping, the optimizer step,
schedulers, checkpoints and validation stay outside the step's graph, except the update of a fused Adam under
``graphs.capture_optimizer`` where no hook runs between the backward and it (:mod:`.step_update`). ``self.log`` calls
in ``training_step`` are recorded at capture and issued again after every replay.

By default (``graphs.whole_step`` unset) the step is captured only where that is provably safe: its Python reads
nothing that changes between steps except what is compared before each replay (:mod:`cg_lightning.graphs.step.
step_code`: no ``batch_idx``, no ``global_step``; watched numbers, submodules' modes and ``requires_grad``), and its
host reads are of constants only (:mod:`cg_lightning.graphs.step.capture_reads`). A refusal is one line on rank 0
and the layers get per-layer graphs (a model compiled whole runs its compiled code ungraphed, warned).
``graphs.whole_step: true`` skips the code check and warns on a refusal; ``false`` never captures the step.

What a replayed step cannot hold is refused before capture (:func:`.step_checks.static_refusal`; a Python number or
a torchmetrics ``Metric`` logged; a capture that fails, its line named), and the layers get per-layer graphs
instead. A batch of another signature runs its step eagerly (``shape_policy="eager"``, one warning), raises
(``"error"``) or is captured as a step graph of its own (``"recapture"``, up to ``max_graph_sets``).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Tuple

from .. import torch_compat
from ..graphs import GraphSignatureError
from ..graphs.step.capture_reads import ReadsDiverged
from ..graphs.errors import HostSyncError
from ..graphs.selection import no_default_layers_message
from ..graphs.step.step_code import StepCodeReport, check_step_code
from ..graphs.step.whole_step import StepGraph, StepGraphs, StepGuards
from .step_checks import FRAMEWORK, raised_at, static_refusal, step_output
from .step_function import LightningStepFunction
from .step_update import DROP, EAGER, RESET, StepUpdate, update_phrase


class LightningWholeStep:
    """The whole-step graphs of one fit under the Lightning strategy.

    Args:
        strategy: the :class:`~cg_lightning.trainer.strategy.CUDAGraphDDPMixin` (its driver, precision plugin, module).
        run_training_step: Lightning's ``DDPStrategy.training_step`` bound to the strategy.
        announce: prints one line on rank 0.

    Attributes:
        graphs: the :class:`~cg_lightning.graphs.step.whole_step.StepGraphs`, ``None`` once refused.
        stats: the run's :class:`~cg_lightning.graphs.step.whole_step.StepGraphStats`; ``stats.refusal``: why the step is not
            (or no longer) captured.
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
        #: graphs.whole_step unset: the step is captured only where its Python is proven safe to freeze
        #: (:mod:`cg_lightning.graphs.step.step_code`), and a refusal is a line on rank 0, not a warning
        self.auto = options.whole_step is None
        self.code: Optional[StepCodeReport] = None
        self._watched_values: tuple = ()
        self.guards: Optional[StepGuards] = None
        self._start_step: Optional[int] = None
        self._checked = False
        # a model the user compiled runs whole under the step graph: no layer dispatch for dynamo to break at
        self._suspended = (driver.graph_manager is not None and not options.compile
                           and torch_compat.contains_compiled(strategy.lightning_module))
        if self._suspended:
            driver.graph_manager.selection.suspend()
        self._backward_done = False
        self._mismatch_warned = False
        #: the optimizer's update in the step's graphs (graphs.capture_optimizer, where it can be: :mod:`.step_update`)
        self.update: Optional[StepUpdate] = None
        self._updated, self._announced = False, None  # this step's graph ran the update; the last announced did
        driver.layers_paused = True

    # ----------------------------------------------------------------- refusals
    def _static_refusal(self) -> Optional[str]:
        reason = static_refusal(self.strategy)
        if reason is None and self.auto:
            manager = self.strategy.driver.graph_manager
            if manager is not None and any(layer.compiled for layer in manager.layers):
                return ("the graphed layers' forwards are compiled one by one (graphs.compile, or layer.forward = "
                        "torch.compile(...)), which per-layer graphs capture; compile the whole model for a graph of "
                        "the whole step")
            self.code = check_step_code(self.strategy.lightning_module, "training_step", free_args=1,
                                        recorded=("log", "log_dict"), framework=FRAMEWORK)
            reason = self.code.refusal
        return reason

    def give_up(self, reason: str) -> None:
        """No whole-step graphs from now on, and the layers get per-layer graphs. One warning when the option was
        asked for; unset, one line on rank 0 (and the warning for a model without layers to graph, which then
        trains eagerly). A model whose compiled code runs the layers runs it ungraphed instead, with a warning."""
        self.stats.refusal = reason
        self.strategy.engine.adoption.stop()  # every main_grad in the buffer again, for per-layer graphs
        self.graphs, graphs, driver = None, self.graphs, self.strategy.driver
        if graphs is not None:
            graphs.clear()
        what = "no longer replayed from" if self.stats.replays else "not captured as"
        layers = [layer.module for layer in driver.graph_manager.layers] if self._suspended else []
        if layers and torch_compat.compiled_around(self.strategy.lightning_module, layers):  # dynamo would trace them
            warnings.warn(f"cg_lightning: the training step is {what} one graph: {reason}. The compiled model runs "
                          "its compiled code without CUDA graphs from now on (per-layer graphs would run inside traced "
                          "code); remove that cause, or set graphs.compile instead of compiling it.", stacklevel=3)
            return
        driver.layers_paused = False
        if self._suspended:  # layers compiled one by one: per-layer graphs capture their compiled forwards
            driver.graph_manager.selection.resume()
            self._suspended = False
        then = ("The layers get per-layer graphs instead" if driver.graph_manager is not None
                else "It runs eagerly (no layers to graph)")
        if not self.auto:
            warnings.warn(f"cg_lightning: graphs.whole_step: the training step is {what} one graph: {reason}. {then}.",
                          stacklevel=3)
            return
        self.announce(f"cg_lightning: the training step is {what} one graph: {reason}. {then} (graphs.whole_step: "
                      "false chooses them without this check).")
        if driver.graph_manager is None and self.options.layers is None:
            warnings.warn(no_default_layers_message(self.strategy.lightning_module), UserWarning, stacklevel=3)

    # ----------------------------------------------------------------- the step
    def training_step(self, args: tuple, kwargs: dict) -> Tuple[bool, Any]:
        """Lightning's training step, replayed or captured where due: ``(True, output)``; ``(False, None)``: the
        caller runs the step its usual way (warmup, a refused or eager step)."""
        self._backward_done = self._updated = False
        if self.graphs is None:
            return False, None
        trainer = self.strategy.lightning_module.trainer
        if not self._checked:
            self._checked = True
            reason = self._static_refusal()
            if reason is not None:
                self.give_up(reason)
                return False, None
            self.strategy.engine.adoption.want()  # no gradient buffer beside the activations before the capture
            if self.options.capture_optimizer:  # on every rank: the ranks agree on a refusal
                self.update, self.stats.update_refusal = StepUpdate.for_fit(
                    self.strategy, self.strategy.engine.expose_grads, self.graphs.backend.name,
                    self.strategy.ddp_options.timeout_s)
        if trainer.accumulate_grad_batches != 1:  # each step: a GradientAccumulationScheduler sets it per epoch
            self.give_up(f"gradient accumulation (accumulate_grad_batches={trainer.accumulate_grad_batches})")
            return False, None
        self.strategy.engine.adoption.step_begins()  # the last step's gradients freed before this forward
        step = trainer.global_step
        if self._start_step is None:
            self._start_step = step
        if step < self._start_step + max(1, self.options.warmup_steps) or not args:
            if self.update is not None:
                self.update.observe()
            return False, None
        batch, rest = args[0], args[1:]
        graphs = self.graphs
        if self.guards is not None:
            changed = self.guards.changed()  # says "since capture" itself
            if changed is None and self.code is not None:
                changed = self.code.changed(self._watched_values)
                changed = changed and f"{changed} after the step was captured"
            if changed is not None:
                self.give_up(changed)
                return False, None
        graph = graphs.find(batch)
        update, include, reset = self.update, False, False
        if update is not None:  # the optimizer's values decide whether the graphs hold its update
            action, include = update.plan(bool(graphs.graphs), graph is not None)
            if update.refusal is not None:  # for good: one line
                self.update, self.stats.update_refusal = None, update.refusal
                update.close()
                self.announce(f"cg_lightning: the optimizer's update leaves the step's graph: {update.refusal}")
            if action in (RESET, DROP):
                graphs.reset()
                graph, reset = None, True
            if action in (EAGER, DROP):
                self.stats.eager_steps += 1
                return False, None
        first = not graphs.graphs
        if graph is None:
            if graphs.graphs and (self.options.shape_policy != "recapture" or graphs.full):
                return self._other_signature(batch)
            graph = self._capture(batch, rest, kwargs, include, reset)
            if graph is None:
                return False, None
            if update is not None:  # False where the tail found a parameter without Adam state
                include = update.captured(include, first)
        else:
            graphs.replay(graph, batch)
        if include:
            self._updated = True
            self.stats.updates += 1
        self._issue_logs(graph)
        self._backward_done = True
        return True, step_output(graph)

    def _capture(self, batch: Any, rest: tuple, kwargs: dict, include: bool = False,
                 reset: bool = False) -> Optional[StepGraph]:
        """Capture this step (with the optimizer's update at its end if ``include``) and run it; ``None`` once the
        capture failed (the step is then run eagerly by the caller). ``reset``: the graphs were dropped for the
        update's sake (announced only when the update joins or leaves the graph)."""
        strategy = self.strategy
        module = strategy.lightning_module
        # host reads of constants are answered from the eager run and all others refused, naming the line; code that
        # asks whether a stream captures takes its eager path (transformers' mask checks). Not for compiled code,
        # which dispatch modes would keep from running (and which takes its traced path under "ddp" too).
        compiled = self.options.compile or torch_compat.contains_compiled(module)
        eager_path = not compiled
        body = LightningStepFunction(strategy, self.run_training_step, self.stats, self.code, rest, kwargs)
        calls = body.calls
        tail = self.update.tail() if include else None
        try:
            try:
                graph = self.graphs.capture(body, batch, module, extras=calls, eager_path=eager_path,
                                            compiled=compiled, tail=tail)
            except (HostSyncError, ReadsDiverged) as exc:
                if self.auto or not eager_path:
                    raise
                # asked for: captured on the path code takes under capture, as before this check existed
                warnings.warn(
                    f"cg_lightning: graphs.whole_step: the training step reads a value that depends on the batch "
                    f"({exc}); it is captured with the path code takes while a stream captures (transformers builds "
                    "an explicit attention mask), which may round differently from eager steps in bf16. Unset "
                    "graphs.whole_step to train such a step with per-layer graphs, exactly.", stacklevel=4)
                strategy.engine.adoption.undo()
                graph = self.graphs.capture(body, batch, module, extras=calls, compiled=compiled, tail=tail)
            strategy.engine.adoption.keep()  # the gradients stay where the graph writes them
        except Exception as exc:  # noqa: BLE001 - any failure: per-layer graphs, and this step runs eagerly
            strategy.engine.adoption.undo()
            strategy.engine.discard_iteration()  # the eager step that follows counts its gradients from zero
            strategy.engine.zero_grad_buffer()
            where = raised_at(exc)
            where = None if where is not None and where.split(": ", 1)[-1] in str(exc) else where  # named already
            self.give_up(f"capturing it failed: {type(exc).__name__}: {str(exc).rstrip('.')}"
                         + (f" (raised under {where})" if where else ""))
            return None
        changed = body.changed()
        if changed is not None:  # e.g. self.history.append(...) or a counter in a forward: a replay would not do it
            self.give_up(f"{changed}, which a replay would not do")
            return graph  # this step's result stands: it ran as captured
        if self.guards is None:
            self.guards = StepGuards(module)
            self._watched_values = self.code.values() if self.code is not None else ()
        if not reset or include != self._announced:
            self._announced = include
            self._announce_capture(include)
        return graph

    def _announce_capture(self, include: bool) -> None:
        stats = self.stats
        what = ("iteration (forward, loss, backward, gradient sync, optimizer update)" if include
                else "step (forward, loss, backward, gradient sync)")
        self.announce(f"cg_lightning: captured the whole training {what} as one graph with the "
                      f"{self.graphs.backend.name} backend in {stats.capture_seconds:.2f} s"
                      + (f" ({stats.captures} captures)" if stats.captures > 1 else "")
                      + update_phrase(include, self.update is not None, self.options.capture_optimizer,
                                      stats.update_refusal))

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

    def take_update(self) -> bool:
        """Whether the step just replayed (or captured) ran the optimizer's update, which Lightning's
        ``optimizer.step()`` is about to ask for."""
        done, self._updated = self._updated, False
        return done

    def take_backward(self) -> bool:
        """Whether the step just replayed (or captured) already ran the backward Lightning is about to ask for."""
        done, self._backward_done = self._backward_done, False
        return done

    def close(self) -> None:
        if self.update is not None:
            self.update.close()
        if self._suspended:
            self.strategy.driver.graph_manager.selection.resume()  # the manager's remove restores the forwards
            self._suspended = False
        if self.graphs is not None:
            self.graphs.clear()
        self.graphs = None
