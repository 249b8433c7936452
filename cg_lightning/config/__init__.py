"""Run configuration: an OmegaConf structured schema, its loader, the object builders and the checks.

One concept a module:

* :mod:`~cg_lightning.config.schema`: the dataclasses (``RunConfig`` and one per component);
* :mod:`~cg_lightning.config.validation`: checking one YAML file or the overrides against the schema;
* :mod:`~cg_lightning.config.provenance`: which file set which key;
* :mod:`~cg_lightning.config.loading`: ``load_config`` (merge, resolve, validate) and ``config_to_yaml``;
* :mod:`~cg_lightning.config.conflicts`: settings that cannot work together, refused before training;
* :mod:`~cg_lightning.config.instantiate`: objects from ``class_path`` + ``init_args`` (``LightningCLI``'s
  convention);
* :mod:`~cg_lightning.config.building`: model, data module, callbacks, strategy, logger, ``Trainer``;
* :mod:`~cg_lightning.config.saving`: ``SaveResolvedConfig``, the resolved config in the log folder.

:func:`load_config` merges YAML files and ``dotted.key=value`` overrides on top of the schema's
defaults and turns every problem into one :class:`ConfigError` whose message says where the bad value
came from (file or command line), its full key path, and what was expected. The ``build_*`` functions
turn a loaded :class:`RunConfig` into Lightning objects.
"""

from cg_lightning.ddp.options import DDPOptions
from cg_lightning.graphs.options import GraphOptions

from .building import _build_logger, build_callbacks, build_datamodule, build_model, build_strategy, build_trainer
from .errors import COMMAND_LINE, ConfigError
from .instantiate import _import_class, _instantiate
from .loading import _as_run_config, config_to_yaml, load_config
from .saving import SaveResolvedConfig
from .schema import (
    CONFIG_FILENAME,
    GRADIENT_CLIP_ALGORITHMS,
    LOGGER_NAME,
    LOGGERS,
    STRATEGY_NAMES,
    ComponentConfig,
    RunConfig,
    StrategyConfig,
    TrainerConfig,
)

__all__ = [
    "ComponentConfig",
    "ConfigError",
    "RunConfig",
    "SaveResolvedConfig",
    "StrategyConfig",
    "TrainerConfig",
    "build_callbacks",
    "build_datamodule",
    "build_model",
    "build_strategy",
    "build_trainer",
    "config_to_yaml",
    "load_config",
]
