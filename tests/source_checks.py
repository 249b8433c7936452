"""Checks over the package's own source: every place a finder reports, outside the one module allowed to."""

from __future__ import annotations

import pathlib
from typing import Callable, Iterable, List, Tuple

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "cg_lightning"


def offenders(find: Callable[[pathlib.Path], Iterable[Tuple[int, str]]], allowed: pathlib.Path) -> List[str]:
    """``path:line: text`` for every ``(line, text)`` that ``find(path)`` reports in a module of the package other
    than ``allowed`` (a module, or a package: every module in it)."""
    out: List[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == allowed or allowed in path.parents:
            continue
        out += [f"{path.relative_to(PACKAGE.parent)}:{line}: {text}" for line, text in find(path)]
    return out
