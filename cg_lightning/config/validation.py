"""Checking one source (a YAML file or the overrides) against the schema, before it is merged.

OmegaConf's own errors stop at the first problem and lose the key path inside lists; this walk
collects every unknown key and every value of the wrong type, each with its full key path, the
source's name and the expected type, and records which source set which key (provenance).
Package-internal: :func:`cg_lightning.config.load_config` is the public entry point.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from typing import Any, Dict, List, Mapping, Optional, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


def join_key(path: str, key: Any) -> str:
    """``join_key("trainer", "max_steps") == "trainer.max_steps"``; the top level has path ``""``."""
    return str(key) if not path else f"{path}.{key}"


def _hints(schema: type) -> Dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def type_name(tp: Any) -> str:
    """How an expected type reads in a message: ``int or null``, ``list of str``, ``a mapping (X)``."""
    inner, optional = _strip_optional(tp)
    if optional:
        return f"{type_name(inner)} or null"
    if inner is Any:
        return "any value"
    if dataclasses.is_dataclass(inner):
        return f"a mapping ({inner.__name__})"
    origin = typing.get_origin(inner)
    if origin in (list, List, tuple):
        args = typing.get_args(inner)
        if args and dataclasses.is_dataclass(args[0]):
            return f"list of mappings ({args[0].__name__})"
        return f"list of {type_name(args[0])}" if args else "list"
    if origin in (dict, Dict):
        return "a mapping"
    return getattr(inner, "__name__", str(inner))


def type_at(schema: type, path: str) -> Any:
    """The annotated type of key path ``path`` (``callbacks[0].class_path``) under ``schema``; ``Any``
    inside free-form mappings or where the path leaves the schema."""
    tp: Any = schema
    for part in re.findall(r"\[\d+\]|[^.\[\]]+", path):
        inner, _ = _strip_optional(tp)
        if part.startswith("["):
            args = typing.get_args(inner) if typing.get_origin(inner) in (list, List) else ()
            tp = args[0] if args else Any
        elif dataclasses.is_dataclass(inner):
            tp = _hints(inner).get(part, Any)
        else:
            return Any
    return tp


def _list_item_dataclass(tp: Any) -> Optional[type]:
    inner, _ = _strip_optional(tp)
    if typing.get_origin(inner) in (list, List):
        args = typing.get_args(inner)
        if args and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _nested_paths(key: str, schema: Any, depth: int = 2) -> List[str]:
    """Paths (relative to ``schema``) of the sections below it that have a field named ``key``:
    ``['strategy.graphs']`` for ``graphs`` at the top level."""
    found: List[str] = []
    if depth == 0 or not dataclasses.is_dataclass(schema):
        return found
    for name, tp in _hints(schema).items():
        inner, _ = _strip_optional(tp)
        if dataclasses.is_dataclass(inner):
            if key in _hints(inner):
                found.append(f"{name}.{key}")
            found.extend(f"{name}.{p}" for p in _nested_paths(key, inner, depth - 1))
    return found


def unknown_key_text(key: Any, parent_path: str, valid: List[str], schema: Any = None) -> str:
    """``unknown key (did you mean 'max_steps'?); valid keys under 'trainer': ...``; a key that exists one
    or two sections further down (``graphs`` at the top level) is pointed there (``'strategy.graphs'``)."""
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    nested = [] if close or schema is None else _nested_paths(str(key), schema)
    if nested:
        close = [" or ".join(f"'{join_key(parent_path, p)}'" for p in nested[:3])]
    elif close:
        close = [f"'{close[0]}'"]
    hint = f" (did you mean {close[0]}?)" if close else ""
    where = f"under '{parent_path}'" if parent_path else "at the top level"
    return f"unknown key{hint}; valid keys {where}: {', '.join(valid)}"


class SourceChecker:
    """Walks one source against the schema, collecting problems and provenance.

    Args:
        source: the source's name in messages (a file path or ``command line``).
        provenance: key path -> source name; updated in place with every key this source sets.

    Attributes:
        problems: one ``"<source>: <key path>: <what is wrong>"`` line per problem found.
    """

    def __init__(self, source: str, provenance: Dict[str, str]) -> None:
        self.source = source
        self.provenance = provenance
        self.problems: List[str] = []
        self._probes: Dict[type, DictConfig] = {}

    def problem(self, path: str, text: str) -> None:
        self.problems.append(f"{self.source}: {path or '<top level>'}: {text}")

    def check_node(self, data: Any, schema: type, path: str) -> None:
        """Check a mapping ``data`` against the dataclass ``schema`` found at key path ``path``."""
        if not isinstance(data, Mapping):
            self.problem(path, f"expected {type_name(schema)}, got {data!r}")
            return
        fields = _hints(schema)
        for key, value in data.items():
            kpath = join_key(path, key)
            if key not in fields:
                self.problem(kpath, unknown_key_text(key, path, list(fields), schema))
                continue
            self._record(value, kpath)
            self.check_value(value, fields[key], schema, key, kpath)

    def check_value(self, value: Any, tp: Any, parent: type, key: str, path: str) -> None:
        """Check one value of field ``key`` (annotated ``tp``) of dataclass ``parent``."""
        if value == "???" or _is_interpolation(value):
            return  # missing marker / resolved later: reported by the missing-key or resolve step
        inner, optional = _strip_optional(tp)
        if value is None and optional:
            return
        if dataclasses.is_dataclass(inner):
            self.check_node(value, inner, path)
            return
        item_schema = _list_item_dataclass(tp)
        if item_schema is not None:
            if not isinstance(value, (list, tuple)):
                self.problem(path, f"expected {type_name(tp)}, got {value!r}")
                return
            for i, item in enumerate(value):
                if not (item == "???" or _is_interpolation(item)):
                    self.check_node(item, item_schema, f"{path}[{i}]")
            return
        probe = self._probes.get(parent)
        if probe is None:
            probe = self._probes[parent] = OmegaConf.structured(parent)
        try:
            OmegaConf.merge(probe, {key: value})
        except OmegaConfBaseException:
            self.problem(path, f"expected {type_name(tp)}, got {value!r}")

    def _record(self, value: Any, path: str) -> None:
        self.provenance[path] = self.source
        if isinstance(value, (list, tuple)):  # a list replaces the previous one whole: forget its items
            for stale in [k for k in self.provenance if k.startswith(path + "[")]:
                del self.provenance[stale]
        if isinstance(value, Mapping):
            for k, v in value.items():
                self._record(v, join_key(path, k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                self._record(v, f"{path}[{i}]")
