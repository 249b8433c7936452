"""Turning user-facing option arguments (an options object, a dict of its fields, or ``None``) into objects."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Type, TypeVar

T = TypeVar("T")


def as_options(cls: Type[T], value: Any, what: str) -> T:
    """``cls()`` for ``None``, ``value`` itself if it is a ``cls``, ``cls(**value)`` for a dict.

    Args:
        cls: an options dataclass (``GraphOptions``, ``DDPOptions``).
        value: what the user passed.
        what: the argument's name, for the message.

    Raises:
        TypeError: for any other type, or a dict with a key that is not a field (the message suggests the
            closest field and lists them all).
        ValueError: from the dataclass's own checks.
    """
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in value if k not in known]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(str(k), known, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(f"{what}: unknown key(s) {', '.join(hints)}; valid keys: {', '.join(known)}")
        return cls(**value)
    raise TypeError(f"{what} must be a {cls.__name__}, a dict of its fields or None, got {type(value).__name__}")
