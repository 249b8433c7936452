"""Checking one source (a YAML file or the overrides) against the schema, before it is merged.

OmegaConf's own errors stop at the first problem and lose the key path inside lists; this walk
collects every unknown key and every value of the wrong type, each with its full key path, the
source's name and the expected type, and records which source set which key (provenance). The wording of
types and unknown keys is shared with the Python API (:mod:`cg_lightning.option_checks`).
Package-internal: :func:`cg_lightning.config.load_config` is the public entry point.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any, Dict, List, Mapping, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from cg_lightning.option_checks import (
    field_types,
    join_key,
    mismatch_text,
    strip_optional,
    type_name,
    unknown_key_text,
)

__all__ = ["SourceChecker", "join_key", "type_at", "type_name", "unknown_key_text"]


def type_at(schema: type, path: str) -> Any:
    """The annotated type of key path ``path`` (``callbacks[0].class_path``) under ``schema``; ``Any``
    inside free-form mappings or where the path leaves the schema."""
    tp: Any = schema
    for part in re.findall(r"\[\d+\]|[^.\[\]]+", path):
        inner, _ = strip_optional(tp)
        if part.startswith("["):
            args = typing.get_args(inner) if typing.get_origin(inner) in (list, List) else ()
            tp = args[0] if args else Any
        elif dataclasses.is_dataclass(inner):
            tp = field_types(inner).get(part, Any)
        else:
            return Any
    return tp


def _list_item_dataclass(tp: Any) -> Optional[type]:
    inner, _ = strip_optional(tp)
    if typing.get_origin(inner) in (list, List):
        args = typing.get_args(inner)
        if args and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


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
            self.problem(path, mismatch_text(type_name(schema), data))
            return
        fields = field_types(schema)
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
        inner, optional = strip_optional(tp)
        if value is None and optional:
            return
        if dataclasses.is_dataclass(inner):
            self.check_node(value, inner, path)
            return
        item_schema = _list_item_dataclass(tp)
        if item_schema is not None:
            if not isinstance(value, (list, tuple)):
                self.problem(path, mismatch_text(type_name(tp), value))
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
            self.problem(path, mismatch_text(type_name(tp), value))

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
