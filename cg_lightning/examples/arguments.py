"""Checks of the example classes' constructor arguments: every bad one refused at once, each on its own line."""

from __future__ import annotations

import math
import numbers

__all__ = ["check_arguments", "finite_at_least", "whole"]


def check_arguments(**checks: tuple) -> None:
    """Refuse constructor arguments out of range, every one at once: ``name=(value, ok, expected)``.

    Raises:
        ValueError: one ``<name>: expected <expected>, got <value>`` line per failed check.
    """
    problems = [f"{name}: expected {expected}, got {value!r}" for name, (value, ok, expected) in checks.items() if not ok]
    if problems:
        raise ValueError("\n".join(problems))


def whole(value, low: int = 1) -> bool:
    """``value`` is an integer (not a bool) ``>= low``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low


def finite_at_least(value, low: float, strict: bool = False) -> bool:
    """``value`` is a finite real number ``>= low`` (``> low`` when ``strict``)."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and (value > low if strict else value >= low))
