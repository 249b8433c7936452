"""``CUDAGraphDDPStrategy``: Lightning's DDP strategy with per-layer graphs and the project's DDP engine.

Registered as ``"cudagraph_ddp"`` on ``import cg_lightning``. It is a ``DDPStrategy`` subclass, so
Lightning's launchers, samplers, accumulation and checkpointing paths stay as they are. Its body,
:class:`CUDAGraphDDPMixin`, serves both Lightning packages: :class:`CUDAGraphDDPStrategy` here is built on
``lightning.pytorch``, :class:`.pytorch_lightning.CUDAGraphDDPStrategy` on ``pytorch_lightning``; each
takes its own package's pieces from a :class:`LightningNamespace`. The training itself is driven by a
:class:`~cg_lightning.lifecycle.TrainingDriver`; the body maps Lightning's hooks onto its events:

========================================  =====================================================================
Lightning hook                            driver event
========================================  =====================================================================
``configure_ddp`` (``setup``, fitting)     :func:`~cg_lightning.lifecycle.build_driver`: graphs on the chosen
                                          layers, the model wrapped in :class:`~cg_lightning.ddp.DataParallelEngine`
                                          (not torch DDP)
``training_step``                         ``begin_micro_batch(global_step)`` ... ``end_forward()``, then the
                                          ``capture_summary()`` printed
``block_backward_sync``                   ``no_sync()`` (gradient accumulation)
``backward``, around the precision        ``before_backward(loss)`` after ``on_before_backward``;
plugin's ``backward``                     ``after_backward()`` before ``on_after_backward``
``optimizer_step``                        ``stepping(optimizer)`` around Lightning's step, then
                                          ``after_optimizer_step(zero_grad=False)``: the
                                          gradients stay in ``param.grad`` for the hooks until
                                          Lightning's ``zero_grad``, as under ``"ddp"``
``teardown``                              ``close()``
========================================  =====================================================================

The backward and optimizer-step hooks are :mod:`.step_hooks`; faults (bounded collectives, named peer errors,
preemption) are :mod:`.faults`.

Works for 1..N devices: real CUDA graphs on GPUs, the eager graph backend on CPUs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional, Union

from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from ..registration import LightningNamespace, wrong_trainer_error
from ..ddp import DataParallelEngine, DDPOptions, peers
from .distributed_optimizer import DistributedOptimizerMixin
from ..graphs import GraphManager, GraphOptions, GraphStats
from ..lifecycle import TrainingDriver, apply_graphs, build_driver
from .faults import FaultsMixin
from .whole_step import LightningWholeStep
from ..options import as_options
from .setup_checks import check_setup, check_train_data
from .step_hooks import StepHooksMixin
from .torch_ddp_options import split_torch_ddp_kwargs


class CUDAGraphDDPMixin(StepHooksMixin, FaultsMixin, DistributedOptimizerMixin):
    """Data-parallel training with per-layer CUDA graphs and exact ``main_grad`` accumulation.

    Collectives are bounded by ``ddp.timeout_s`` from the first training step on, and a failed one is a
    :class:`~cg_lightning.ddp.PeerLostError` naming the cause and the rank; SIGTERM (and SLURM's requeue signal)
    stops every rank after the same step with a checkpoint and exit status ``128 + signal``
    (:mod:`cg_lightning.trainer.faults`).

    Args:
        graphs: :class:`~cg_lightning.graphs.GraphOptions` (or a dict of its fields): which layers,
            warmup steps, backend, shape policy. A :class:`~cg_lightning.callbacks.CUDAGraphCallback` among the
            Trainer's callbacks overrides its schedule fields at setup.
        ddp: :class:`~cg_lightning.ddp.DDPOptions` (or a dict): bucket size (MiB), averaging,
            ``main_grad`` dtype, timeout.
        **kwargs: Lightning's ``DDPStrategy`` arguments (``process_group_backend``, ``timeout``,
            ``start_method``, ...) and torch DDP's, mapped onto ``ddp`` (``find_unused_parameters``,
            ``bucket_cap_mb``, ``broadcast_buffers``), accepted (``static_graph``, ``gradient_as_bucket_view``)
            or refused with the reason (communication hooks): :mod:`cg_lightning.trainer.torch_ddp_options`.

    Attributes:
        driver: the :class:`~cg_lightning.lifecycle.TrainingDriver` of the current fit (or of
            ``validate``/``test``/``predict`` with ``graphs.capture_eval``), ``None`` outside.
        last_graph_stats: the graph counters of the last run, kept after teardown (``None`` without graphs).
        last_optimizer_replays: optimizer steps replayed from a graph in the last fit.
        last_cached_optimizer_steps: optimizer steps taken on cached tensor lists in the last fit.

    Raises:
        TypeError, ValueError: ``graphs`` / ``ddp`` values of the wrong type or out of range (naming the option,
            the value and what is accepted); ``TypeError`` also in the other Lightning package's ``Trainer``.
        ValueError: for options of torch DDP that this engine cannot honour.
    """

    strategy_name = "cudagraph_ddp"
    _lightning_ns: LightningNamespace  # set by each Lightning package's class

    def __init__(
        self,
        graphs: Union[GraphOptions, Dict[str, Any], None] = GraphOptions(),  # copied, never shared: as_options
        ddp: Union[DDPOptions, Dict[str, Any], None] = DDPOptions(),
        **kwargs: Any,
    ) -> None:
        self.graph_options = as_options(GraphOptions, graphs, "graphs")
        lightning_kwargs, self.ddp_options = split_torch_ddp_kwargs(kwargs, as_options(DDPOptions, ddp, "ddp"))
        super().__init__(**lightning_kwargs)
        self.driver: Optional[TrainingDriver] = None
        self.last_graph_stats: Optional[GraphStats] = None
        self.last_cached_optimizer_steps = 0
        self.last_optimizer_replays = 0
        self.whole_step: Optional[LightningWholeStep] = None
        self.last_step_graph_stats = None

    @property
    def engine(self) -> Optional[DataParallelEngine]:
        """The data-parallel engine of the current fit, or ``None``."""
        return self.driver.engine if self.driver is not None else None

    @property
    def graph_manager(self) -> Optional[GraphManager]:
        """The graph manager of the current run, or ``None``."""
        return self.driver.graph_manager if self.driver is not None else None

    @property
    def accelerator(self) -> Any:
        """Lightning's accelerator, unchanged; setting one of the other Lightning package (the Trainer's first
        call on its strategy) raises ``TypeError`` naming the class to import instead."""
        return super().accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Any) -> None:
        if accelerator is not None and not isinstance(accelerator, self._lightning_ns.accelerator):
            raise wrong_trainer_error(type(self), accelerator)
        super(CUDAGraphDDPMixin, type(self)).accelerator.__set__(self, accelerator)  # the base class's setter

    # ----------------------------------------------------------------- setup
    @override
    def setup_distributed(self) -> None:
        """Lightning's process-group setup, plus destroying the group at interpreter exit for every backend.

        Lightning registers that for NCCL only; a gloo group (CPU runs, and the engine's control group on
        GPUs) still alive at exit can abort the process on recent torch ("terminate called without an
        active exception").
        """
        super().setup_distributed()
        peers.destroy_world_at_exit()

    @override
    def setup(self, trainer: Any) -> None:
        """Lightning's DDP setup (which calls :meth:`configure_ddp` when fitting); outside fitting
        (``trainer.validate/test/predict``) with ``graphs.capture_eval`` also a graph manager for eval-mode
        graphs only (no DDP engine: nothing to reduce), removed again at teardown. Options that cannot work with
        the model or the device are refused first (:func:`~cg_lightning.trainer.setup_checks.check_setup`)."""
        check_setup(self, trainer)
        super().setup(trainer)
        options = self.graph_options
        if (trainer.state.fn != self._lightning_ns.fitting and options.enabled and options.capture_eval
                and self.driver is None and self.lightning_module is not None):
            manager = apply_graphs(self.lightning_module, self.graph_options, self.root_device,
                                   accumulate_into_main_grad=False)
            self.driver = TrainingDriver(self.graph_options, manager, None)

    @override
    def on_train_start(self) -> None:
        """Refuses training data the shape policy cannot take (:func:`~.setup_checks.check_train_data`)."""
        check_train_data(self, self.lightning_module.trainer)
        super().on_train_start()

    @override
    def configure_ddp(self) -> None:
        """Graphs on the chosen layers and the project's engine around the LightningModule, in place of
        torch DDP and its communication hooks (the engine registers its own)."""
        # the engine class is looked up in this module when fitting starts, so an experiment can put a subclass
        # in its place (benchmarks/accumulator_stream.py binds gradient accumulators to other streams that way)
        self.driver = build_driver(self.model, self.graph_options, self.ddp_options, self.root_device,
                                   engine_type=DataParallelEngine,
                                   whole_step=self.graph_options.whole_step is not False)
        self.model = self.driver.engine
        if self.driver.step_backend is not None:  # graphs.whole_step
            self.whole_step = LightningWholeStep(self, super().training_step, self._announce)

    # ----------------------------------------------------------------- training step
    @override
    def training_step(self, *args: Any, **kwargs: Any):
        # A window whose gradients never reached an optimizer step (a LightningModule.optimizer_step that ran the
        # closure but skipped optimizer.step) leaves them exposed in param.grad: Lightning's optimizer_zero_grad
        # before the next backward clears them there, and the driver's before_backward zeroes main_grad to match;
        # without that zero_grad they accumulate, as under "ddp".
        # Under manual optimization a training step may hold several forward-backward passes (a GAN's): each
        # graphed pass after a backward or an optimizer step is a micro-batch of its own.
        driver = self.driver
        if driver is None:
            return super().training_step(*args, **kwargs)
        if self.whole_step is not None:  # graphs.whole_step: replayed, or captured now, where due
            replayed, out = self.whole_step.training_step(args, kwargs)
            if replayed:
                return out
        trainer = self.lightning_module.trainer
        passes = (contextlib.nullcontext() if self.lightning_module.automatic_optimization
                  else driver.passes_open_micro_batches(lambda: trainer.global_step))
        driver.begin_micro_batch(trainer.global_step)
        try:
            with passes:
                return super().training_step(*args, **kwargs)
        finally:
            driver.end_forward()
            summary = driver.capture_summary()
            if summary is not None:
                self._announce(str(summary))

    def _announce(self, message: str) -> None:
        """Rank 0 prints ``message`` on its own line: through the progress bar when one is drawn (a plain log
        line would be glued to the bar's unfinished line), else through Lightning's rank-zero logger."""
        trainer = self.lightning_module.trainer
        bar = getattr(trainer, "progress_bar_callback", None)
        if bar is not None and trainer.is_global_zero and getattr(bar, "is_enabled", False):
            bar.print(message)
        else:
            self._lightning_ns.rank_zero_info(message)

    # ----------------------------------------------------------------- teardown
    @override
    def teardown(self) -> None:
        self.last_optimizer_replays = self.optimizer_replays
        self.last_cached_optimizer_steps = self.cached_optimizer_steps
        if isinstance(self.model, DataParallelEngine):
            self.model = self.lightning_module
        if self.whole_step is not None:
            self.last_step_graph_stats = self.whole_step.stats
            self.whole_step.close()
            self.whole_step = None
        driver, self.driver = self.driver, None
        if driver is not None:
            driver.close()
            if driver.last_graph_stats is not None:
                self.last_graph_stats = driver.last_graph_stats
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="DDP with per-layer CUDA graphs and an exact main_grad engine (cg-lightning)",
            override=True,
        )
        for find_unused in (False, True):  # as Lightning's ddp_find_unused_parameters_{false,true}
            strategy_registry.register(
                f"{cls.strategy_name}_find_unused_parameters_{str(find_unused).lower()}",
                cls,
                description=f"cudagraph_ddp with ddp.find_unused_parameters={find_unused} (cg-lightning)",
                find_unused_parameters=find_unused,
                override=True,
            )


class CUDAGraphDDPStrategy(CUDAGraphDDPMixin, DDPStrategy):
    __doc__ = f"""{CUDAGraphDDPMixin.__doc__.strip()}

    Built on ``lightning.pytorch``; for ``pytorch_lightning`` use
    :class:`cg_lightning.trainer.pytorch_lightning.CUDAGraphDDPStrategy`.
    """

    _lightning_ns = LightningNamespace("lightning.pytorch", Accelerator, LightningOptimizer, TrainerFn.FITTING,
                                       rank_zero_info)
