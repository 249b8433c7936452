"""Turning a loaded :class:`~cg_lightning.config.RunConfig` into Lightning objects.

Model, data module and callbacks are built by import path (``class_path`` + ``init_args``, as with
Lightning's ``LightningCLI``); the strategy, the logger and the ``Trainer`` from the typed sections.
Every problem is a :class:`~cg_lightning.config.errors.ConfigError` that names the key and, for a
loaded configuration, the file that set it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable, List, Optional

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback

from .conflicts import ShapePolicyDataCheck
from .errors import ConfigError, short
from .instantiate import _instantiate
from .loading import _as_run_config
from .provenance import from_text
from .saving import SaveResolvedConfig
from .schema import LOGGER_NAME, LOGGERS, STRATEGY_NAMES, RunConfig, TrainerConfig


def build_model(cfg: RunConfig) -> Any:
    """The ``LightningModule`` of ``cfg.model``. Call ``seed_everything(cfg.seed)`` first.

    Raises:
        ConfigError: see :func:`~cg_lightning.config.instantiate._instantiate` (import, arguments,
            not a ``LightningModule``).
    """
    from lightning.pytorch import LightningModule

    cfg = _as_run_config(cfg)
    return _instantiate(cfg.model, "model", LightningModule, cfg)


def build_datamodule(cfg: RunConfig) -> Any:
    """The ``LightningDataModule`` of ``cfg.data``.

    Raises:
        ConfigError: as :func:`build_model`, for a ``LightningDataModule``.
    """
    from lightning.pytorch import LightningDataModule

    cfg = _as_run_config(cfg)
    return _instantiate(cfg.data, "data", LightningDataModule, cfg)


def build_callbacks(cfg: RunConfig) -> List[Any]:
    """The Lightning callbacks of ``cfg.callbacks``, in order.

    Raises:
        ConfigError: as :func:`build_model`, for a ``lightning.pytorch.Callback``, keyed ``callbacks[i]``.
    """
    cfg = _as_run_config(cfg)
    return [_instantiate(c, f"callbacks[{i}]", Callback, cfg) for i, c in enumerate(cfg.callbacks)]


def build_strategy(cfg: RunConfig) -> Any:
    """``CUDAGraphDDPStrategy`` (``cudagraph_ddp``), Lightning's ``DDPStrategy`` (``ddp``) or ``"auto"``.

    ``graphs`` and ``ddp`` options only apply to ``cudagraph_ddp``; the eager ``ddp`` baseline uses
    Lightning's defaults.

    Raises:
        ConfigError: ``strategy.name`` is none of the known names (only possible for a ``RunConfig``
            built in Python and changed after construction).
    """
    cfg = _as_run_config(cfg)
    name = cfg.strategy.name
    if name == "cudagraph_ddp":
        from cg_lightning.strategy import CUDAGraphDDPStrategy  # lazy: heavy, and optional for other names

        return CUDAGraphDDPStrategy(
            graphs=dataclasses.replace(cfg.strategy.graphs), ddp=dataclasses.replace(cfg.strategy.ddp)
        )
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    if name == "auto":
        return "auto"
    raise ConfigError(f"strategy.name: must be one of {STRATEGY_NAMES}, got {name!r}")


def _build_logger(trainer_cfg: TrainerConfig, cfg: Any = None) -> Any:
    if trainer_cfg.logger == "none":
        return False
    if trainer_cfg.logger == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=trainer_cfg.default_root_dir, name=LOGGER_NAME)
    if trainer_cfg.logger == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        try:
            return TensorBoardLogger(save_dir=trainer_cfg.default_root_dir, name=LOGGER_NAME)
        except ModuleNotFoundError as exc:
            raise ConfigError(
                f"trainer.logger: 'tensorboard' needs the tensorboard package ({exc}); "
                f"install it or use 'csv' or 'none'{from_text(cfg, 'trainer.logger')}"
            ) from exc
    raise ConfigError(f"trainer.logger: must be one of {LOGGERS}, got {trainer_cfg.logger!r}")


def _rejected_key(message: str, t: TrainerConfig) -> Optional[str]:
    """The trainer field a Lightning message is about: the first one it names, else one whose string
    value it quotes (``No supported gpu backend found!`` -> ``accelerator``)."""
    named = []
    for f in dataclasses.fields(t):
        m = re.search(rf"(?<![\w]){re.escape(f.name)}(?![\w])", message)
        if m:
            named.append((m.start(), f.name))
    if named:
        return min(named)[1]
    for name in ("accelerator", "precision", "devices"):
        value = getattr(t, name)
        if isinstance(value, str) and value != "auto" and re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", message):
            return name
    return None


def build_trainer(cfg: RunConfig, extra_callbacks: Iterable[Any] = ()) -> Any:
    """A ``lightning.pytorch.Trainer`` for ``cfg``.

    Its callbacks are those of ``cfg.callbacks``, then :class:`SaveResolvedConfig`, then (with graphs and
    ``strategy.graphs.shape_policy: error``) :class:`~cg_lightning.config.conflicts.ShapePolicyDataCheck`,
    then ``extra_callbacks``.

    Raises:
        ConfigError: for the callbacks and the logger as above, and when Lightning rejects the trainer
            settings (for example an accelerator this machine does not have); the message names the
            ``trainer.*`` key Lightning complained about where it can be told, and its file.
    """
    from lightning.pytorch import Trainer

    cfg = _as_run_config(cfg)
    t = cfg.trainer
    strategy = build_strategy(cfg)
    callbacks = build_callbacks(cfg) + [SaveResolvedConfig(cfg)]
    graphs = cfg.strategy.graphs
    if cfg.strategy.name == "cudagraph_ddp" and graphs.enabled and graphs.shape_policy == "error":
        callbacks.append(ShapePolicyDataCheck(cfg))
    callbacks += list(extra_callbacks)
    logger = _build_logger(t, cfg)
    try:
        return Trainer(
            accelerator=t.accelerator,
            strategy=strategy,
            devices=t.devices,
            num_nodes=t.num_nodes,
            precision=t.precision,
            logger=logger,
            callbacks=callbacks,
            max_steps=t.max_steps,
            max_epochs=t.max_epochs,
            accumulate_grad_batches=t.accumulate_grad_batches,
            gradient_clip_val=t.gradient_clip_val,
            gradient_clip_algorithm=t.gradient_clip_algorithm,
            val_check_interval=t.val_check_interval,
            limit_val_batches=t.limit_val_batches,
            check_val_every_n_epoch=t.check_val_every_n_epoch,
            num_sanity_val_steps=t.num_sanity_val_steps,
            log_every_n_steps=t.log_every_n_steps,
            default_root_dir=t.default_root_dir,
            enable_progress_bar=t.enable_progress_bar,
            enable_checkpointing=t.enable_checkpointing,
            deterministic=t.deterministic,
        )
    except (MisconfigurationException, ValueError, TypeError) as exc:
        name = _rejected_key(str(exc), t)
        key = f"trainer.{name}" if name else "trainer"
        where = from_text(cfg, key) if name else ""
        raise ConfigError(f"{key}: Lightning rejected the trainer settings: {short(exc)}{where}") from exc
