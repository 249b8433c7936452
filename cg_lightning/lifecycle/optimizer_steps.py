"""What runs as ``optimizer.step()`` inside :meth:`TrainingDriver.stepping <.driver.TrainingDriver.stepping>`.

Per optimizer, chosen where it applies, in this order: the sharded step (``ddp.distributed_optimizer``: the
optimizer's update on this rank's shard, then the parameters' all-gather started, waited for by the next forward
under ``ddp.overlap_param_gather``; never captured), the step graph (``graphs.capture_optimizer``, once the
layers replay: a fused Adam/AdamW step recorded and replayed while its values hold, else the cached step; refused
with a reason, e.g. a ``ddp.grad_dtype`` other than the parameters'), the cached fused Adam step
(``graphs.cached_optimizer_step``), else the optimizer's own ``step``.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from ..ddp import DataParallelEngine
from ..graphs import GraphManager, GraphOptions
from ..optim.fused_adam_step import CachedFusedAdamStep, fused_adam_refusal
from ..optim.sharded_optimizer import ShardedOptimizer
from ..optim.step_graph import OptimizerStepGraph, optimizer_refusal
from ..protocol import main_grad


class OptimizerSteps:
    """The step graphs and cached fused steps of the optimizers a driver has stepped.

    Args:
        graph_options: read at every step (``capture_optimizer``, ``cached_optimizer_step``).
        graph_manager: the layers' manager, or ``None``.
        engine: the data-parallel engine (its parameters' ``main_grad`` dtype), or ``None``.

    Attributes:
        step_backend: the whole-step graphs' backend (set by the driver), or ``None``. With neither a manager nor
            this backend, every optimizer takes its own step.
    """

    def __init__(self, graph_options: GraphOptions, graph_manager: Optional[GraphManager],
                 engine: Optional[DataParallelEngine]) -> None:
        self.graph_options = graph_options
        self.graph_manager = graph_manager
        self.engine = engine
        self.step_backend = None
        self._graphs: Dict[int, OptimizerStepGraph] = {}  # id(optimizer) -> its step graph
        self._cached: Dict[int, Optional[CachedFusedAdamStep]] = {}  # id(optimizer) -> cached fused step
        self._sharded: Dict[int, ShardedOptimizer] = {}  # id(optimizer) -> its sharded step

    def shard(self, optimizer: torch.optim.Optimizer) -> Optional[ShardedOptimizer]:
        """``optimizer``'s :class:`~cg_lightning.optim.sharded_optimizer.ShardedOptimizer` under
        ``ddp.distributed_optimizer`` (made at the first call: before a checkpoint's optimizer state is loaded), else
        ``None``.

        Raises:
            ValueError: the optimizer cannot be sharded (not elementwise, or over other parameters).
        """
        engine = self.engine
        if engine is None or getattr(engine, "shards", None) is None:
            return None
        key = id(optimizer)
        if key not in self._sharded:
            self._sharded[key] = ShardedOptimizer(optimizer, engine.shards, self.graph_options.cached_optimizer_step,
                                                  getattr(engine, "param_gather", None))
        return self._sharded[key]

    def sharded(self, optimizer: torch.optim.Optimizer) -> Optional[ShardedOptimizer]:
        """``optimizer``'s sharded step if :meth:`shard` made one, else ``None``."""
        return self._sharded.get(id(optimizer))

    def step_for(self, optimizer: torch.optim.Optimizer, refusal: Optional[str]) -> Optional[Callable]:
        """The callable to run as ``optimizer.step`` now, or ``None``: its own ``step``. ``refusal``: the
        front-end's reason why the step must not be captured, or ``None`` (read when the optimizer is first
        seen after capture)."""
        sharded = self.shard(optimizer)
        if sharded is not None:
            return sharded.step
        graph = self._graph(optimizer, refusal)
        cached = self._cached_step(optimizer)
        if graph is not None and not graph.refused:
            return graph.step
        return cached.step if cached is not None else None

    @property
    def cached_steps(self) -> int:
        """Optimizer steps taken on cached tensor lists so far (``graphs.cached_optimizer_step``)."""
        return (sum(c.cached_steps for c in self._cached.values() if c is not None)
                + sum(s.cached_steps for s in self._sharded.values()))

    @property
    def replays(self) -> int:
        """Optimizer steps replayed from a graph so far (``graphs.capture_optimizer``)."""
        return sum(graph.replays for graph in self._graphs.values())

    def close(self) -> None:
        """Drop every step graph; forget every step (the counters restart at 0) and take only the optimizers' own
        steps from now on."""
        self._cached = {}
        for sharded in self._sharded.values():
            sharded.close()
        self._sharded = {}
        for graph in self._graphs.values():
            graph.close()
        self._graphs = {}
        self.graph_manager = self.engine = self.step_backend = None

    def _graph(self, optimizer: torch.optim.Optimizer, refusal: Optional[str]) -> Optional[OptimizerStepGraph]:
        """The optimizer's step graph under ``graphs.capture_optimizer`` (refused with one warning where it cannot
        be exact)."""
        backend = self._backend()
        if backend is None or not self.graph_options.capture_optimizer:
            return None
        graph = self._graphs.get(id(optimizer))
        if graph is None:
            reason = optimizer_refusal(optimizer, backend.name) or refusal
            graph = OptimizerStepGraph(optimizer, backend, None if reason else self._cached_step(optimizer))
            self._graphs[id(optimizer)] = graph
            if reason is None and self.engine is not None and any(
                main_grad(p).dtype != p.dtype for p in self.engine.params
            ):
                reason = ("ddp.grad_dtype differs from the parameters' dtype, so the optimizer gets a new cast copy "
                          "of main_grad every step; leave ddp.grad_dtype unset to capture the step")
            if reason is not None:
                graph.give_up(reason)
        return graph

    def _cached_step(self, optimizer: torch.optim.Optimizer) -> Optional[CachedFusedAdamStep]:
        """The cached fused Adam/AdamW step for ``optimizer``, or ``None`` where it does not apply (option off,
        graphs off, another optimizer)."""
        if self._backend() is None or not self.graph_options.cached_optimizer_step:
            return None
        key = id(optimizer)
        if key not in self._cached:
            self._cached[key] = None if fused_adam_refusal(optimizer) else CachedFusedAdamStep(optimizer)
        return self._cached[key]

    def _backend(self):
        """The backend graphs capture with: the layers' manager's, else the whole-step graphs', else ``None``."""
        return self.graph_manager.backend if self.graph_manager is not None else self.step_backend
