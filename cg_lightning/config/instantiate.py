"""Building an object from a ``{class_path, init_args}`` component, with errors that name the key.

The convention is Lightning's ``LightningCLI`` one (``class_path`` an import path, ``init_args`` its
constructor's keyword arguments). Before calling the constructor, the arguments are bound to its
signature (unknown or missing arguments) and checked against its simple annotations (``int``,
``float``, ``str``, ``bool``, ``Literal[...]``, lists and mappings of these, their ``Optional`` / ``Union``)
by the check the option dataclasses use (:func:`cg_lightning.option_checks.expected_type`); anything
richer is left to the constructor itself.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import typing
from typing import Any, Dict, Mapping, Optional

from lightning.fabric.utilities.exceptions import MisconfigurationException

from cg_lightning.option_checks import expected_type

from .errors import ConfigError, short
from .provenance import from_text
from .schema import ComponentConfig

def _import_class(class_path: str, key: str, cfg: Any = None) -> Any:
    where = from_text(cfg, f"{key}.class_path")
    module_name, _, attr = class_path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(
            f"{key}.class_path: {class_path!r} is not an import path of the form 'package.module.ClassName'{where}"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"{key}.class_path: cannot import module {module_name!r} for {class_path!r} ({exc}); "
            f"modules such as 'examples.*' are imported from the current directory, "
            f"which must be the repository root{where}"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f" (did you mean '{module_name}.{close[0]}'?)" if close else ""
        raise ConfigError(f"{key}.class_path: module {module_name!r} has no attribute {attr!r}{hint}{where}") from exc


def _describe_params(sig: inspect.Signature) -> str:
    parts = []
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is p.empty:
            parts.append(p.name)
        else:
            parts.append(f"{p.name}={p.default!r}")
    return ", ".join(parts) if parts else "(none)"


def _bad_kwargs_error(key: str, class_path: str, sig: Optional[inspect.Signature], kwargs: Mapping[str, Any],
                      reason: BaseException, cfg: Any = None) -> ConfigError:
    details, culprits = [], []
    if sig is not None:
        params = sig.parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not takes_any:
            for name in kwargs:
                if name not in params:
                    close = difflib.get_close_matches(str(name), named, n=1)
                    hint = f" (did you mean '{close[0]}'?)" if close else ""
                    details.append(f"unknown argument {name!r}{hint}")
                    culprits.append(f"{key}.init_args.{name}")
    if not details:
        details.append(short(reason))
    accepted = _describe_params(sig) if sig is not None else "unknown (no signature)"
    where = from_text(cfg, *(culprits or [f"{key}.init_args"]))
    return ConfigError(f"{key}.init_args: {class_path}: {'; '.join(details)}. Accepted parameters: {accepted}{where}")


def _check_annotations(cls: Any, sig: inspect.Signature, kwargs: Dict[str, Any], key: str, class_path: str,
                       cfg: Any) -> None:
    try:
        hints = typing.get_type_hints(cls.__init__ if inspect.isclass(cls) else cls)
    except Exception:  # unresolvable string annotations and friends: nothing to check against
        return
    problems = []
    for name, value in kwargs.items():
        if name not in sig.parameters or name not in hints:
            continue
        expected = expected_type(hints[name], value)
        if expected is not None:
            problems.append(
                f"{key}.init_args.{name}: expected {expected} (the annotation of {class_path}), "
                f"got {value!r}{from_text(cfg, f'{key}.init_args.{name}')}"
            )
    if problems:
        raise ConfigError("\n".join(problems))


def _instantiate(component: ComponentConfig, key: str, expected: type, cfg: Any = None) -> Any:
    """``component.class_path(**component.init_args)``, checked to be an instance of ``expected``.

    ``key`` is the component's key path (``model``, ``callbacks[2]``); ``cfg``, the loaded
    :class:`~cg_lightning.config.RunConfig`, lets messages name the file that set the bad value.

    Raises:
        ConfigError: the class cannot be imported, the arguments do not fit its signature or its
            simple annotations, its constructor rejects them (``ValueError``,
            ``MisconfigurationException``), or the object is not an ``expected``.
    """
    cls = _import_class(component.class_path, key, cfg)
    kwargs = dict(component.init_args)
    try:
        sig: Optional[inspect.Signature] = inspect.signature(cls)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        try:
            sig.bind(**kwargs)
        except TypeError as exc:
            raise _bad_kwargs_error(key, component.class_path, sig, kwargs, exc, cfg) from exc
        _check_annotations(cls, sig, kwargs, key, component.class_path, cfg)
    try:
        obj = cls(**kwargs)
    except TypeError as exc:
        text = str(exc)
        if sig is None or "keyword argument" in text or ("required" in text and "argument" in text):
            raise _bad_kwargs_error(key, component.class_path, sig, kwargs, exc, cfg) from exc
        raise
    except (ValueError, MisconfigurationException) as exc:
        raise ConfigError(
            f"{key}.init_args: {component.class_path} rejected its arguments: {short(exc)}"
            f"{from_text(cfg, f'{key}.init_args')}"
        ) from exc
    if not isinstance(obj, expected):
        raise ConfigError(
            f"{key}.class_path: {component.class_path} built a {type(obj).__module__}.{type(obj).__qualname__}, "
            f"which is not a {expected.__module__}.{expected.__qualname__}{from_text(cfg, f'{key}.class_path')}"
        )
    return obj
