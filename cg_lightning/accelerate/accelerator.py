"""``CUDAGraphAccelerator``: an ``accelerate.Accelerator`` that trains through cg-lightning's engine.

A script written for Accelerate changes two lines::

    from cg_lightning.accelerate import CUDAGraphAccelerator
    accelerator = CUDAGraphAccelerator(graphs={"warmup_steps": 2}, mixed_precision="bf16")

and keeps its loop (``prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_``, ``optimizer.step``,
``zero_grad``). What differs from a plain ``Accelerator``, method by method (Accelerate has no plug-in
point for a data-parallel engine, so, like other libraries that bring their own DDP, this subclasses
``Accelerator`` and overrides the few methods involved):

* ``prepare_model``: Accelerate's own preparation (autocast forward, device placement) without its torch
  DDP wrap; then graphs on the chosen layers (:func:`~cg_lightning.lifecycle.apply_graphs`) and a
  :class:`GraphedDataParallel` around the model, whose :class:`~cg_lightning.lifecycle.TrainingDriver` the
  calls below drive, as the Lightning strategy drives its own.
* ``prepare_optimizer``: a :class:`GradBufferOptimizer`, whose ``zero_grad`` zeroes ``main_grad``.
* ``no_sync`` (and so ``accumulate``): the engine's ``no_sync``, also in a single process, where it
  keeps non-final micro-batches from finishing the gradient sync.
* ``backward``: the driver's ``before_backward`` and, after autograd, ``after_backward``: waits for the
  engine's buckets (unless under ``no_sync``) and points ``param.grad`` at ``main_grad``, so
  ``clip_grad_norm_`` and the optimizer see the reduced gradients; prints the driver's ``capture_summary``.
* ``unwrap_model``: also removes the engine.
* ``clip_grad_norm_`` and ``save_state``, under ``ddp.distributed_optimizer`` only (:mod:`.sharded`): the norm over
  every rank's shard; ``save_state`` refused (each rank saves its own ``optimizer.state_dict()``). With
  ``ddp.overlap_param_gather`` the parameters' all-gather after ``optimizer.step()`` runs on into the next forward of
  the prepared model, whose modules wait for it, as do ``state_dict()``, ``load_state_dict()``, the next step and
  the end of training; :meth:`~CUDAGraphAccelerator.wait_for_params` before reading parameter values otherwise in
  between.
* faults (:mod:`.faults`): collectives bounded by ``ddp.timeout_s`` that name the rank at fault; ``check_preemption``
  and ``exit_preempted`` for a stop on SIGTERM agreed by every process.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, DynamoBackend
from typing_extensions import override

from ..ddp import DDPOptions
from ..graphs import GraphOptions
from ..lifecycle import GraphedDataParallel, apply_graphs, loop_backward
from ..options import as_options
from .faults import AccelerateFaultsMixin
from .sharded import ShardedOptimizerMixin
from .optimizer import GradBufferOptimizer

_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class CUDAGraphAccelerator(ShardedOptimizerMixin, AccelerateFaultsMixin, Accelerator):
    """``accelerate.Accelerator`` with per-layer CUDA graphs and the exact ``main_grad`` DDP engine.

    Args:
        graphs: :class:`~cg_lightning.graphs.GraphOptions` or a dict of its fields: which layers (glob
            patterns over the prepared model's module names; ``None`` = the repeated blocks of every
            ``ModuleList``/``Sequential``, or no graphs with a warning when there are none), ``warmup_steps`` (eager optimizer steps before capture), ``backend``
            (``"cuda"`` on GPUs, ``"eager"`` on CPUs, ``"auto"``), ``shape_policy``.
        ddp: :class:`~cg_lightning.ddp.DDPOptions` or a dict: ``bucket_size_mb`` (MiB), ``average``,
            ``grad_dtype``, ``timeout_s`` (seconds), ``check_grad_ready``.
        preemption_signals: the signals :meth:`check_preemption` reports (default: SIGTERM, and SIGUSR1 under
            SLURM).
        *args, **kwargs: ``accelerate.Accelerator`` arguments (``mixed_precision``,
            ``gradient_accumulation_steps``, ``cpu``, ...). Launch settings come from ``accelerate
            launch`` or ``torchrun`` as usual.

    Raises:
        TypeError, ValueError: ``graphs`` or ``ddp`` of the wrong type, or a field of the wrong type or out of
            range; the message names the option (``graphs.warmup_steps``), the value and what is accepted.
        ValueError: for torch-DDP options (``DistributedDataParallelKwargs``), which this engine does
            not implement; at ``prepare`` time for DeepSpeed, FSDP, Megatron-LM, XLA, tensor or context
            parallelism, fp8 and ``torch.compile`` (dynamo), which bring their own wrapping.
    """

    def __init__(
        self,
        *args: Any,
        graphs: Union[GraphOptions, Dict[str, Any], None] = None,
        ddp: Union[DDPOptions, Dict[str, Any], None] = None,
        preemption_signals: Optional[Sequence[int]] = None,
        **kwargs: Any,
    ) -> None:
        self.preemption_signals = preemption_signals
        self.graph_options = as_options(GraphOptions, graphs, "graphs")
        self.ddp_options = as_options(DDPOptions, ddp, "ddp")
        for name, what in (("capture_optimizer", "the optimizer step runs eagerly"),
                           ("whole_step", "the step is not captured as one graph")):
            if getattr(self.graph_options, name):
                warnings.warn(
                    f"cg_lightning: graphs.{name} applies to the Lightning strategy only; under "
                    f"CUDAGraphAccelerator {what} (the layers are still graphed).",
                    stacklevel=2,
                )
        super().__init__(*args, **kwargs)
        if self.ddp_handler is not None:
            raise ValueError(
                "CUDAGraphAccelerator does not take DistributedDataParallelKwargs: its engine is not torch DDP. "
                "Set bucket sizes and averaging with ddp={'bucket_size_mb': ..., 'average': ...}."
            )
        self._graph_engines: List[GraphedDataParallel] = []

    # ----------------------------------------------------------------- prepare
    def _check_supported(self) -> None:
        problems = []
        if self.distributed_type not in _SUPPORTED:
            problems.append(f"distributed_type {self.distributed_type.value}")
        if self.mixed_precision == "fp8":
            problems.append("mixed_precision='fp8'")
        if self.state.dynamo_plugin.backend != DynamoBackend.NO:
            problems.append("torch.compile (dynamo_backend)")
        pc = getattr(self, "parallelism_config", None)
        if pc is not None and (getattr(pc, "tp_enabled", False) or getattr(pc, "cp_enabled", False)):
            problems.append("tensor/context parallelism")
        if problems:
            raise ValueError(
                f"CUDAGraphAccelerator supports plain data parallelism (no, MULTI_CPU, MULTI_GPU) with "
                f"no/fp16/bf16 mixed precision; this run asks for {', '.join(problems)}. Use accelerate.Accelerator "
                f"for it."
            )

    @override
    def prepare(self, *args: Any, device_placement=None):
        """``Accelerator.prepare``; refuses the set-ups this engine does not serve before anything is wrapped.

        DeepSpeed, FSDP2 and Megatron-LM never reach ``prepare_model`` (Accelerate hands the model to their
        own engines), so the check runs here.

        Raises:
            ValueError: see the class docstring.
        """
        if any(isinstance(obj, torch.nn.Module) for obj in args):
            self._check_supported()
        return super().prepare(*args, device_placement=device_placement)

    @override
    def prepare_model(self, model: torch.nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False):
        """Prepare ``model`` for training: Accelerate's autocast and placement, then graphs and the engine.

        Returns:
            a :class:`GraphedDataParallel` wrapping ``model`` (``model`` itself for ``evaluation_mode``,
            a model without trainable parameters or one prepared before).

        Raises:
            ValueError: see the class docstring; from ``GraphManager`` if ``graphs.layers`` is set and
                matches no module.
        """
        if evaluation_mode or getattr(model, "_is_accelerate_prepared", False):
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        self._check_supported()
        # evaluation_mode=True: Accelerate's autocast forward and device placement, without its DDP wrap.
        model = super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        if not any(p.requires_grad for p in model.parameters()):
            return model
        manager = apply_graphs(model, self.graph_options, self.device)
        engine = GraphedDataParallel(model, self.ddp_options, manager)
        self._models[self._models.index(model)] = engine
        engine._is_accelerate_prepared = True
        self._graph_engines.append(engine)
        self._start_faults()
        return engine

    @override
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None):
        """Wrap ``optimizer`` in a :class:`GradBufferOptimizer` (an ``AcceleratedOptimizer``)."""
        if getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        if device_placement is None:
            device_placement = self.device_placement
        wrapped = GradBufferOptimizer(optimizer, self._engines_of, device_placement=device_placement,
                                      scaler=self.scaler)
        self._optimizers.append(wrapped)
        for engine in self._engines_of(optimizer):  # ddp.distributed_optimizer: its sharded step, before a load
            if engine.shards is not None:
                if self.scaler is not None:
                    raise ValueError("cg_lightning: ddp.distributed_optimizer does not support fp16 mixed precision "
                                     "(its GradScaler checks every element of every gradient, of which a rank reduces "
                                     "only its shard); use bf16.")
                engine.driver.shard_optimizer(optimizer)
        return wrapped

    def _engines_of(self, optimizer) -> List[GraphedDataParallel]:
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return [e for e in self._graph_engines if any(id(p) in ids for p in e.params)]

    # ----------------------------------------------------------------- step
    @override
    @contextlib.contextmanager
    def no_sync(self, model) -> Iterator[None]:
        """Accumulate gradients locally: the engine's ``no_sync`` for engines, Accelerate's otherwise."""
        if isinstance(model, GraphedDataParallel):
            with model.no_sync():
                yield
        else:
            with super().no_sync(model):
                yield

    @override
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``Accelerator.backward`` (loss divided by the accumulation steps, fp16 scaling), then the engine.

        For every engine whose forward fed this micro-batch and whose parameters this backward reached: waits
        for its all-reduce (unless under ``no_sync``) and points ``param.grad`` at ``main_grad``. An engine whose
        forward ran but whose parameters the loss does not depend on (a GAN generator's detached output in the
        discriminator's loss) keeps its micro-batch open for the next backward.

        Raises:
            GradSyncError: a parameter did not report its gradient on some rank (named in the message).
            PeerLostError: another rank is gone or silent past ``ddp.timeout_s`` (named in the message).
        """
        loop_backward(
            self._graph_engines, loss, lambda: super(CUDAGraphAccelerator, self).backward(loss, **kwargs),
            lambda engine: self.sync_gradients, lambda: self._bounded("backward"), self.print,
            "cg_lightning: accelerator.backward reached parameters of a model prepared by "
            "CUDAGraphAccelerator without a forward of the prepared model since the last backward (a "
            "forward of accelerator.unwrap_model(model), a second backward through one forward, or two "
            "forwards followed by two backwards as in Accelerate's trigger_sync_in_backward example, which "
            "this engine does not support: add the losses and run one backward): "
            "their gradients are in main_grad, but the engine would neither all-reduce them nor point "
            "param.grad at them, and the optimizer step would change nothing. Call the prepared model, "
            "once per backward, in training steps.")

    @override
    def free_memory(self, *objects):
        """Accelerate's ``free_memory``; also releases the engines (``GraphedDataParallel.release``): their
        models train as if never prepared again (hooks and graphs removed; ``prepare`` wraps them anew)."""
        self._release_engines()
        self._stop_faults()
        objects = super().free_memory(*objects)
        gc.collect()  # an engine and its grad hooks form a reference cycle; Accelerate collects too early
        return objects

    @override
    def end_training(self) -> None:
        """Accelerate's ``end_training``; first releases the engines, as :meth:`free_memory` does, so a backward
        through the model after training (``accelerator.unwrap_model(model)``) fills ``param.grad`` again."""
        self._release_engines()
        self._stop_faults()
        super().end_training()

    def _release_engines(self) -> None:
        for engine in self._graph_engines:
            engine.release()
        self._graph_engines = []

    @override
    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The user's model: removes the engine, then whatever Accelerate added."""
        if isinstance(model, GraphedDataParallel):
            model = model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper,
                                    keep_torch_compile=keep_torch_compile)
