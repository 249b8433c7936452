"""Which source (YAML file or command line) set which key, kept with the loaded configuration.

:func:`cg_lightning.config.load_config` records, for every key path a source sets
(``trainer.max_steps``, ``callbacks[0].init_args.tag``), the name of the last source that set it, and
attaches that map to the :class:`~cg_lightning.config.RunConfig` it returns. Errors found later (when
objects are built, or conflicting settings are checked) use it to name the file of the key at fault.
A ``RunConfig`` built in Python, not loaded, has no sources: messages then name only the key.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

_ATTRIBUTE = "_cg_config_sources"  # not a dataclass field: invisible to ==, repr and OmegaConf


def attach_sources(cfg: Any, provenance: Mapping[str, str]) -> None:
    """Remember ``provenance`` (key path -> source name) on the loaded ``cfg``."""
    object.__setattr__(cfg, _ATTRIBUTE, dict(provenance))


def config_sources(cfg: Any) -> Dict[str, str]:
    """Key path -> source name for every key a file or an override set; ``{}`` if ``cfg`` was not loaded."""
    return dict(getattr(cfg, _ATTRIBUTE, {}))


def _parent(path: str) -> Optional[str]:
    cut = max(path.rfind("."), path.rfind("["))
    return path[:cut] if cut > 0 else None


def source_of(cfg: Any, key: str) -> Optional[str]:
    """The source that set ``key``; ``None`` for a schema default.

    A default inside a list item (``callbacks[0].init_args`` of an entry that gives only ``class_path``)
    belongs to the source that wrote the item, since lists are replaced whole.
    """
    sources = getattr(cfg, _ATTRIBUTE, {})
    if key in sources:
        return sources[key]
    probe = _parent(key)
    while probe:
        if probe.endswith("]") and probe in sources:
            return sources[probe]
        probe = _parent(probe)
    return None


def from_text(cfg: Any, *keys: str) -> str:
    """`` (trainer.accelerator from a.yaml, strategy.name: schema default)`` for messages; ``""`` if unknown."""
    if not hasattr(cfg, _ATTRIBUTE):
        return ""
    parts = []
    for key in keys:
        source = source_of(cfg, key)
        parts.append(f"{key} from {source}" if source else f"{key}: schema default")
    return f" ({', '.join(parts)})"


def missing_text(path: str, provenance: Mapping[str, str], expected: str) -> str:
    """The message for a ``???`` (mandatory, unset) value at ``path``: where it should have come from and
    what it should be (``expected``, a type's name)."""
    if path in provenance:
        return f"{path}: missing value (set to '???' in {provenance[path]}); expected {expected}"
    probe = path
    while True:
        cut = max(probe.rfind("."), probe.rfind("["))
        if cut <= 0:
            break
        probe = probe[:cut]
        if probe in provenance:
            return (f"{path}: missing value ({probe} comes from {provenance[probe]}, which does not set it); "
                    f"expected {expected}")
    return (f"{path}: missing value (no default; set it in a config file or on the command line as {path}=...); "
            f"expected {expected}")
