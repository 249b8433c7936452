"""``Fabric(strategy="cudagraph_ddp")``: Lightning Fabric's loop on cg-lightning's engine.

A Fabric script keeps its loop (``fabric.setup``, ``fabric.backward``, ``fabric.no_backward_sync``,
``fabric.clip_gradients``, ``optimizer.step()``, ``optimizer.zero_grad()``, ``fabric.save`` / ``fabric.load``) and
changes the strategy string. Method by method, what differs from Fabric's ``DDPStrategy``:

* ``setup_module``: graphs on the chosen layers (:func:`~cg_lightning.lifecycle.apply_graphs`) and a
  :class:`~cg_lightning.lifecycle.GraphedDataParallel` around the model in place of torch DDP; its
  :class:`~cg_lightning.lifecycle.TrainingDriver` is driven by the calls below, as the Trainer strategy drives its
  own.
* ``backward``: the driver's ``before_backward`` for every model whose forward fed this loss, the precision
  plugin's backward (loss scaling under ``16-mixed``), then ``after_backward``: the buckets' all-reduce waited for
  (unless under ``no_backward_sync``) and ``param.grad`` pointed at ``main_grad``, so clipping and the optimizer
  see the reduced gradients.
* ``no_backward_sync``: the engine's ``no_sync`` (accumulation), in one process too.
* ``optimizer_step``: the engines' step bookkeeping around the precision plugin's step (graph capture follows the
  schedule of completed steps); ``optimizer.zero_grad()`` drops ``param.grad`` and the next backward zeroes
  ``main_grad`` to match, as eager PyTorch accumulates.
* ``get_module_state_dict`` / ``load_module_state_dict``: the user's module, so checkpoints hold the keys
  ``"ddp"`` writes.
* collectives of the backward, the optimizer step, ``barrier``, ``broadcast`` and ``all_reduce`` bounded by
  ``ddp.timeout_s`` from the first set-up model on, with several processes, and named
  (:class:`~cg_lightning.ddp.PeerLostError`).

``ddp.distributed_optimizer``: the sharded step, clipping by the norm over every rank's shard, checkpoints with
every rank's shard beside the file (:mod:`.sharded`).

Refused with a message, at construction: ``graphs.whole_step`` and ``graphs.capture_optimizer`` (a Fabric loop is
the user's own Python: there is no training step to capture whole), torch DDP keyword arguments (this engine is not
torch DDP).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Dict, List, Optional, Union

from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from ..ddp import DDPOptions, peers, progress
from ..graphs import GraphOptions
from ..lifecycle import GraphedDataParallel, apply_graphs, loop_backward
from ..options import as_options
from ..registration import register_with_fabric
from .sharded import ShardedOptimizerMixin

_REFUSED_GRAPH_OPTIONS = {
    "whole_step": "a Fabric loop is the script's own Python, with no training step to capture whole",
    "capture_optimizer": "the optimizer step of a Fabric loop stays eager (its graphs are the Trainer strategy's)",
}


class _EngineSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the engine's ``no_sync``."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, GraphedDataParallel):
            raise TypeError(
                "cg_lightning: fabric.no_backward_sync takes a model set up by fabric.setup under "
                f"strategy='cudagraph_ddp'; got a {type(module).__name__}."
            )
        return module.no_sync()


class CUDAGraphDDPStrategy(ShardedOptimizerMixin, DDPStrategy):
    """Fabric's ``DDPStrategy`` with per-layer CUDA graphs and the exact ``main_grad`` engine.

    Args:
        graphs: :class:`~cg_lightning.graphs.GraphOptions` or a dict of its fields (``layers``, ``warmup_steps``,
            ``backend``, ``shape_policy``, ...).
        ddp: :class:`~cg_lightning.ddp.DDPOptions` or a dict (``bucket_size_mb`` in MiB, ``average``,
            ``grad_dtype``, ``timeout_s`` in seconds, ``find_unused_parameters``, ...).
        **kwargs: Fabric ``DDPStrategy`` arguments (``accelerator``, ``parallel_devices``, ``cluster_environment``,
            ``checkpoint_io``, ``precision``, ``process_group_backend``, ``timeout``, ``start_method``).

    Raises:
        TypeError, ValueError: an option of the wrong type or out of range (named, with what is accepted);
            ``graphs.whole_step`` or ``graphs.capture_optimizer`` set; torch DDP keyword arguments (``find_unused_parameters=...``: use ``ddp={"find_unused_parameters": True}``).
    """

    def __init__(
        self,
        graphs: Union[GraphOptions, Dict[str, Any], None] = None,
        ddp: Union[DDPOptions, Dict[str, Any], None] = None,
        **kwargs: Any,
    ) -> None:
        graph_options = as_options(GraphOptions, graphs, "graphs")
        ddp_options = as_options(DDPOptions, ddp, "ddp")
        for name, why in _REFUSED_GRAPH_OPTIONS.items():
            if getattr(graph_options, name):
                raise ValueError(f"cg_lightning: graphs.{name} does not apply under Fabric: {why}. Remove it; the "
                                 "layers are graphed either way.")
        base = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision",
                "process_group_backend", "timeout", "start_method"}
        torch_ddp = sorted(set(kwargs) - base)
        if torch_ddp:
            raise ValueError(
                f"cg_lightning: {', '.join(torch_ddp)}: torch DistributedDataParallel arguments do not apply, the "
                "engine is not torch DDP. Set its options with ddp={...} (bucket_size_mb, average, "
                "find_unused_parameters, ...), or strategy='cudagraph_ddp_find_unused_parameters_true'.")
        super().__init__(**kwargs)
        self.graph_options = graph_options
        self.ddp_options = ddp_options
        self._backward_sync_control = _EngineSyncControl()
        self._engines: List[GraphedDataParallel] = []
        self._engines_by_optimizer: Dict[tuple, List[GraphedDataParallel]] = {}
        self._faults_started = False

    # ----------------------------------------------------------------- setup
    @override
    def setup_module(self, module: Module) -> Module:
        """Graph ``module``'s layers and wrap it in a :class:`~cg_lightning.lifecycle.GraphedDataParallel` (a module
        without trainable parameters is returned as it is).

        Raises:
            ValueError: from the graph manager, when ``graphs.layers`` matches no module.
        """
        if not any(p.requires_grad for p in module.parameters()):
            return module
        manager = apply_graphs(module, self.graph_options, self.root_device)
        engine = GraphedDataParallel(module, self.ddp_options, manager)
        engine.hooks_armed = False  # armed inside fabric.backward only
        engine.backward_call = "fabric.backward(loss)"
        self._engines.append(engine)
        self._engines_by_optimizer.clear()
        self._start_faults()
        return engine

    def _start_faults(self) -> None:
        if not self._faults_started:
            self._faults_started = peers.bound_world(self.ddp_options.timeout_s)

    def _bounded(self, phase: str):
        return peers.bounded_phase(self._engines[0].steps if self._engines else -1, phase, self.ddp_options.timeout_s)

    # ----------------------------------------------------------------- backward
    @override
    def backward(self, tensor: Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        """The precision plugin's backward between the engines' ``before_backward`` and ``after_backward`` (see
        the module docstring).

        Raises:
            GradSyncError: a parameter did not report its gradient on some rank (named in the message).
            PeerLostError: another rank is gone or silent past ``ddp.timeout_s`` (named in the message).
            RuntimeError: the loss reached a set-up model's parameters without a forward of the set-up model.
        """
        loop_backward(
            self._engines, tensor, lambda: super(CUDAGraphDDPStrategy, self).backward(tensor, module, *args, **kwargs),
            lambda engine: engine.sync_enabled, lambda: self._bounded("backward"), rank_zero_info,
            "cg_lightning: fabric.backward reached parameters of a model set up under strategy='cudagraph_ddp' "
            "without a forward of the set-up model since the last backward (a forward of model.module, or a second "
            "backward through one forward): call the model fabric.setup returned, once per backward.")

    # ----------------------------------------------------------------- optimizer
    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The precision plugin's step (a ``GradScaler``'s under ``16-mixed``), between the step bookkeeping of
        every engine whose parameters ``optimizer`` holds.

        Raises:
            RuntimeError: a forward's backward did not go through ``fabric.backward``.
            PeerLostError: see :meth:`backward`.
        """
        engines = self._engines_of(optimizer)
        for engine in engines:
            engine.check_ready_for_step()
        with self._bounded("optimizer step") if engines else contextlib.nullcontext(), self._sharded_step(optimizer):
            out = super().optimizer_step(optimizer, **kwargs)  # ddp.distributed_optimizer: the shard, the all-gather
        for engine in engines:
            engine.after_optimizer_step()
        return out

    def _engines_of(self, optimizer: Any) -> List[GraphedDataParallel]:
        """The engines holding parameters of ``optimizer``; looked up again only when its groups change (not a walk
        over every parameter at every step)."""
        key = (id(optimizer), tuple(len(group["params"]) for group in optimizer.param_groups))
        found = self._engines_by_optimizer.get(key)
        if found is None:
            ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
            found = self._engines_by_optimizer[key] = [e for e in self._engines if any(id(p) in ids for p in e.params)]
        return found

    # ----------------------------------------------------------------- collectives, bounded and named
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Fabric's ``barrier``; with several processes, bounded by ``ddp.timeout_s`` (``PeerLostError``)."""
        with self._bounded("barrier") if self._faults_started else contextlib.nullcontext():
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Fabric's ``broadcast``; with several processes, bounded by ``ddp.timeout_s`` (``PeerLostError``)."""
        with self._bounded("broadcast") if self._faults_started else contextlib.nullcontext():
            return super().broadcast(obj, src)

    @override
    def all_reduce(self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Tensor:
        """Fabric's ``all_reduce``; with several processes, bounded by ``ddp.timeout_s`` (``PeerLostError``)."""
        with self._bounded("all_reduce") if self._faults_started else contextlib.nullcontext():
            return super().all_reduce(tensor, group=group, reduce_op=reduce_op)

    # ----------------------------------------------------------------- checkpoints
    @override
    def get_module_state_dict(self, module: Module) -> Dict[str, Any]:
        if isinstance(module, GraphedDataParallel):
            module = module.module
        return super().get_module_state_dict(module)

    @override
    def load_module_state_dict(self, module: Module, state_dict: Dict[str, Any], strict: bool = True) -> None:
        if isinstance(module, GraphedDataParallel):
            module = module.module
        super().load_module_state_dict(module=module, state_dict=state_dict, strict=strict)

    # ----------------------------------------------------------------- teardown
    @override
    def teardown(self) -> None:
        """Release the engines (graphs and hooks removed; the models train as if never set up), then Fabric's."""
        self.wait_for_params()
        for engine in self._engines:
            engine.release()
        self._engines = []
        self._engines_by_optimizer.clear()
        if self._faults_started:
            progress.close_board()
            self._faults_started = False
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("cudagraph_ddp", cls, description="DDP with per-layer CUDA graphs and an exact "
                                   "main_grad engine (cg-lightning)")
        strategy_registry.register("cudagraph_ddp_find_unused_parameters_true", cls,
                                   description="cudagraph_ddp with ddp.find_unused_parameters",
                                   ddp={"find_unused_parameters": True})


register_with_fabric()  # the strategy name, when this module is imported before Fabric's registry knows it
