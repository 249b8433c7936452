"""Which keys a configuration may hold where, read from the command line's parser and from the classes it names.

jsonargparse knows every key, but reports an unknown one without the file it came from, without a close match,
and in some places only as ``unrecognized arguments: fit``. So before it parses, every source is walked against
the same knowledge (:func:`check_keys`): the subcommand parser's arguments (``trainer.*``, ``model``, ``data``,
``ckpt_path``, ...), the constructor parameters of each ``class_path`` (as jsonargparse resolves them, ``**kwargs``
included) and the fields of option dataclasses (``graphs``, ``ddp``). Every unknown key, class path that does not
import and class of the wrong kind is reported at once.

A node of the schema is a :class:`Group` (named fields: the top level, ``trainer``, a class's ``init_args``, a
dataclass) or a type hint, whose meaning depends on the value found there (:func:`kind_of`).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import importlib
import inspect
import traceback
import typing
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union


#: keys of a ``class_path`` node besides the constructor's arguments (jsonargparse's ``dict_kwargs`` takes
#: arguments a ``**kwargs`` passes on where they cannot be resolved; ``__path__`` is its own bookkeeping)
RESERVED = ("class_path", "init_args", "dict_kwargs", "__path__")
#: parser arguments that are not configuration keys
NOT_KEYS = ("help", "config", "print_config")


@dataclasses.dataclass
class Group:
    """Named fields, each a :class:`Group` or a type hint (``Any`` where nothing is known)."""

    fields: Dict[str, Any]
    what: str = ""  #: how the group reads in messages, e.g. ``"cg_lightning.examples.gpt.GPTLightningModule"``


def _members(hint: Any) -> List[Any]:
    origin = typing.get_origin(hint)
    if origin is Union or type(hint).__name__ == "UnionType":
        return [m for a in typing.get_args(hint) for m in _members(a)]
    return [hint]


def _is_class_type(tp: Any) -> bool:
    """A class whose values are given as ``class_path`` + ``init_args`` (not a builtin, a dataclass or a mapping)."""
    return (inspect.isclass(tp) and not dataclasses.is_dataclass(tp) and tp.__module__ != "builtins"
            and not issubclass(tp, (Mapping, str, bytes)) and tp.__module__.split(".")[0] not in ("typing", "pathlib",
                                                                                                   "datetime"))


def kind_of(hint: Any, value: Any) -> Tuple[str, Any]:
    """How ``value`` found where ``hint`` is expected is checked.

    Returns:
        ``("dataclass", cls)`` (a mapping of its fields), ``("class", bases)`` (a ``class_path`` node; ``bases`` the
        accepted base classes), ``("list", item_hint)`` or ``("leaf", None)`` (left to jsonargparse).
    """
    members = _members(hint)
    if isinstance(value, Mapping):
        classes = tuple(m for m in members if _is_class_type(m))
        if classes and ("class_path" in value or "init_args" in value):
            return "class", classes
        for m in members:
            if dataclasses.is_dataclass(m):
                return "dataclass", m
        if classes and not any(typing.get_origin(m) in (dict, Mapping) or m in (dict, Any) for m in members):
            return "class", classes
    if isinstance(value, list):
        for m in members:
            if typing.get_origin(m) in (list, tuple, collections.abc.Iterable, collections.abc.Sequence):
                args = typing.get_args(m)
                return "list", args[0] if args else Any
    return "leaf", None


def _tree(actions: Iterable[Any], prefix: str = "") -> Dict[str, Any]:
    """Nested fields from a parser's arguments (``trainer.max_steps`` -> ``{"trainer": Group({"max_steps": int})}``),
    under ``prefix`` when given; help, config and group-loading arguments are no keys."""
    tree: Dict[str, Any] = {}
    for action in actions:
        dest = getattr(action, "dest", "") or ""
        if type(action).__name__ in ("_HelpAction", "_ActionHelpClassPath", "_ActionConfigLoad", "_ActionPrintConfig"):
            continue
        if not dest or dest in NOT_KEYS or dest.endswith(".help") or dest.startswith("=="):
            continue
        if prefix:
            if not dest.startswith(prefix + "."):
                continue
            dest = dest[len(prefix) + 1:]
        *parents, name = dest.split(".")
        fields = tree
        for part in parents:
            group = fields.get(part)
            if not isinstance(group, Group):
                group = fields[part] = Group({})
            fields = group.fields
        fields[name] = getattr(action, "_typehint", Any)
    return tree


def parser_schema(parser: Any) -> Group:
    """The keys of a (subcommand) parser: ``seed_everything``, ``trainer`` (a group), ``model``, ``ckpt_path``..."""
    return Group(_tree(parser._actions), "the configuration")


@functools.lru_cache(maxsize=None)
def class_schema(cls: type, skip_first: bool = False) -> Optional[Group]:
    """The constructor arguments of ``cls`` as jsonargparse resolves them; ``None`` when it cannot tell."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    try:
        parser.add_class_arguments(cls, "x", fail_untyped=False, skip={1} if skip_first else None)
    except Exception:
        return None
    return Group(_tree(parser._actions, "x"), f"{cls.__module__}.{cls.__qualname__}")


def dataclass_schema(cls: type) -> Group:
    hints = typing.get_type_hints(cls)
    return Group({f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}, cls.__name__)


def _subclasses(base: type) -> Iterable[type]:
    seen = set()
    stack = [base]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
                yield sub


class ClassPathError(Exception):
    """``class_path`` does not name an importable class; ``details`` is the user's own traceback, if any."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


def resolve_class(class_path: Any, bases: Tuple[type, ...]) -> type:
    """The class ``class_path`` names: a full import path, or (as jsonargparse allows) the name of a subclass of
    one of ``bases`` already imported (``CSVLogger``).

    Raises:
        ClassPathError: the module does not import (the message names the failing import; ``details`` holds the
            traceback when the module itself raised), has no such attribute (with a close match), or the name is
            not a class of one of ``bases``.
    """
    if class_path == "???":
        raise ClassPathError("missing value ('???'); expected the import path of a class")
    if not isinstance(class_path, str) or not class_path:
        raise ClassPathError(f"expected the import path of a class, got {class_path!r}")
    module_name, _, attr = class_path.rpartition(".")
    if not module_name:
        found = [c for b in bases for c in [b, *_subclasses(b)] if c.__name__ == class_path]
        if found:
            return found[0]
        raise ClassPathError(f"{class_path!r} is neither an import path ('package.module.ClassName') nor the name "
                             f"of an imported subclass of {_names(bases)}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise ClassPathError(f"cannot import {class_path!r}: no module named {missing!r} (modules of your own "
                                 "are imported from the current directory and the Python path)") from exc
        raise ClassPathError(f"importing module {module_name!r} failed: {type(exc).__name__}: {exc}",
                             _user_traceback(exc)) from exc
    except Exception as exc:
        raise ClassPathError(f"importing module {module_name!r} failed: {type(exc).__name__}: {exc}",
                             _user_traceback(exc)) from exc
    cls = getattr(module, attr, None)
    if cls is None:
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f" (did you mean '{module_name}.{close[0]}'?)" if close else ""
        raise ClassPathError(f"module {module_name!r} has no attribute {attr!r}{hint}")
    if not inspect.isclass(cls):
        raise ClassPathError(f"{class_path} is a {type(cls).__name__}, not a class; expected a subclass of "
                             f"{_names(bases)}")
    if bases and not issubclass(cls, bases):
        raise ClassPathError(f"{class_path} is not a subclass of {_names(bases)}")
    return cls


def _names(bases: Tuple[type, ...]) -> str:
    return " or ".join(f"{b.__module__}.{b.__qualname__}" for b in bases)


def _user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` from the first frame outside importlib and this package."""
    frames = traceback.extract_tb(exc.__traceback__)
    keep = [f for f in frames if "importlib" not in f.filename and "cg_lightning/cli" not in f.filename]
    lines = traceback.format_list(keep) + traceback.format_exception_only(type(exc), exc)
    return "Traceback of the import (most recent call last):\n" + "".join(lines)


def suggest(key: str, valid: List[str]) -> Optional[str]:
    """A close valid name: a spelling neighbour, or a longer name that starts with ``key`` (``seed`` ->
    ``seed_everything``)."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return close[0]
    longer = [v for v in valid if v.startswith(key + "_") or v.replace("_", "-") == key or v == key.replace("-", "_")]
    return longer[0] if longer else None


def unknown_text(key: str, group: Group, path: str, elsewhere: List[str]) -> str:
    """``unknown key (did you mean 'max_steps'?); valid keys under 'trainer': ...``."""
    valid = sorted(group.fields)
    close = suggest(key, valid)
    if close is not None:
        hint = f" (did you mean '{close}'?)"
    elif elsewhere:
        hint = f" (did you mean {' or '.join(repr(e) for e in elsewhere[:3])}?)"
    else:
        hint = ""
    where = f"under '{path}'" if path else "at the top level"
    if group.what and path:
        where += f" ({group.what})"
    return f"unknown key{hint}; valid keys {where}: {', '.join(valid)}"


def _canonical_class_node(value: Mapping) -> Dict[str, Any]:
    """``{class_path: X, n_layer: 3}`` -> ``{class_path: X, init_args: {n_layer: 3}}`` (jsonargparse's shorthand);
    a near miss of a reserved key (``init_arg``) stays where it is, to be reported as such."""
    out: Dict[str, Any] = {}
    for key, item in value.items():
        if key not in RESERVED and difflib.get_close_matches(str(key), RESERVED, n=1, cutoff=0.8):
            out[key] = item
        elif key in RESERVED:
            if key == "init_args" and isinstance(item, Mapping):
                out.setdefault("init_args", {}).update(item)
            else:
                out[key] = item
        else:
            out.setdefault("init_args", {})[key] = item
    return out


def canonical(value: Any, node: Any) -> Any:
    """``value`` with the shorthand of every ``class_path`` node written out under ``init_args``."""
    if isinstance(node, Group):
        if not isinstance(value, Mapping):
            return value
        return {k: canonical(v, node.fields.get(k, Any)) for k, v in value.items()}
    classes = tuple(m for m in _members(node) if _is_class_type(m))
    if isinstance(value, str) and "." in value and classes:  # --model=package.module.Class
        if not any(m is str for m in _members(node)):
            return {"class_path": value}
        try:  # a string or a class (trainer.strategy): a class when it imports as one
            resolve_class(value, classes)
            return {"class_path": value}
        except ClassPathError:
            return value
    kind, arg = kind_of(node, value)
    if kind == "class":
        return _canonical_class_node(value)
    if kind == "dataclass":
        return canonical(value, dataclass_schema(arg))
    if kind == "list":
        return [canonical(v, arg) for v in value]
    return value
