"""Checking option values against their dataclass fields, worded the same for the Python API and for YAML.

A field's annotation gives its type (``bool``, ``int``, ``float``, ``str``, ``Literal[...]``, ``List[...]``, a
mapping, ``Optional``/``Union`` of these); its ``metadata`` may add a constraint made by :func:`one_of`,
:func:`at_least`, :func:`above` or :func:`at_most` (a number with a bound must be finite). :func:`check_options`
checks every field of an options dataclass (the ``__post_init__`` of :class:`~cg_lightning.graphs.GraphOptions`
and :class:`~cg_lightning.ddp.DDPOptions` calls it, so ``GraphOptions(...)``, option dicts and YAML files all pass
through it: the command line builds the options from YAML before its parser would, :mod:`cg_lightning.cli.keys`).
:func:`type_name`, :func:`expected_type`, :func:`mismatch_text` and :func:`unknown_key_text` word the other checks
of option values the same way. Every message reads ``<key>: expected <what is accepted>, got <value>``.

Standard library only, so the engine packages (``graphs/``, ``ddp/``) may import it, as they import
:mod:`cg_lightning.protocol`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import typing
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union


def join_key(path: str, key: Any) -> str:
    """``join_key("trainer", "max_steps") == "trainer.max_steps"``; the top level has path ``""``."""
    return str(key) if not path else f"{path}.{key}"


def field_types(schema: type) -> Dict[str, Any]:
    """Field name -> resolved annotation of dataclass ``schema``, in declaration order."""
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) is Union or type(tp).__name__ == "UnionType"  # Optional[X] or X | None


def strip_optional(tp: Any) -> Tuple[Any, bool]:
    """``(X, True)`` for ``Optional[X]``, else ``(tp, False)``."""
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def type_name(tp: Any) -> str:
    """How an accepted type reads in a message: ``int or null``, ``list of str``, ``one of ('a', 'b')``."""
    inner, optional = strip_optional(tp)
    if optional:
        return f"{type_name(inner)} or null"
    if _is_union(inner):
        return " or ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(inner))
    if inner is Any:
        return "any value"
    if dataclasses.is_dataclass(inner):
        return f"a mapping ({inner.__name__})"
    origin = typing.get_origin(inner)
    if origin is typing.Literal:
        return f"one of {typing.get_args(inner)}"
    if origin in (list, List, tuple) or inner in (list, tuple):
        args = typing.get_args(inner)
        if args and dataclasses.is_dataclass(args[0]):
            return f"list of mappings ({args[0].__name__})"
        return f"list of {type_name(args[0])}" if args else "list"
    if origin in (dict, Dict) or inner is dict:
        return "a mapping"
    return getattr(inner, "__name__", str(inner))


def expected_type(tp: Any, value: Any) -> Optional[str]:
    """``None`` when ``value`` fits the annotation ``tp`` (or ``tp`` is richer than this check knows: the
    receiver judges it), else :func:`type_name` of ``tp``. ``bool`` is not an ``int`` here; an ``int`` is a
    ``float``; a tuple is a list."""
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    elif tp is str:
        ok = isinstance(value, str)
    elif _is_union(tp):
        ok = any(value is None if a is type(None) else expected_type(a, value) is None for a in typing.get_args(tp))
    elif typing.get_origin(tp) is typing.Literal:
        ok = value in typing.get_args(tp)
    elif typing.get_origin(tp) in (list, List) or tp is list:
        args = typing.get_args(tp)
        ok = isinstance(value, (list, tuple)) and not (args and any(expected_type(args[0], v) for v in value))
    elif typing.get_origin(tp) in (dict, Dict) or tp is dict:
        ok = isinstance(value, Mapping)
    elif dataclasses.is_dataclass(tp):
        ok = isinstance(value, (tp, Mapping))
    else:
        return None
    return None if ok else type_name(tp)


def mismatch_text(expected: str, value: Any) -> str:
    """``expected int, got 'two'``; a string where a list is expected gets the list written out (``list("a.*")``
    would be one item per character)."""
    text = f"expected {expected}, got {value!r}"
    if isinstance(value, str) and expected.startswith("list"):
        text += f" (a single item is written as a list: [{value!r}])"
    return text


def one_of(choices: Iterable[Any]) -> Dict[str, Any]:
    """Field metadata: the value must be one of ``choices``."""
    return {"one_of": tuple(choices)}


def at_least(bound: float) -> Dict[str, Any]:
    """Field metadata: the value must be ``>= bound``."""
    return {"at_least": bound}


def above(bound: float) -> Dict[str, Any]:
    """Field metadata: the value must be ``> bound``."""
    return {"above": bound}


def at_most(bound: float) -> Dict[str, Any]:
    """Field metadata: the value must be ``<= bound`` (combine with another: ``{**above(0), **at_most(8)}``)."""
    return {"at_most": bound}


def _constraint_problem(tp: Any, metadata: Mapping[str, Any], value: Any) -> Optional[str]:
    if "one_of" in metadata and value not in metadata["one_of"]:
        return f"one of {metadata['one_of']}"
    if value is None or isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    bounds = []
    if "at_least" in metadata:
        bounds.append((f">= {metadata['at_least']}", value >= metadata["at_least"]))
    if "above" in metadata:
        bounds.append((f"> {metadata['above']}", value > metadata["above"]))
    if "at_most" in metadata:
        bounds.append((f"<= {metadata['at_most']}", value <= metadata["at_most"]))
    finite = math.isfinite(value)
    if finite and all(ok for _, ok in bounds):
        return None
    name = type_name(strip_optional(tp)[0])
    return f"{'' if finite or not bounds else 'finite '}{name} {' and '.join(text for text, _ in bounds)}".strip() \
        if bounds else f"finite {name}"


def check_options(options: Any, section: str) -> None:
    """Check every field of the dataclass instance ``options`` against its annotation and constraint.

    Args:
        options: an options dataclass instance (``GraphOptions``, ``DDPOptions``).
        section: its key in messages (``"graphs"``): a problem reads ``graphs.warmup_steps: expected int,
            got 'two'``.

    Raises:
        TypeError: a value of the wrong type (every problem found, one per line).
        ValueError: a value of the right type but out of range or not one of the choices.
    """
    problems: List[str] = []
    wrong_type = False
    types = field_types(type(options))
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        expected = expected_type(types[f.name], value)
        wrong_type = wrong_type or expected is not None
        if expected is None:
            expected = _constraint_problem(types[f.name], f.metadata, value)
        if expected is None:
            continue
        problems.append(f"{join_key(section, f.name)}: {mismatch_text(expected, value)}")
    if problems:
        raise (TypeError if wrong_type else ValueError)("\n".join(problems))


def unknown_key_text(key: Any, parent_path: str, valid: List[str]) -> str:
    """``unknown key (did you mean 'max_steps'?); valid keys under 'trainer': ...``."""
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    where = f"under '{parent_path}'" if parent_path else "at the top level"
    return f"unknown key{hint}; valid keys {where}: {', '.join(valid)}"
