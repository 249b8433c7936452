"""``ConfigError``: a setting that cannot work, found before any training step runs.

Standard library only. Raised by the strategy's setup checks (:mod:`cg_lightning.trainer.setup_checks`), by the command
line (:mod:`cg_lightning.cli`) and by the example models' data checks; ``python -m cg_lightning`` prints each line
of its message as ``error: ...`` and exits with status 2.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """One or more settings that cannot work, one problem per line of the message.

    Each line starts with the key at fault, in the words of the API that raised it: ``graphs.layers: ...`` (an
    option of the strategy), ``trainer.max_steps: ...``, ``data.init_args.block_size: ...``. The command line adds
    the file (or ``command line``) each key came from. A ``ValueError``, so code that catches those keeps working.
    """
