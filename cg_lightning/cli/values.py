"""Values the parser accepts by type but the run cannot use, refused once the configuration is parsed.

jsonargparse checks types; Lightning's ``Trainer`` checks some ranges itself (``max_steps``) and not others: an
``accumulate_grad_batches`` of 0 fails with a ``ZeroDivisionError`` in the first batch, a negative
``gradient_clip_val`` trains without complaint, a seed outside ``[0, 2**32 - 1]`` stops inside ``seed_everything``.
:func:`check_values` refuses those, non-finite numbers, and output folders (``trainer.default_root_dir``, a
logger's ``save_dir``) that cannot be written, each as a :class:`~cg_lightning.cli.keys.Problem` naming the key.
"""

from __future__ import annotations

import math
import os
import tempfile
import typing
from typing import Any, Callable, Dict, List, Optional

from .keys import Problem

MAX_SEED = 2**32 - 1


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _at_least(bound: float, allow_none: bool = True, integer: bool = True) -> Callable[[Any], Optional[str]]:
    """A check of an int (or, ``integer=False``, a finite number) ``>= bound``, or null where ``allow_none``."""
    def check(value: Any) -> Optional[str]:
        if value is None and allow_none:
            return None
        kind_ok = isinstance(value, int) if integer else math.isfinite(value) if _number(value) else False
        if _number(value) and kind_ok and value >= bound:
            return None
        kind = "an int" if integer else "a finite number"
        return f"expected {kind} >= {bound}{' or null' if allow_none else ''}, got {value!r}"
    return check


def _batches(value: Any) -> Optional[str]:
    """``limit_*_batches``, ``overfit_batches``: a count (int >= 0) or a fraction of the epoch (float in [0, 1])."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return None
    if isinstance(value, float) and math.isfinite(value) and 0.0 <= value <= 1.0:
        return None
    return f"expected a number of batches (int >= 0) or a fraction of the epoch (float in [0, 1]), got {value!r}"


def _interval(value: Any) -> Optional[str]:
    """``val_check_interval``: batches (int >= 1), a fraction of the epoch (float in (0, 1]) or a time."""
    if value is None or isinstance(value, (str, dict)) or (isinstance(value, int) and not isinstance(value, bool)
                                                            and value >= 1):
        return None
    if isinstance(value, float) and math.isfinite(value) and 0.0 < value <= 1.0:
        return None
    return f"expected a number of batches (int >= 1) or a fraction of the epoch (float in (0, 1]), got {value!r}"


#: the Trainer's numeric arguments and what they accept (units as in Lightning)
TRAINER_RANGES: Dict[str, Callable[[Any], Optional[str]]] = {
    "num_nodes": _at_least(1, allow_none=False),
    "max_steps": _at_least(-1, allow_none=False),
    "max_epochs": _at_least(-1),
    "min_epochs": _at_least(0),
    "min_steps": _at_least(0),
    "accumulate_grad_batches": _at_least(1, allow_none=False),
    "gradient_clip_val": _at_least(0, integer=False),
    "log_every_n_steps": _at_least(1),
    "num_sanity_val_steps": _at_least(-1),
    "check_val_every_n_epoch": _at_least(1),
    "reload_dataloaders_every_n_epochs": _at_least(0, allow_none=False),
    "limit_train_batches": _batches,
    "limit_val_batches": _batches,
    "limit_test_batches": _batches,
    "limit_predict_batches": _batches,
    "overfit_batches": _batches,
    "val_check_interval": _interval,
}


def _unwritable(path: Any) -> Optional[str]:
    """Why files cannot be created under folder ``path``, or ``None``. Tried, not guessed from permission bits
    (``os.access`` says yes to root anywhere, ``/proc`` included): a folder of a unique name is made in ``path`` or,
    if it is missing, in its nearest existing parent, and removed again (nothing is left behind, and processes
    checking the same path at once do not meet)."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        return "is a file, expected a folder for the run's outputs"
    probe = path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"cannot be created: {probe} is a file"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".cg_lightning-write-check-", dir=probe))
    except OSError as exc:
        verb = "written" if probe == path else "created"
        return f"cannot be {verb}: making a folder in {probe} failed: {exc.strerror or exc}"
    return None


def _get(section: Any, key: str) -> Any:
    try:
        return section[key]
    except (KeyError, TypeError):
        return None


def _int_or_float(annotation: Any) -> bool:
    args = set(typing.get_args(annotation))
    return int in args and float in args


def restore_written_ints(trainer: Any, written: Any) -> None:
    """Give back the ints the configuration wrote for the Trainer's int-or-float arguments (``limit_val_batches:
    20`` means 20 batches, ``1.0`` the whole epoch) where the parser made floats of them.

    jsonargparse tries a union's types in order, and ``typing`` caches unions regardless of their order: once any
    module has built ``Optional[Union[float, int]]``, Lightning's ``Optional[Union[int, float]]`` annotation is
    that object (which one depends on what the process imported and on the cache's eviction: with torch 2.11 it is
    the float-first one, with 2.13 not), and ``20`` parses as
    ``20.0``, which Lightning refuses as a fraction above 1. :func:`int_before_float` orders the parser's unions;
    this covers a parser built elsewhere.
    """
    import inspect

    from lightning.pytorch import Trainer

    if trainer is None or not isinstance(written, dict):
        return
    for name, parameter in inspect.signature(Trainer.__init__).parameters.items():
        value, parsed = written.get(name), _get(trainer, name)
        if (_int_or_float(parameter.annotation) and isinstance(value, int) and not isinstance(value, bool)
                and isinstance(parsed, float) and parsed == value):
            trainer[name] = value


def int_before_float(parser: Any) -> None:
    """Make every argument of ``parser`` (and of its subcommands' parsers) whose type is a union of int and float try
    int first, so that ``20`` stays 20 batches in the parsed configuration and in ``--print_config`` whatever order
    ``typing``'s cache gave the union (:func:`restore_written_ints`). Reads argparse's ``_actions`` and jsonargparse's
    ``ActionTypeHint._typehint``; an action without them is left as it is."""
    import functools
    import operator

    for action in getattr(parser, "_actions", ()):
        for sub in (getattr(action, "choices", None) or {}).values() if hasattr(action, "_name_parser_map") else ():
            int_before_float(sub)
        hint = getattr(action, "_typehint", None)
        args = typing.get_args(hint)
        if int in args and float in args and args.index(float) < args.index(int):
            ordered = [int, float] + [a for a in args if a not in (int, float)]
            action._typehint = functools.reduce(operator.or_, ordered)  # PEP 604 unions are not cached by typing


def check_values(section: Any) -> List[Problem]:
    """The problems of a parsed configuration (the subcommand's section: ``seed_everything``, ``trainer``, ...)."""
    problems: List[Problem] = []
    seed = _get(section, "seed_everything")
    if not isinstance(seed, bool) and not (isinstance(seed, int) and 0 <= seed <= MAX_SEED):
        problems.append(Problem("seed_everything", f"expected an int in [0, {MAX_SEED}] or true (a random seed) or "
                                                   f"false (no seeding), got {seed!r}", value=True))
    trainer = _get(section, "trainer") or {}
    for name, check in TRAINER_RANGES.items():
        value = _get(trainer, name)
        text = check(value)
        if text is not None:
            problems.append(Problem(f"trainer.{name}", text, value=True))
    folders = {"trainer.default_root_dir": _get(trainer, "default_root_dir")}
    loggers = _get(trainer, "logger")
    for i, logger in enumerate(loggers if isinstance(loggers, list) else [loggers]):
        key = f"trainer.logger[{i}]" if isinstance(loggers, list) else "trainer.logger"
        init_args = _get(logger, "init_args")
        for arg in ("save_dir", "root_dir"):
            if isinstance(_get(init_args, arg), (str, os.PathLike)):
                folders[f"{key}.init_args.{arg}"] = _get(init_args, arg)
    for key, folder in folders.items():
        why = _unwritable(folder) if isinstance(folder, (str, os.PathLike)) and folder else None
        if why is not None:
            problems.append(Problem(key, f"{os.fspath(folder)!r} {why}", value=True))
    return problems
