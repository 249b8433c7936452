"""The YAML runs of ``python -m cg_lightning`` shipped with the package, and where they are.

``python -m cg_lightning.examples.configs NAME`` prints the path of one, for ``--config``::

    python -m cg_lightning fit --config $(python -m cg_lightning.examples.configs gpt_tiny)

Without a name it lists them all. In Python: :func:`path` and :func:`names`.
"""

from __future__ import annotations

from importlib.resources import files
from typing import List

__all__ = ["names", "path"]

SUFFIX = ".yaml"


def names() -> List[str]:
    """The shipped configurations, by name (``"gpt_tiny"``, ...)."""
    return sorted(p.name[:-len(SUFFIX)] for p in files(__name__).iterdir() if p.name.endswith(SUFFIX))


def path(name: str) -> str:
    """The file of the shipped configuration ``name`` (``"gpt_tiny"`` or ``"gpt_tiny.yaml"``).

    Raises:
        ValueError: no shipped configuration has that name (the message lists them).
    """
    stem = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else name
    if stem not in names():
        raise ValueError(f"no shipped configuration named {name!r}; shipped: {', '.join(names())}")
    return str(files(__name__) / f"{stem}{SUFFIX}")
