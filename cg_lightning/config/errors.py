"""The one exception type of the configuration layer, and how messages are shortened."""

from __future__ import annotations

COMMAND_LINE = "command line"
"""The source name used for ``dotted.key=value`` overrides in messages."""


class ConfigError(ValueError):
    """A configuration problem, raised before any training step runs.

    The message names the key path (``trainer.max_steps``, ``callbacks[0].init_args``), where its value
    came from (a YAML file, ``command line``, or nothing when the schema default is at fault) and what
    was expected (a type, one of a set of values, the constructor's accepted parameters). Several
    problems found in one pass are reported together, one per line; the command line prints each line
    as ``error: ...`` and exits with status 2.
    """


def short(exc: BaseException) -> str:
    """The first line of an exception's message (OmegaConf appends multi-line context we do not want)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
