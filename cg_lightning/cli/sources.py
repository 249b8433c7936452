"""The sources of a run's configuration, in the order jsonargparse merges them, and which one set each key.

``fit --config a.yaml --trainer.max_steps=5 --config b.yaml`` has three sources: ``a.yaml``, the command line's
``trainer.max_steps`` and ``b.yaml``; later ones win. :func:`read_sources` reads them the way the parser will (YAML
files, ``--key=value`` / ``--key value`` overrides whose values are YAML), refusing what cannot be read with one
line per problem that names the file. :class:`Provenance` remembers the last source that set each key, so that
every later message can say where a bad value came from.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import yaml

from cg_lightning.option_checks import join_key

from . import strict_yaml

COMMAND_LINE = "command line"
SUBCOMMANDS = ("fit", "validate", "test", "predict")
#: options of the parser that are not configuration keys (values they consume, if any, are skipped)
_FLAGS = ("--print_config", "-h", "--help")


@dataclass
class Source:
    """One configuration file, or one override of the command line (``name`` is then ``command line``)."""

    name: str
    data: Dict[str, Any]
    arg_index: Optional[int] = None  #: where an override sits in the argument list


@dataclass
class Invocation:
    """What the argument list asks for, as far as the configuration is concerned."""

    subcommand: Optional[str]
    sources: List[Source] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)  #: ``"<source>: <what is wrong>"`` lines
    help: bool = False  #: ``--help`` or a ``--*.help``: nothing is checked, jsonargparse answers


def nest(dotted: str, value: Any) -> Dict[str, Any]:
    """``nest("a.b", 1) == {"a": {"b": 1}}``."""
    *parents, last = dotted.split(".")
    out: Dict[str, Any] = {last: value}
    for part in reversed(parents):
        out = {part: out}
    return out


def read_yaml_file(path: str) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """``(mapping, None)``, or ``(None, problem)`` for a file that is missing, unreadable, empty, not YAML, not a
    mapping at the top level, or refused by :func:`~cg_lightning.cli.strict_yaml.load` (one line a problem)."""
    if os.path.isdir(path):
        return None, f"{path}: is a folder, expected a YAML config file"
    if not os.path.exists(path):
        return None, f"{path}: no such config file"
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except UnicodeDecodeError:
        return None, f"{path}: not a text file (not UTF-8), expected a YAML config file"
    except OSError as exc:
        return None, f"{path}: cannot read: {exc.strerror or exc}"
    try:
        data, refused = strict_yaml.load(text, lambda mark: f"{path}:{mark.line + 1}")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        return None, f"{path}: invalid YAML{where}: {problem}"
    if refused:
        return None, "\n".join(f"{path}: {line}" for line in refused)
    if data is None:
        return None, (f"{path}: the file holds no settings; expected a mapping such as "
                      "'model: {class_path: ...}' (an empty config would start a run of defaults only)")
    if not isinstance(data, Mapping):
        return None, f"{path}: expected a mapping of keys at the top level, got {type(data).__name__} {data!r:.60}"
    return dict(data), None


def parse_value(text: str, key: str = "") -> Tuple[Any, Optional[str]]:
    """An override's value as the parser reads it: YAML where it parses, else the string itself; and what is wrong
    with a value that looks like a list or a mapping (``[1,``) but is not YAML, or that
    :func:`~cg_lightning.cli.strict_yaml.load` refuses."""
    try:
        value, refused = strict_yaml.load(text, lambda mark: f"column {mark.column + 1}", key)
    except yaml.YAMLError as exc:
        if text.lstrip().startswith(("[", "{")):
            return text, f"not a valid YAML value ({' '.join(str(getattr(exc, 'problem', None) or exc).split())})"
        return text, None
    return (text, "; ".join(refused)) if refused else (value, None)


def read_sources(args: Sequence[str], expect_subcommand: bool = True) -> Invocation:
    """Sort the argument list of ``python -m cg_lightning`` into its sources (see the module docstring).

    Args:
        args: the arguments after the program's name.
        expect_subcommand: whether they start with one of :data:`SUBCOMMANDS` (``LightningCLI(run=False)`` has none).

    Problems found here: config files that cannot be read, options without a value or without a key (``--=5``),
    and ``key=value`` words without the leading ``--`` (the form of overrides is ``--trainer.max_steps=5``).
    """
    args = list(args)
    sub_at = next((i for i, a in enumerate(args) if a in SUBCOMMANDS), None) if expect_subcommand else -1
    inv = Invocation(args[sub_at] if sub_at is not None and sub_at >= 0 else None)
    if any(a in ("-h", "--help") or (a.startswith("--") and a.split("=")[0].endswith(".help")) for a in args):
        inv.help = True
        return inv
    if sub_at is None:
        return inv
    i = sub_at + 1
    while i < len(args):
        arg = args[i]
        if arg in ("-c", "--config") or arg.startswith("--config="):
            if "=" in arg:
                path = arg.split("=", 1)[1]
            elif i + 1 < len(args):
                i += 1
                path = args[i]
            else:
                inv.problems.append(f"{COMMAND_LINE}: {arg} needs a file name")
                break
            data, problem = read_yaml_file(path)
            if problem:
                inv.problems.append(problem)
            else:
                inv.sources.append(Source(path, data))
        elif arg.startswith("--") and arg.split("=")[0] in _FLAGS:
            pass
        elif arg.startswith("--"):
            key, eq, value = arg[2:].partition("=")
            name = key[:-1] if key.endswith("+") else key  # --trainer.callbacks+=...: appends to the list
            if "" in name.split("."):
                what = f"the key {name!r} has an empty part" if name else "names no key"
                inv.problems.append(f"{COMMAND_LINE}: {arg!r}: {what}; overrides are written --KEY=VALUE "
                                    "(--trainer.max_steps=5)")
                i += 1
                continue
            if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
                i += 1
                value = args[i]
            elif not eq:
                inv.problems.append(f"{COMMAND_LINE}: {arg} has no value; expected {arg}=VALUE")
                i += 1
                continue
            parsed, broken = parse_value(value, name)
            if broken:
                inv.problems.append(f"{COMMAND_LINE}: --{key}={value}: {broken}")
            elif key and not key.endswith("+"):
                inv.sources.append(Source(COMMAND_LINE, nest(key, parsed), i))
        elif "=" in arg and not arg.startswith("-"):
            inv.problems.append(f"{COMMAND_LINE}: {arg!r} is not an option; overrides are written --{arg}")
        i += 1
    return inv


class Provenance:
    """The last source that set each key (canonical key paths: ``model.init_args.n_layer``, ``trainer.callbacks[0]``).

    A key that no source set is a default, unless an ancestor was given whole (a list replaces the previous one,
    ``--model=ClassName`` a whole class node): its defaults belong to that source.
    """

    def __init__(self) -> None:
        self.exact: Dict[str, str] = {}
        self.whole: Dict[str, str] = {}
        self.sections: Dict[str, str] = {}  #: mappings: the last source that wrote the section itself
        self._parents: Set[str] = set()  #: the keys some key of ``exact`` is below (its stale keys, if replaced)

    def record(self, data: Any, source: str, path: str = "") -> None:
        if isinstance(data, Mapping):
            if path:
                self.sections[path] = source
                self.exact.pop(path, None)  # a value an earlier source gave here is replaced
            for key, value in data.items():
                self.record(value, source, join_key(path, key))
            return
        if path in self._parents:  # a value replacing a section or list of an earlier source: forget what was below
            for stale in [k for k in self.exact if k.startswith(path + ".") or k.startswith(path + "[")]:
                del self.exact[stale]
        self.exact[path] = self.whole[path] = source
        self._parents.update(path[:i] for i, c in enumerate(path) if c in ".[" and i)
        if isinstance(data, list):
            for i, item in enumerate(data):
                self.record(item, source, f"{path}[{i}]")
                self.whole[f"{path}[{i}]"] = source

    def source_of(self, key: str) -> Optional[str]:
        """The source that set ``key`` (or gave it whole with an ancestor); ``None`` for a default."""
        if key in self.exact:
            return self.exact[key]
        probe = key
        while True:
            cut = max(probe.rfind("."), probe.rfind("["))
            if cut <= 0:
                return self.sections.get(key)
            probe = probe[:cut]
            if probe in self.whole:
                return self.whole[probe]


_ABSOLUTE = re.compile(r"\$\{([A-Za-z_][\w.\[\]]*)\}")


def relative_interpolations(value: str, key: str) -> str:
    """``${model.init_args.block_size}`` given on the command line for ``data.init_args.block_size`` ->
    ``${...model.init_args.block_size}``: the parser resolves interpolations inside the subcommand's section, where
    only relative ones (one dot per level up from the key) find their target."""
    depth = len(key.split("."))
    return _ABSOLUTE.sub(lambda m: "${" + "." * depth + m.group(1) + "}", value)


def merge(base: Dict[str, Any], update: Mapping[str, Any]) -> Dict[str, Any]:
    """``update`` on top of ``base``: mappings merge key by key, anything else replaces; a class node whose
    ``class_path`` changes drops the ``init_args`` given for the previous class."""
    out = dict(base)
    for key, value in update.items():
        old = out.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            if "class_path" in value and old.get("class_path") not in (None, value["class_path"]):
                old = {k: v for k, v in old.items() if k not in ("init_args", "dict_kwargs")}
            out[key] = merge(dict(old), value)
        else:
            out[key] = value
    return out


def leaf_key(data: Mapping[str, Any]) -> str:
    """The dotted key of a one-leaf nested mapping (an override's data): ``{"a": {"b": 1}}`` -> ``"a.b"``."""
    parts: List[str] = []
    node: Any = data
    while isinstance(node, Mapping) and len(node) == 1:
        key, node = next(iter(node.items()))
        parts.append(str(key))
    return ".".join(parts)
