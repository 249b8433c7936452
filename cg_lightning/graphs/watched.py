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
from typing import Any, List, Optional, Tuple

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
    """What is kept of a watched value: a copy of a container (its contents may change in place), else itself."""
    return copy.deepcopy(value) if isinstance(value, (list, dict, set)) else value


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and comparable(a) and a == b)


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
        watched: names of ``self``'s attributes holding immutable values the step reads; compare them before each
            replay (:meth:`values`).
        functions: qualified names of the functions read, the step method first.
    """

    refusal: Optional[str] = None
    watched: Tuple[str, ...] = ()
    functions: List[str] = field(default_factory=list)

    def values(self, owner: Any) -> Tuple[Any, ...]:
        """The watched attributes' current values on ``owner`` (record them at capture)."""
        return tuple(_kept(vars(owner).get(name)) for name in self.watched)

    def restore(self, owner: Any, recorded: Tuple[Any, ...]) -> None:
        """Put the watched attributes back to ``recorded`` (copies, so that ``recorded`` can be used again)."""
        for name, value in zip(self.watched, recorded):
            vars(owner)[name] = _kept(value)

    def changed(self, owner: Any, recorded: Tuple[Any, ...]) -> Optional[str]:
        """The first watched attribute whose value differs from ``recorded`` (``"self.alpha: 0.5 -> 0.25"``), or
        ``None``. Immutable values compare by value, tensors and modules by identity."""
        for name, old in zip(self.watched, recorded):
            new = vars(owner).get(name)
            if not _same(old, new):
                return f"self.{name}: {_short(old)} -> {_short(new)}"
        return None
