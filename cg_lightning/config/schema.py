"""The configuration schema: one dataclass per component, the tree mirroring the objects it builds.

::

    RunConfig
    ├── seed
    ├── trainer      TrainerConfig      -> lightning.pytorch.Trainer keyword arguments
    ├── strategy     StrategyConfig     -> CUDAGraphDDPStrategy / DDPStrategy / "auto"
    │   ├── graphs   GraphOptions       (cg_lightning.graphs.options, reused as is)
    │   └── ddp      DDPOptions         (cg_lightning.ddp.options, reused as is)
    ├── model        ComponentConfig    -> any LightningModule, by import path
    ├── data         ComponentConfig    -> any LightningDataModule, by import path
    └── callbacks    [ComponentConfig]  -> Lightning callbacks, by import path

OmegaConf turns these dataclasses into a structured config, so the key names and value types of every
YAML file are checked against them (:mod:`cg_lightning.config.loading`). A ``__post_init__`` check
raises ``ValueError`` whose message starts with the offending field's name; the loader turns it into
a :class:`~cg_lightning.config.errors.ConfigError` naming the full key and its source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from cg_lightning.ddp.options import DDPOptions
from cg_lightning.graphs.options import GraphOptions

STRATEGY_NAMES = ("cudagraph_ddp", "ddp", "auto")
LOGGERS = ("csv", "tensorboard", "none")
GRADIENT_CLIP_ALGORITHMS = ("norm", "value")
LOGGER_NAME = "lightning_logs"
CONFIG_FILENAME = "config.yaml"


@dataclass
class ComponentConfig:
    """An object built by import path: ``class_path(**init_args)``.

    The ``class_path`` / ``init_args`` pair is the convention of Lightning's ``LightningCLI`` (from
    jsonargparse), so a ``model:`` or ``data:`` section written for it reads the same here; unlike
    LightningCLI, ``init_args`` are not typed by the schema but checked against the constructor's
    signature when the object is built (:func:`cg_lightning.config.build_model` and friends).

    Attributes:
        class_path: ``"package.module.ClassName"``; imported with :mod:`importlib`, so modules such
            as ``examples.gpt`` resolve relative to the current directory (the repository root).
            Mandatory: leaving it unset is a "missing value" error.
        init_args: keyword arguments of the constructor; free-form, checked against the constructor's
            signature when the object is built.
    """

    class_path: str = MISSING
    init_args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class StrategyConfig:
    """Which training strategy runs the job.

    Attributes:
        name: ``"cudagraph_ddp"`` (per-layer graphs under the cg_lightning DDP engine), ``"ddp"``
            (Lightning's eager ``DDPStrategy``, for comparison runs) or ``"auto"`` (Lightning's choice).
        graphs: graph options; only used by ``cudagraph_ddp``.
        ddp: data-parallel engine options (bucket size in MiB, timeout in seconds); only used by
            ``cudagraph_ddp``.

    Raises:
        ValueError: ``name`` is not one of :data:`STRATEGY_NAMES`.
    """

    name: str = "cudagraph_ddp"
    graphs: GraphOptions = field(default_factory=GraphOptions)
    ddp: DDPOptions = field(default_factory=DDPOptions)

    def __post_init__(self) -> None:
        if self.name not in STRATEGY_NAMES:
            raise ValueError(f"name must be one of {STRATEGY_NAMES}, got {self.name!r}")


@dataclass
class TrainerConfig:
    """Keyword arguments of ``lightning.pytorch.Trainer`` (same names, same meaning).

    ``logger`` is the exception: ``"csv"``, ``"tensorboard"`` or ``"none"`` selects Lightning's
    ``CSVLogger``, ``TensorBoardLogger`` (writing under ``default_root_dir/lightning_logs``) or no
    logger. ``devices``, ``val_check_interval`` and ``limit_val_batches`` take an int, a float or a
    string (``"auto"``), hence ``Any``; Lightning checks them when the trainer is built.

    Units, as in Lightning: ``max_steps`` and ``log_every_n_steps`` count optimizer steps (``-1``:
    no step limit); ``accumulate_grad_batches`` counts micro-batches per optimizer step; an int
    ``val_check_interval`` / ``limit_val_batches`` counts batches, a float is a fraction of an epoch;
    ``gradient_clip_val`` is a gradient norm (``norm``) or an absolute value (``value``).

    Raises:
        ValueError: an unknown ``logger`` or ``gradient_clip_algorithm``, ``accumulate_grad_batches``
            below 1, a negative ``gradient_clip_val`` or ``max_steps`` below -1.
    """

    accelerator: str = "auto"
    devices: Any = "auto"
    num_nodes: int = 1
    precision: str = "32-true"
    max_steps: int = -1
    max_epochs: Optional[int] = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    gradient_clip_algorithm: str = "norm"
    val_check_interval: Any = None
    limit_val_batches: Any = 1.0
    check_val_every_n_epoch: Optional[int] = 1
    num_sanity_val_steps: int = 2
    log_every_n_steps: int = 10
    default_root_dir: str = "runs"
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    logger: str = "csv"
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.logger not in LOGGERS:
            raise ValueError(f"logger must be one of {LOGGERS}, got {self.logger!r}")
        if self.gradient_clip_algorithm not in GRADIENT_CLIP_ALGORITHMS:
            raise ValueError(
                f"gradient_clip_algorithm must be one of {GRADIENT_CLIP_ALGORITHMS}, "
                f"got {self.gradient_clip_algorithm!r}"
            )
        if self.accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be an int >= 1, got {self.accumulate_grad_batches}")
        if self.gradient_clip_val is not None and self.gradient_clip_val < 0:
            raise ValueError(f"gradient_clip_val must be >= 0 or null (no clipping), got {self.gradient_clip_val}")
        if self.max_steps < -1:
            raise ValueError(f"max_steps must be -1 (no limit) or an int >= 0, got {self.max_steps}")


@dataclass
class RunConfig:
    """One training or validation run: the root of the schema.

    Attributes:
        seed: passed to ``lightning.pytorch.seed_everything`` before the model is built.
        trainer, strategy, model, data, callbacks: see the tree in this module's docstring.
    """

    seed: int = 1234
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    model: ComponentConfig = field(
        default_factory=lambda: ComponentConfig(class_path="examples.gpt.GPTLightningModule")
    )
    data: ComponentConfig = field(default_factory=lambda: ComponentConfig(class_path="examples.data.TextDataModule"))
    callbacks: List[ComponentConfig] = field(default_factory=list)
