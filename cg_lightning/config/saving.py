"""Saving the resolved configuration in the run's log folder."""

from __future__ import annotations

import os
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback

from .loading import _as_run_config, config_to_yaml
from .schema import CONFIG_FILENAME, RunConfig


class SaveResolvedConfig(Callback):
    """Writes the resolved run configuration to ``<trainer.log_dir>/config.yaml`` (rank zero only).

    The file is a valid ``--config`` for ``python -m cg_lightning``: loading it reproduces the run's
    configuration. It is written at ``setup``, before any step, so a run that fails still leaves it.
    (Lightning's ``LightningCLI`` saves its config the same way, through its ``SaveConfigCallback``.)

    Args:
        cfg: the run's configuration (a :class:`RunConfig`, or an OmegaConf node of one).
        filename: the file's name inside the log folder.
    """

    def __init__(self, cfg: RunConfig, filename: str = CONFIG_FILENAME) -> None:
        self.yaml_text = config_to_yaml(_as_run_config(cfg))
        self.filename = filename
        self.path: Optional[str] = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        log_dir = trainer.log_dir  # a broadcast under DDP: every rank must ask
        if not trainer.is_global_zero or not log_dir:
            return
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, self.filename)
        with open(self.path, "w", encoding="utf-8") as fh:
            fh.write(self.yaml_text)
