"""``CUDAGraphDDPStrategy``: Lightning's DDP strategy with per-layer graphs and the project's DDP engine.

Registered as ``"cudagraph_ddp"`` on ``import cg_lightning``. It is a ``DDPStrategy`` subclass, so
Lightning's launchers, samplers, accumulation and checkpointing paths stay as they are; what changes:

* ``_setup_model`` wraps the LightningModule in :class:`~cg_lightning.ddp.DataParallelEngine` (not
  torch DDP) and installs a :class:`~cg_lightning.graphs.GraphManager` on the chosen layers;
* ``training_step`` tells the manager a micro-batch starts (call indices, capture schedule);
* ``block_backward_sync`` (gradient accumulation) uses the engine's ``no_sync``;
* ``post_backward`` finishes the gradient sync and points ``param.grad`` at ``main_grad``, before
  ``on_before_optimizer_step`` and gradient clipping; ``optimizer_step`` zeroes the buffers afterwards and,
  with ``graphs.capture_optimizer``, replays the optimizer step from a graph.

Works for 1..N devices: real CUDA graphs on GPUs, the eager graph backend on CPUs.
"""

from __future__ import annotations

import atexit
from contextlib import contextmanager
from typing import Any, Callable, Dict, Generator, Optional, Union

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.optim import Optimizer

from .ddp import DataParallelEngine, DDPOptions
from .graphs import GraphManager, GraphOptions
from .optim.fused_adam_step import CachedFusedAdamStep, fused_adam_refusal
from .optim.step_graph import ACTIVE as OPTIMIZER_GRAPH_ACTIVE
from .optim.step_graph import OptimizerStepGraph, optimizer_refusal, step_replaced
from .options import as_options
from .protocol import main_grad


def _destroy_process_group_at_exit() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class CUDAGraphDDPStrategy(DDPStrategy):
    """Data-parallel training with per-layer CUDA graphs and exact ``main_grad`` accumulation.

    Args:
        graphs: :class:`~cg_lightning.graphs.GraphOptions` (or a dict of its fields): which layers,
            warmup steps, backend, shape policy. A :class:`~cg_lightning.callbacks.CUDAGraphCallback` among the
            Trainer's callbacks overrides its schedule fields at setup.
        ddp: :class:`~cg_lightning.ddp.DDPOptions` (or a dict): bucket size (MiB), averaging,
            ``main_grad`` dtype, timeout.
        **kwargs: passed to Lightning's ``DDPStrategy`` (``process_group_backend``, ``timeout``,
            ``start_method``, ...). torch-DDP-only options (``find_unused_parameters``, comm hooks) are
            refused because the engine is not torch DDP.

    Raises:
        ValueError: for options of torch DDP that this engine does not implement, or manual
            optimization (refused at setup with a message).
    """

    strategy_name = "cudagraph_ddp"

    def __init__(
        self,
        graphs: Union[GraphOptions, Dict[str, Any], None] = None,
        ddp: Union[DDPOptions, Dict[str, Any], None] = None,
        **kwargs: Any,
    ) -> None:
        unsupported = sorted(
            k for k in kwargs if k in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view",
                                       "bucket_cap_mb", "broadcast_buffers", "ddp_comm_hook",
                                       "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")
        )
        if unsupported:
            raise ValueError(
                f"CUDAGraphDDPStrategy does not take torch-DDP options {unsupported}: its own engine buckets by "
                "ddp.bucket_size_mb and requires every trainable parameter to get a gradient every step. Its "
                "equivalents go in ddp={...}: bucket_size_mb, broadcast_buffers, average, grad_dtype, timeout_s."
            )
        super().__init__(**kwargs)
        self.graph_options = as_options(GraphOptions, graphs, "graphs")
        self.ddp_options = as_options(DDPOptions, ddp, "ddp")
        self.engine: Optional[DataParallelEngine] = None
        self.graph_manager: Optional[GraphManager] = None
        self.last_graph_stats = None  # GraphStats of the last fit, kept after teardown
        self._optimizer_graphs: Dict[int, OptimizerStepGraph] = {}  # id(optimizer) -> its step graph
        self._cached_steps: Dict[int, Optional[CachedFusedAdamStep]] = {}  # id(optimizer) -> cached fused step
        self.last_cached_optimizer_steps = 0  # optimizer steps taken on cached lists in the last fit
        self.last_optimizer_replays = 0  # optimizer steps replayed from a graph in the last fit

    # ----------------------------------------------------------------- setup
    def setup_distributed(self) -> None:
        """Lightning's process-group setup, plus destroying the group at interpreter exit for every backend.

        Lightning registers that for NCCL only; a gloo group (CPU runs, and the engine's control group on
        GPUs) still alive at exit can abort the process on recent torch ("terminate called without an
        active exception").
        """
        super().setup_distributed()
        atexit.register(_destroy_process_group_at_exit)

    def setup(self, trainer: Any) -> None:
        """Lightning's DDP setup; outside fitting (``trainer.validate/test/predict``) with
        ``graphs.capture_eval`` also a graph manager for eval-mode graphs only (no DDP engine: nothing to
        reduce), removed again at teardown."""
        super().setup(trainer)
        if (trainer.state.fn != TrainerFn.FITTING and self.graph_options.enabled and self.graph_options.capture_eval
                and self.graph_manager is None and self.lightning_module is not None):
            self.graph_manager = GraphManager(
                self.lightning_module, self.graph_options, self.root_device, accumulate_into_main_grad=False
            )

    def _setup_model(self, model: Module) -> DataParallelEngine:
        lm = self.lightning_module
        if lm is not None and not lm.automatic_optimization:
            raise ValueError(
                "strategy='cudagraph_ddp' supports automatic optimization only: with manual optimization the "
                "engine cannot tell when a backward ends. Use strategy='ddp' for this LightningModule, or "
                "switch it to automatic optimization."
            )
        if self.graph_options.enabled:
            self.graph_manager = GraphManager(
                model, self.graph_options, self.root_device, accumulate_into_main_grad=True
            )
        stream = getattr(self.graph_manager.backend, "stream", None) if self.graph_manager else None
        engine = DataParallelEngine(model, self.ddp_options, grad_accumulator_stream=stream)
        if self.graph_manager is not None:
            self.graph_manager.bind_grad_ready(engine.grad_ready)
        self.engine = engine
        return engine

    def _register_ddp_hooks(self) -> None:
        """The engine registers its own hooks; torch-DDP comm hooks do not apply."""

    # ----------------------------------------------------------------- training step
    def training_step(self, *args: Any, **kwargs: Any):
        # A window whose gradients never reached an optimizer step (a LightningModule.optimizer_step that ran the
        # closure but skipped optimizer.step) leaves them exposed in param.grad: Lightning's optimizer_zero_grad
        # before the next backward clears them there, and the engine's take_back_grads zeroes main_grad to match;
        # without that zero_grad they accumulate, as under "ddp".
        manager = self.graph_manager
        if manager is None:
            return super().training_step(*args, **kwargs)
        captures = manager.stats.captures
        manager.begin_step(self.lightning_module.trainer.global_step)
        try:
            return super().training_step(*args, **kwargs)
        finally:
            manager.end_step()
            if manager.stats.captures != captures:
                stats = manager.stats
                self._announce(
                    f"cg_lightning: captured {stats.captured_runners} layer calls "
                    f"({', '.join(layer.name for layer in manager.layers)}) with the {stats.backend} backend "
                    f"in {stats.capture_seconds:.2f} s"
                    + (f" ({stats.graph_sets} graph sets)" if stats.graph_sets > 1 else "")
                    + (f", chained into {stats.segments} segment(s)" if stats.segments else "")
                )

    def _announce(self, message: str) -> None:
        """Rank 0 prints ``message`` on its own line: through the progress bar when one is drawn (a plain log
        line would be glued to the bar's unfinished line), else through Lightning's rank-zero logger."""
        trainer = self.lightning_module.trainer
        bar = getattr(trainer, "progress_bar_callback", None)
        if bar is not None and trainer.is_global_zero and getattr(bar, "is_enabled", False):
            bar.print(message)
        else:
            rank_zero_info(message)

    @contextmanager
    def block_backward_sync(self) -> Generator:
        if self.engine is not None:
            with self.engine.no_sync():
                yield None
        else:
            yield None

    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any):
        """Lightning's backward, with the engine's part between autograd and ``on_after_backward``, where torch
        DDP has its all-reduce done: the hooks see ``param.grad`` as under ``strategy="ddp"`` (the all-reduced
        sum on the micro-batch that steps, the local sum so far on the others)."""
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)  # on_before_backward
        if self.engine is not None:
            # after on_before_backward, which sees (and may change) the sum so far in param.grad, as under "ddp"
            self.engine.take_back_grads()
        self.precision_plugin.backward(closure_loss, self.lightning_module, optimizer, *args, **kwargs)
        self._finish_engine_backward()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """The graph manager sees the loss (``graphs.direct_grad_ready``). Gradients still exposed from the last
        micro-batch go back into ``main_grad`` in :meth:`backward`, after ``on_before_backward``."""
        if self.graph_manager is not None:
            self.graph_manager.before_backward(closure_loss)

    def _finish_engine_backward(self) -> None:
        """Wait for the all-reduce (unless Lightning accumulates under ``no_sync``) and point ``param.grad`` at
        ``main_grad``; on accumulation micro-batches only when that is the tensor itself (``ddp.grad_dtype``
        unset or equal to the parameters' dtype), as a cast copy could not be carried back exactly."""
        engine = self.engine
        if engine is None:
            return
        if engine.sync_enabled:
            engine.finish_grad_sync()
        engine.expose_after_backward(completes_step=engine.sync_enabled)

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Module] = None,
        **kwargs: Any,
    ) -> Any:
        """Lightning's step (closure: forward, backward, clipping; then ``optimizer.step``), then the engine's
        ``zero_grad_buffer``. With ``graphs.capture_optimizer`` the ``optimizer.step`` part is, once the layers
        replay from graphs, first run eagerly with the groups prepared for capture, then captured, then
        replayed (:class:`~cg_lightning.graphs.optimizer_step.OptimizerStepGraph`)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        graph = self._optimizer_graph(optimizer)
        cached = self._cached_step(optimizer)
        if graph is not None and graph.phase in OPTIMIZER_GRAPH_ACTIVE:
            with step_replaced(optimizer, graph.step):
                out = super().optimizer_step(optimizer, closure, model, **kwargs)
        elif cached is not None and (graph is None or graph.phase == "eager"):
            with step_replaced(optimizer, cached.step):
                out = super().optimizer_step(optimizer, closure, model, **kwargs)
        else:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.engine is not None:
            self.engine.zero_grad_buffer()
        return out

    def _optimizer_graph(self, optimizer: Optimizer) -> Optional[OptimizerStepGraph]:
        """The optimizer's step graph once the layers replay and ``graphs.capture_optimizer`` is on; its groups
        are prepared here, before the one eager step that precedes capture."""
        manager = self.graph_manager
        if manager is None or not self.graph_options.capture_optimizer:
            return None
        graph = self._optimizer_graphs.get(id(optimizer))
        if graph is None:
            if not manager.captured:
                return None
            graph = OptimizerStepGraph(optimizer, manager.backend)
            self._optimizer_graphs[id(optimizer)] = graph
            reason = optimizer_refusal(optimizer, manager.backend.name)
            if reason is None and getattr(self.precision_plugin, "scaler", None) is not None:
                reason = "the GradScaler of 16-mixed checks the gradients for inf/NaN on the host before each step"
            if reason is None and self.engine is not None and any(
                main_grad(p).dtype != p.dtype for p in self.engine.params
            ):
                reason = ("ddp.grad_dtype differs from the parameters' dtype, so the optimizer gets a new cast copy "
                          "of main_grad every step; leave ddp.grad_dtype unset to capture the step")
            if reason is not None:
                graph.give_up(reason)
            else:
                graph.prepare()
        return graph

    def _cached_step(self, optimizer: Optimizer) -> Optional[CachedFusedAdamStep]:
        """The cached fused Adam/AdamW step (``graphs.cached_optimizer_step``) for ``optimizer``, or ``None`` where
        it does not apply (option off, graphs off, another optimizer)."""
        if self.graph_manager is None or not self.graph_options.cached_optimizer_step:
            return None
        key = id(optimizer)
        if key not in self._cached_steps:
            self._cached_steps[key] = None if fused_adam_refusal(optimizer) else CachedFusedAdamStep(optimizer)
        return self._cached_steps[key]

    @property
    def cached_optimizer_steps(self) -> int:
        """Optimizer steps taken on cached tensor lists so far in this fit (``graphs.cached_optimizer_step``)."""
        return sum(c.cached_steps for c in self._cached_steps.values() if c is not None)

    @property
    def optimizer_replays(self) -> int:
        """Optimizer steps replayed from a graph so far in this fit (``graphs.capture_optimizer``)."""
        return sum(graph.replays for graph in self._optimizer_graphs.values())

    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        """The optimizer's state dict, with ``capturable`` as the user set it (a captured step sets it on every
        group), so the checkpoint loads under any strategy."""
        state = super().optimizer_state(optimizer)
        raw = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        graph = self._optimizer_graphs.get(id(raw))
        return graph.state_dict_view(state) if graph is not None else state

    # ----------------------------------------------------------------- teardown
    def teardown(self) -> None:
        self.last_optimizer_replays = self.optimizer_replays
        self.last_cached_optimizer_steps = self.cached_optimizer_steps
        self._cached_steps = {}
        for graph in self._optimizer_graphs.values():
            if graph.phase in OPTIMIZER_GRAPH_ACTIVE:
                graph.restore()
        self._optimizer_graphs = {}
        if self.graph_manager is not None:
            self.last_graph_stats = self.graph_manager.stats
            self.graph_manager.remove()
            self.graph_manager = None
        if isinstance(self.model, DataParallelEngine):
            self.model = self.lightning_module
        if self.engine is not None:
            self.engine.close()
        self.engine = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="DDP with per-layer CUDA graphs and an exact main_grad engine (cg-lightning)",
            override=True,
        )
