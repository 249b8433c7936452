"""``GraphMonitor``: logs the graph engine's counters through Lightning's loggers.

The body, :class:`GraphMonitorMixin`, serves both Lightning packages: :class:`GraphMonitor` here is a
``lightning.pytorch`` callback, :class:`cg_lightning.trainer.pytorch_lightning.GraphMonitor` a ``pytorch_lightning`` one.
"""

from __future__ import annotations

import time
from typing import Optional

from lightning.pytorch import Callback
from typing_extensions import override


def graph_state(stats) -> str:
    """``"eager"``, ``"captured N"`` (N layer calls; ``"in S sets"`` with several) and ``", fallback"``
    when calls ran eagerly for shapes not captured or layers whose capture failed."""
    if stats is None:
        return ""
    text = f"captured {stats.captured_runners}" if stats.captured_runners else "eager"
    sets = getattr(stats, "graph_sets", 0)
    if sets > 1:
        text += f" in {sets} sets"
    if stats.fallback_calls or getattr(stats, "failed_layers", None):
        text += ", fallback"
    return text


class GraphMonitorMixin:
    """Log per-layer-graph metrics every ``log_every_n_steps`` optimizer steps.

    Metrics (all through ``pl_module.log``, so every configured Lightning logger receives them):
    ``graphs/captured`` (number of captured layer calls), ``graphs/replays_per_step`` (forward replays
    per training step since the last log), ``graphs/eager_fallbacks`` (calls that ran eagerly because
    their arguments differed from the captured ones, cumulative), ``graphs/capture_s`` (seconds spent
    warming up and capturing, cumulative), ``graphs/step_time_ms`` (wall time per training step, host
    clock, since the last log), ``graphs/sets`` (graph sets, one per captured input signature) and
    ``graphs/pool_bytes`` (device memory allocated while capturing, i.e. ``torch.cuda.memory_allocated``
    after minus before each capture, summed: the graphs' static buffers and pool; 0 on CPU); with
    ``graphs.capture_optimizer`` also ``graphs/optimizer_replays`` (optimizer steps replayed from a graph so
    far in this fit); with ``graphs.capture_eval`` also ``graphs/eval_replays`` (eval-mode layer calls
    replayed from forward-only graphs so far in this fit); with ``graphs.whole_step`` also
    ``graphs/step_replays`` (training steps replayed from a graph of the whole step so far) and
    ``graphs/step_eager`` (steps after warmup that ran eagerly: a batch of another shape).

    With ``prog_bar`` the progress bar shows ``graphs/captured`` and a ``graphs`` entry with the state:
    ``eager`` (before capture), ``captured N`` and ``, fallback`` when some calls run eagerly.

    Does nothing unless the strategy is ``cudagraph_ddp`` with graphs enabled. Since it logs through
    ``pl_module.log``, rows reach the loggers only on steps where the Trainer writes logs
    (``Trainer(log_every_n_steps=...)``), as with Lightning's ``LearningRateMonitor``: use a multiple of it.
    """

    def __init__(self, log_every_n_steps: int = 10, prog_bar: bool = True) -> None:
        self.log_every_n_steps = max(1, log_every_n_steps)
        self.prog_bar = prog_bar
        self._last_replays = 0
        self._last_batches = 0
        self._batches = 0
        self._t0: Optional[float] = None
        self._bar = None

    @staticmethod
    def _stats(trainer):
        manager = getattr(trainer.strategy, "graph_manager", None)
        return None if manager is None else manager.stats

    @staticmethod
    def _step_stats(trainer):
        """The whole-step graphs' counters (``graphs.whole_step``), or ``None``."""
        whole_step = getattr(trainer.strategy, "whole_step", None)
        return None if whole_step is None else whole_step.stats

    # ----------------------------------------------------------------- progress bar
    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        bar = trainer.progress_bar_callback
        if not self.prog_bar or bar is None or "get_metrics" in bar.__dict__:
            return
        original = bar.get_metrics

        def get_metrics(trainer, pl_module):
            metrics = original(trainer, pl_module)
            state = graph_state(self._stats(trainer))
            step_stats = self._step_stats(trainer)
            if step_stats is not None and step_stats.replays:
                state = "whole step" + (f"; layers {state}" if state and state != "eager" else "")
            if state:
                metrics["graphs"] = state
            return metrics

        bar.get_metrics = get_metrics  # on this instance only; removed at teardown
        self._bar = bar

    @override
    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._bar is not None:
            self._bar.__dict__.pop("get_metrics", None)
            self._bar = None

    # ----------------------------------------------------------------- metrics
    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stats, step_stats = self._stats(trainer), self._step_stats(trainer)
        if stats is None and step_stats is None:
            return
        self._batches += 1
        now = time.perf_counter()
        replays = stats.forward_replays if stats is not None else 0
        if self._t0 is None:
            self._t0 = now
            self._last_batches = self._batches
            self._last_replays = replays
            return
        if trainer.global_step % self.log_every_n_steps != 0 or self._batches == self._last_batches:
            return
        batches = self._batches - self._last_batches
        if step_stats is not None:
            pl_module.log("graphs/step_replays", float(step_stats.replays), on_step=True)
            pl_module.log("graphs/step_eager", float(step_stats.eager_steps), on_step=True)
        if stats is None:
            pl_module.log("graphs/step_time_ms", 1000.0 * (now - self._t0) / batches, on_step=True)
            self._t0, self._last_batches = now, self._batches
            return
        pl_module.log("graphs/captured", float(stats.captured_runners), prog_bar=self.prog_bar, on_step=True)
        pl_module.log("graphs/replays_per_step", (stats.forward_replays - self._last_replays) / batches, on_step=True)
        pl_module.log("graphs/eager_fallbacks", float(stats.fallback_calls), on_step=True)
        pl_module.log("graphs/capture_s", float(stats.capture_seconds), on_step=True)
        if stats.compile_seconds:
            pl_module.log("graphs/compile_s", float(stats.compile_seconds), on_step=True)
        pl_module.log("graphs/step_time_ms", 1000.0 * (now - self._t0) / batches, on_step=True)
        pl_module.log("graphs/sets", float(stats.graph_sets), on_step=True)
        pl_module.log("graphs/pool_bytes", float(stats.pool_bytes), on_step=True)
        strategy = trainer.strategy
        if getattr(getattr(strategy, "graph_options", None), "capture_optimizer", False):
            pl_module.log("graphs/optimizer_replays", float(strategy.optimizer_replays), on_step=True)
        if getattr(getattr(strategy, "graph_options", None), "capture_eval", False):
            pl_module.log("graphs/eval_replays", float(stats.eval_replays), on_step=True)
        self._t0 = now
        self._last_batches = self._batches
        self._last_replays = stats.forward_replays


class GraphMonitor(GraphMonitorMixin, Callback):
    __doc__ = GraphMonitorMixin.__doc__
