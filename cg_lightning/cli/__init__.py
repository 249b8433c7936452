"""The command line: ``python -m cg_lightning fit|validate|test|predict --config A.yaml [--key=value ...]``.

:class:`CGLightningCLI` is Lightning's ``LightningCLI`` (jsonargparse, OmegaConf interpolation) with messages that
name the key at fault and the file it came from; :func:`main` runs it and turns a configuration error into
``error:`` lines and exit status 2, before any training step, and the package's own errors of a run (a layer that
cannot be captured, gradients that do not sync) into ``error:`` lines and exit status 1. One concept a module:

* :mod:`~cg_lightning.cli.app`: the ``LightningCLI`` subclass and :func:`main`;
* :mod:`~cg_lightning.cli.sources`: the config files and overrides of the argument list, and which set each key;
* :mod:`~cg_lightning.cli.strict_yaml`: YAML that PyYAML would read but must not be (duplicate keys, alias bombs,
  deep nesting);
* :mod:`~cg_lightning.cli.schema`: which keys exist where (parser arguments, constructors, option dataclasses);
* :mod:`~cg_lightning.cli.keys`: unknown keys, class paths that do not import, a missing model, all at once;
* :mod:`~cg_lightning.cli.messages`: jsonargparse's errors as ``<source>: <key>: <what is wrong>`` lines;
* :mod:`~cg_lightning.cli.diagnosis`: every value the parser rejects, not only the first;
* :mod:`~cg_lightning.cli.values`: numbers out of range, folders that cannot be written;
* :mod:`~cg_lightning.cli.refusals`: constructors, the Trainer, checkpoints and the run refusing before training.
"""

from cg_lightning.errors import ConfigError

from .app import CGLightningCLI, main, report

__all__ = ["CGLightningCLI", "ConfigError", "main", "report"]
