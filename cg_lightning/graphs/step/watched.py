"""The values a replayed step relies on: read at capture, compared before every replay.

A training step that reads ``self.alpha`` or ``self.forward_kwargs`` gets the value it had when the step was
captured at every replay. :class:`StepCodeReport` (what :mod:`.step_code` found in the step's bytecode) names those
attributes; :meth:`~StepCodeReport.values` keeps their values at capture (copies of containers, which may change in
place), :meth:`~StepCodeReport.changed` says which differs now, and :meth:`~StepCodeReport.restore` puts them back
(the capture's runs of the step start from the same Python state). Immutable values and small containers of them
compare by value; tensors and modules by identity, as the graph reads their memory.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch

_IMMUTABLE = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)


def immutable(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(immutable(v) for v in value)
    return isinstance(value, _IMMUTABLE)


def comparable(value: Any, budget: int = 64) -> bool:
    """An immutable value, or a list, tuple, dict or set of at most ``budget`` such values (nested): compared by
    value before each replay."""
    if immutable(value):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return len(value) <= budget and all(comparable(v, budget // 2) for v in value)
    if isinstance(value, dict):
        return len(value) <= budget and all(comparable(k, 0) and comparable(v, budget // 2) for k, v in value.items())
    return False


def _kept(value: Any) -> Any:
    """What is kept of a watched value: a copy of a container (its contents, or those of a container inside a
    tuple, may change in place), else the value itself."""
    return copy.deepcopy(value) if isinstance(value, (list, dict, set, tuple)) and not immutable(value) else value


def _same(a: Any, b: Any) -> bool:
    if immutable(a) or comparable(a):  # by value: a kept container is a copy, a tuple may hold a changed list
        return type(a) is type(b) and a == b
    return a is b


_MISSING = object()


@dataclass
class Watch:
    """One value a captured step read: ``label`` names it (``"alpha"`` for ``self.alpha``, ``"global SCALE"``,
    ``"closure k"``); ``read()`` gives its value now; ``write(value)`` puts one back (``None``: cannot)."""

    label: str
    read: Callable[[], Any]
    write: Optional[Callable[[Any], None]] = None


def self_attribute(owner: Any, name: str, label: Optional[str] = None) -> Watch:
    """``<name>`` of ``owner`` (the step's module, or a submodule at ``label``'s path), read as Python reads it (an
    instance attribute, else the class's)."""
    def write(value: Any) -> None:
        vars(owner)[name] = value

    return Watch(label or name, lambda: getattr(owner, name, _MISSING), write if name in vars(owner) else None)


def global_value(namespace: dict, name: str) -> Watch:
    return Watch(f"global {name}", lambda: namespace.get(name, _MISSING), lambda v: namespace.__setitem__(name, v))


def closure_value(cell: Any, name: str) -> Watch:
    def write(value: Any) -> None:
        cell.cell_contents = value

    return Watch(f"closure {name}", lambda: cell.cell_contents, write)


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {tuple(value.shape)} at {value.data_ptr():#x}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class StepCodeReport:
    """What :func:`check_step_code` found.

    Attributes:
        refusal: why the step's Python cannot be frozen (the first reason found, naming the function and the
            name read), or ``None``.
        watches: the values the step reads that could change (``self``'s attributes, globals and closure variables
            holding numbers, strings, small containers of them, tensors): compare them before each replay.
        functions: qualified names of the functions read, the step method first.
    """

    refusal: Optional[str] = None
    watches: List[Watch] = field(default_factory=list)
    functions: List[str] = field(default_factory=list)

    @property
    def watched(self) -> Tuple[str, ...]:
        return tuple(w.label for w in self.watches)

    def values(self) -> Tuple[Any, ...]:
        """The watched values now (record them at capture)."""
        return tuple(_kept(w.read()) for w in self.watches)

    def restore(self, recorded: Tuple[Any, ...]) -> None:
        """Put the watched values back to ``recorded`` where they can be written (copies, so that ``recorded`` can
        be used again)."""
        for w, value in zip(self.watches, recorded):
            if w.write is not None and value is not _MISSING:
                w.write(_kept(value))

    def changed(self, recorded: Tuple[Any, ...]) -> Optional[str]:
        """The first watched value that differs from ``recorded`` (``"self.alpha: 0.5 -> 0.25"``), or ``None``.
        Immutable values and small containers compare by value, tensors and modules by identity."""
        for w, old in zip(self.watches, recorded):
            new = w.read()
            if not _same(old, new):
                label = w.label if " " in w.label else f"self.{w.label}"
                return f"{label}: {_short(old)} -> {_short(new)}"
        return None
