"""Every unknown key, unimportable ``class_path`` and missing model of a configuration, reported at once.

:func:`check_keys` walks the merged sources (:mod:`cg_lightning.cli.sources`) against the schema
(:mod:`cg_lightning.cli.schema`) and returns one :class:`Problem` per fault, each naming its full key; the command
line adds the file it came from. Values themselves are left to jsonargparse, which parses next.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Tuple

from cg_lightning.option_checks import join_key

from .schema import (
    RESERVED,
    ClassPathError,
    Group,
    class_schema,
    dataclass_schema,
    kind_of,
    resolve_class,
    suggest,
    unknown_text,
)

#: where the strategy's options sit, searched for keys given in the wrong place (``graphs`` at the top level)
STRATEGY_KEY = "trainer.strategy"


@dataclass
class Problem:
    """One fault: the canonical key it is about, what is wrong, and text to print after it (a traceback)."""

    key: str
    text: str
    details: str = ""
    value: bool = False  #: a bad value (the parse can go on without it), not an unknown key or class
    cite_others: bool = False  #: name the source of the other keys the text mentions too


class KeyCheck:
    """The walk of :func:`check_keys`; ``problems`` collects what it finds."""

    def __init__(self, top: Group) -> None:
        self.top = top
        self.problems: List[Problem] = []

    def group(self, value: Any, group: Group, path: str) -> None:
        if not isinstance(value, Mapping):
            some = ", ".join(sorted(group.fields)[:4])
            self.problems.append(Problem(path, f"expected a mapping of keys ({some}, ...), got {value!r:.60}"))
            return
        for key, item in value.items():
            kpath = join_key(path, key)
            if key not in group.fields:
                self.problems.append(Problem(kpath, unknown_text(str(key), group, path, self.elsewhere(str(key), path))))
                continue
            node = group.fields[key]
            if isinstance(node, Group):
                self.group(item, node, kpath)
            else:
                self.typed(item, node, kpath)

    def typed(self, value: Any, hint: Any, path: str) -> None:
        kind, arg = kind_of(hint, value)
        if kind == "dataclass":
            before = len(self.problems)
            self.group(value, dataclass_schema(arg), path)
            if len(self.problems) == before:
                self.dataclass_values(value, arg, path)
        elif kind == "class":
            self.class_node(value, arg, path)
        elif kind == "list":
            for i, item in enumerate(value):
                self.typed(item, arg, f"{path}[{i}]")

    def dataclass_values(self, value: Mapping, cls: type, path: str) -> None:
        """The checks of an options dataclass (``GraphOptions``' ``__post_init__``), run now: jsonargparse runs
        them only when it builds the object, and then reports the union of types it tried instead."""
        hints = dataclass_schema(cls).fields
        kwargs = {k: _coerced(v, hints.get(k)) for k, v in value.items()
                  if not (isinstance(v, str) and "${" in v) and not isinstance(v, Mapping)}
        try:
            cls(**kwargs)
        except (TypeError, ValueError) as exc:
            for line in str(exc).splitlines():
                key, sep, text = line.partition(": ")
                field = key.rsplit(".", 1)[-1]
                if sep and field in hints:
                    self.problems.append(Problem(join_key(path, field), text, value=True))
                else:
                    self.problems.append(Problem(path, line, value=True))

    def class_node(self, value: Mapping, bases: Tuple[type, ...], path: str) -> None:
        class_path = value.get("class_path")
        if class_path is None:
            self.problems.append(Problem(join_key(path, "class_path"), "missing: an 'init_args' without the class it "
                                         "is for; expected the import path of a " + _kinds(bases)))
            return
        try:
            cls = resolve_class(class_path, bases)
        except ClassPathError as exc:
            self.problems.append(Problem(join_key(path, "class_path"), str(exc), exc.details))
            return
        schema = class_schema(cls, skip_first=_skips_first(bases))
        if schema is None:
            return
        for key in value:
            if key not in RESERVED:
                close = suggest(str(key), list(RESERVED[:3]))
                hint = f" (did you mean '{close}'?)" if close else ""
                self.problems.append(Problem(join_key(path, key), f"unknown key{hint}; a class is given as class_path "
                                             f"and init_args (the arguments of {class_path})"))
        init_args = value.get("init_args")
        if init_args is not None:
            self.group(init_args, schema, join_key(path, "init_args"))

    def elsewhere(self, key: str, path: str) -> List[str]:
        """Full paths where ``key`` would be known, for one given at the wrong level (``graphs`` at the top)."""
        found: List[str] = []
        self._search(self.top, "", key, found, 0)
        from cg_lightning.trainer.strategy import CUDAGraphDDPStrategy

        strategy = class_schema(CUDAGraphDDPStrategy)
        if strategy is not None:
            self._search(strategy, f"{STRATEGY_KEY}.init_args", key, found, 0)
        return [f for f in found if f != join_key(path, key)]

    def _search(self, group: Group, path: str, key: str, found: List[str], depth: int) -> None:
        for name, node in group.fields.items():
            kpath = join_key(path, name)
            if name == key:
                found.append(kpath)
            if depth >= 3:
                continue
            if isinstance(node, Group):
                self._search(node, kpath, key, found, depth + 1)
            else:
                kind, arg = kind_of(node, {})
                if kind == "dataclass":
                    self._search(dataclass_schema(arg), kpath, key, found, depth + 1)


def _coerced(value: Any, hint: Any) -> Any:
    """A string where a number is expected, read as jsonargparse reads it (``"1e-3"`` -> ``0.001``)."""
    if isinstance(value, str) and hint is not None:
        for tp in (int, float):
            if hint is tp or tp in typing.get_args(hint):
                try:
                    return tp(value)
                except ValueError:
                    continue
    return value


def _kinds(bases: Tuple[type, ...]) -> str:
    return " or ".join(b.__name__ for b in bases)


def _skips_first(bases: Tuple[type, ...]) -> bool:
    """Optimizers and LR schedulers take their first argument (parameters, optimizer) from LightningCLI."""
    import torch

    return any(issubclass(b, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)) or
               b.__name__ == "ReduceLROnPlateau" for b in bases)


def check_keys(merged: Dict[str, Any], top: Group, subcommand: str) -> List[Problem]:
    """The faults of ``merged`` (the canonical sources merged in order) against ``top``, the subcommand's keys.

    Returns:
        Unknown keys (with a close match, or the place a key belongs), ``class_path`` values that do not import or
        name a class of the wrong kind (with the user's traceback when their module raised), and a missing
        ``model`` (every subcommand needs one: without it LightningCLI would stop inside the Trainer).
    """
    check = KeyCheck(top)
    check.group(merged, top, "")
    model = merged.get("model")
    if model is None:
        check.problems.append(Problem("model", f"missing: {subcommand} needs a LightningModule; expected "
                                      "'model: {class_path: package.module.Class, init_args: {...}}' in a --config "
                                      "file (or --model=package.module.Class)"))
    return check.problems
