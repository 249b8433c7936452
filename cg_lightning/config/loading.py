"""Loading a :class:`~cg_lightning.config.RunConfig`: read, check, merge, resolve, validate.

Each source (a YAML file, then the overrides) is checked against the schema before it is merged
(:mod:`cg_lightning.config.validation`), so that every problem is reported with its source and full
key path; then mandatory values, interpolations and each dataclass's ``__post_init__`` validation, and
last the settings that contradict each other (:mod:`cg_lightning.config.conflicts`). Every rejected value is
reported, not only the first (:func:`_to_object_reporting_all`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .conflicts import check_settings
from .errors import COMMAND_LINE, ConfigError, short
from .provenance import attach_sources, missing_text
from .schema import RunConfig
from .validation import SourceChecker, join_key, type_at, type_name


def _read_yaml(path: str) -> Any:
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such config file")
    try:
        loaded = OmegaConf.load(path)
    except (OSError, OmegaConfBaseException) as exc:
        raise ConfigError(f"{path}: cannot read: {short(exc)}") from exc
    except Exception as exc:  # yaml.YAMLError and friends: keep the line/column information
        text = " ".join(str(exc).split())
        raise ConfigError(f"{path}: invalid YAML: {text}") from exc
    return loaded


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(
            "\n".join(f"{COMMAND_LINE}: override {o!r} is not of the form dotted.key=value" for o in bad)
        )
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{COMMAND_LINE}: cannot parse overrides {list(overrides)}: {short(exc)}") from exc


def _merge_source(cfg: DictConfig, data: Any, source: str, provenance: Dict[str, str]) -> DictConfig:
    if isinstance(data, ListConfig) or not isinstance(data, (DictConfig, Mapping)):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    raw = OmegaConf.to_container(data, resolve=False) if isinstance(data, DictConfig) else dict(data)
    checker = SourceChecker(source, provenance)
    checker.check_node(raw, RunConfig, "")
    if checker.problems:
        raise ConfigError("\n".join(checker.problems))
    try:
        return OmegaConf.merge(cfg, data)
    except OmegaConfBaseException as exc:  # anything the walk above did not foresee
        key = getattr(exc, "full_key", None) or "<top level>"
        raise ConfigError(f"{source}: {key}: {short(exc)}") from exc


def _dataclass_field_in(message: str, schema: type) -> Optional[str]:
    """The field of ``schema`` mentioned first in a ``__post_init__`` message, if any."""
    best: Optional[tuple[int, str]] = None
    for f in dataclasses.fields(schema):
        m = re.search(rf"(?<![\w]){re.escape(f.name)}(?![\w])", message)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), f.name)
    return best[1] if best else None


class _Located(Exception):
    def __init__(self, path: str, exc: BaseException) -> None:
        super().__init__(path)
        self.path = path
        self.exc = exc


def _to_object_located(node: Union[DictConfig, ListConfig], path: str) -> Any:
    """``OmegaConf.to_object`` that, on failure, finds the deepest node (and field) responsible."""
    try:
        return OmegaConf.to_object(node)
    except Exception as exc:
        keys: Iterable[Any] = list(node.keys()) if isinstance(node, DictConfig) else range(len(node))
        for key in keys:
            child_path = f"{path}[{key}]" if isinstance(node, ListConfig) else join_key(path, key)
            try:
                child = node[key]
            except Exception as child_exc:  # a leaf whose interpolation does not resolve
                raise _Located(child_path, child_exc) from child_exc
            if OmegaConf.is_config(child):
                try:
                    OmegaConf.to_object(child)
                except Exception:
                    _to_object_located(child, child_path)  # raises _Located
        schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        where = path
        if isinstance(exc, OmegaConfBaseException) and getattr(exc, "key", None) is not None:
            where = join_key(path, exc.key)
        elif schema is not None and dataclasses.is_dataclass(schema):
            name = _dataclass_field_in(str(exc), schema)
            if name is not None:
                where = join_key(path, name)
        raise _Located(where, exc) from exc


def _to_object_reporting_all(cfg: DictConfig, provenance: Dict[str, str], limit: int = 50) -> Any:
    """Build the config objects; on rejected values report every one, not only the first.

    The options' ``__post_init__`` checks stop at their first problem. So after each located problem the
    offending field is set back to its schema default and the build is tried again, until it succeeds
    or the problem cannot be pinned to a field; then all problems found are raised together.
    """
    problems: List[str] = []
    first: Optional[BaseException] = None
    work = copy.deepcopy(cfg)  # defaults are written into this one only
    for _ in range(limit):
        try:
            result = _to_object_located(work, "")
        except _Located as located:
            source = provenance.get(located.path)
            prefix = f"{source}: " if source else ""
            text = _without_key_prefix(short(located.exc), located.path)
            problems.append(f"{prefix}{located.path or '<top level>'}: {text}")
            first = first or located.exc
            if not _reset_to_default(work, located.path):
                break
            continue
        if not problems:
            return result
        break
    raise ConfigError("\n".join(problems)) from first


def _reset_to_default(cfg: DictConfig, path: str) -> bool:
    """Set the dataclass field at ``path`` back to its schema default; False when ``path`` is not one."""
    if not path or "[" in path:
        return False
    parent_path, _, name = path.rpartition(".")
    try:
        parent = OmegaConf.select(cfg, parent_path, throw_on_resolution_failure=False) if parent_path else cfg
    except Exception:
        return False
    schema = OmegaConf.get_type(parent) if isinstance(parent, DictConfig) else None
    if schema is None or not dataclasses.is_dataclass(schema):
        return False
    fields = {f.name: f for f in dataclasses.fields(schema)}
    f = fields.get(name)
    if f is None:
        return False
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        default = f.default_factory()  # type: ignore[misc]
    else:
        return False
    try:
        parent[name] = default
    except Exception:
        return False
    return True


def _missing_keys(data: Any, path: str) -> List[str]:
    """Key paths of ``???`` values, without resolving interpolations (``OmegaConf.missing_keys`` does)."""
    if isinstance(data, Mapping):
        return [k for key, value in data.items() for k in _missing_keys(value, join_key(path, key))]
    if isinstance(data, list):
        return [k for i, value in enumerate(data) for k in _missing_keys(value, f"{path}[{i}]")]
    return [path] if data == "???" else []


def _without_key_prefix(message: str, path: str) -> str:
    """``"graphs.backend: expected ..."`` at ``strategy.graphs.backend`` -> ``"expected ..."`` (and
    ``"name must be ..."`` at ``strategy.name`` -> ``"must be ..."``)."""
    parts = path.split(".")
    for i in range(len(parts)):
        prefix = ".".join(parts[i:])
        for sep in (": ", " "):
            if prefix and message.startswith(prefix + sep):
                return message[len(prefix) + len(sep) :]
    return message


def load_config(config_files: Sequence[Union[str, os.PathLike]] = (), overrides: Sequence[str] = ()) -> RunConfig:
    """Resolve a :class:`RunConfig` from YAML files and command-line overrides.

    Sources are merged in order on top of the schema's defaults: each file of ``config_files``, then
    ``overrides`` (``"dotted.key=value"``, value parsed as YAML). Later sources win; mappings merge
    key by key (so ``init_args`` given by an earlier source stay, even when a later one changes
    ``class_path``; the constructor check in :func:`~cg_lightning.config.build_model` reports any that
    no longer fit), and lists (``callbacks``) are replaced whole. Interpolations such as
    ``${model.init_args.block_size}`` are resolved at the end, every dataclass's ``__post_init__``
    validation runs, and settings that cannot work together are refused
    (:func:`~cg_lightning.config.conflicts.check_settings`). The returned object remembers which
    source set each key (:func:`~cg_lightning.config.provenance.config_sources`), so later errors can
    name the file.

    Raises:
        ConfigError: naming the source (file or ``command line``), the full key path and what was
            expected, for: unreadable files, unknown keys (with the valid keys and a suggestion),
            values of the wrong type, missing mandatory values (all of them), unresolvable
            interpolations, values rejected by the options' validation and conflicting settings.
    """
    cfg = OmegaConf.structured(RunConfig)
    provenance: Dict[str, str] = {}
    for path in config_files:
        source = os.fspath(path)
        cfg = _merge_source(cfg, _read_yaml(source), source, provenance)
    if overrides:
        cfg = _merge_source(cfg, _parse_overrides(overrides), COMMAND_LINE, provenance)

    missing = _missing_keys(OmegaConf.to_container(cfg, resolve=False), "")
    if missing:
        raise ConfigError(
            "\n".join(missing_text(key, provenance, type_name(type_at(RunConfig, key))) for key in missing)
        )

    result = _to_object_reporting_all(cfg, provenance)
    assert isinstance(result, RunConfig)
    attach_sources(result, provenance)
    check_settings(result)
    return result


def _as_run_config(cfg: Union[RunConfig, DictConfig]) -> RunConfig:
    """``cfg`` itself, or the :class:`RunConfig` an OmegaConf node of one stands for.

    Raises:
        TypeError: ``cfg`` is neither.
    """
    if isinstance(cfg, RunConfig):
        return cfg
    if isinstance(cfg, DictConfig):
        obj = OmegaConf.to_object(cfg)
        if isinstance(obj, RunConfig):
            return obj
    raise TypeError(f"expected a RunConfig (from load_config), got {type(cfg).__name__}")


def config_to_yaml(cfg: RunConfig) -> str:
    """The resolved configuration as YAML; loading it back with :func:`load_config` gives ``cfg``."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
