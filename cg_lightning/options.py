"""Turning user-facing option arguments (an options object, a dict of its fields, or ``None``) into objects."""

from __future__ import annotations

from typing import Any, Type, TypeVar

T = TypeVar("T")


def as_options(cls: Type[T], value: Any, what: str) -> T:
    """``cls()`` for ``None``, ``value`` itself if it is a ``cls``, ``cls(**value)`` for a dict.

    Args:
        cls: an options dataclass (``GraphOptions``, ``DDPOptions``).
        value: what the user passed.
        what: the argument's name, for the message.

    Raises:
        TypeError: for any other type; also from ``cls(**value)`` on an unknown field.
        ValueError: from the dataclass's own checks.
    """
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return cls(**value)
    raise TypeError(f"{what} must be a {cls.__name__}, a dict of its fields or None, got {type(value).__name__}")
