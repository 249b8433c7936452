"""Refusals after parsing, as :class:`~cg_lightning.cli.keys.Problem` lines with their key.

A constructor rejecting its arguments (the key found from the traceback: the configured class whose
``__init__`` raised), the ``Trainer`` rejecting its settings (the key found from the message), a ``ckpt_path`` that
is not a Lightning checkpoint, and the errors raised before the first batch of a run: the strategy's setup checks
(:mod:`cg_lightning.trainer.setup_checks`, whose lines start with the option, ``graphs.layers: ...``), the example models'
data checks and Lightning's own ``MisconfigurationException`` (manual optimization with clipping, ...).
"""

from __future__ import annotations

import inspect
import os
import re
import traceback
from typing import Any, Iterator, List, Optional, Tuple

from lightning.fabric.utilities.exceptions import MisconfigurationException

from cg_lightning.errors import ConfigError
from cg_lightning.option_checks import join_key

from .keys import STRATEGY_KEY, Problem
from .messages import first_line, union_reason
from .schema import ClassPathError, resolve_class, suggest

#: what a refusal of these types means is in its message; other exceptions keep their traceback as details
_ARGUMENT_ERRORS = (ValueError, TypeError, MisconfigurationException)
#: special values of ckpt_path that Lightning resolves itself
_CKPT_KEYWORDS = ("last", "best", "hpc")


def _class_nodes(config: Any, path: str = "") -> Iterator[Tuple[str, str]]:
    """``(key, class_path)`` of every class node in a parsed configuration (a jsonargparse Namespace or dict)."""
    if hasattr(config, "as_dict"):  # a Namespace: its items() are the flattened leaves
        config = config.as_dict()
    items = config.items() if hasattr(config, "items") else []
    if hasattr(config, "keys") and "class_path" in list(config.keys()):
        yield path, config["class_path"]
    for key, value in items:
        if key in ("class_path", "__path__") or "." in str(key):
            continue
        kpath = join_key(path, key)
        if isinstance(value, list):
            for i, item in enumerate(value):
                yield from _class_nodes(item, f"{kpath}[{i}]")
        elif hasattr(value, "items"):
            yield from _class_nodes(value, kpath)


def _chain(exc: BaseException) -> List[BaseException]:
    """``exc`` and the exceptions it was raised from or during, innermost last."""
    seen: List[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def instantiation_problems(config: Any, exc: BaseException) -> List[Problem]:
    """The class of the configuration whose constructor raised ``exc``, and what it said: per argument when the
    message names the class's arguments line by line (``lr: expected ...``), else for the class; the traceback
    follows for an exception that is not a refusal of arguments (a bug in the constructor)."""
    nodes = []
    for key, class_path in _class_nodes(config):
        try:
            nodes.append((key, class_path, resolve_class(class_path, ())))
        except ClassPathError:
            continue
    key, class_path = "configuration", "a class"
    for raised in _chain(exc):  # jsonargparse raises its own error from the constructor's, about a Union it tried
        frames = [frame for frame, _ in traceback.walk_tb(raised.__traceback__)]
        owners = [frame.f_locals.get("self") for frame in frames if frame.f_code.co_name == "__init__"]
        match = [n for owner in owners for n in nodes if owner is not None and type(owner) is n[2]]
        if match:
            key, class_path = match[0][0], match[0][1]
            exc = raised
            break
    if key == "configuration":  # no constructor frame to go by: the class the failed Union was given, and its words
        given = re.search(r"class_path='([^']+)'", str(exc))
        match = [n for n in nodes if given and n[1] == given.group(1)]
        reason = union_reason(str(exc))
        if match and reason:
            key, class_path = match[0][0], match[0][1]
            exc = ValueError(reason)
    if isinstance(exc, _ARGUMENT_ERRORS):
        named = _argument_lines(exc, key, nodes, class_path)
        if named:
            return named
    problem = Problem(key, f"{class_path} refused its arguments: {type(exc).__name__}: {first_line(exc)}")
    if not isinstance(exc, _ARGUMENT_ERRORS):
        problem.details = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return [problem]


def _argument_lines(exc: BaseException, key: str, nodes: List[Tuple[str, str, type]], class_path: str) -> List[Problem]:
    """``lr: expected ..., got -1`` from a constructor -> ``model.init_args.lr: ...``: one problem per line of
    the message that starts with one of the class's parameters; none when a line does not."""
    cls = next((n[2] for n in nodes if n[0] == key), None)
    try:
        params = set(inspect.signature(cls).parameters) if cls is not None else set()
    except (TypeError, ValueError):
        params = set()
    problems = []
    for line in str(exc).strip().splitlines():
        name, sep, text = line.partition(": ")
        if not sep or name not in params:
            return []
        problems.append(Problem(f"{key}.init_args.{name}", f"{text} ({class_path})"))
    return problems


_TRAINER_WORDS = ("accelerator", "strategy", "devices", "precision", "num_nodes", "logger", "plugins", "profiler")


def trainer_problem(exc: BaseException, trainer_config: Any) -> Problem:
    """The ``trainer.*`` key a ``Trainer`` refusal is about: the first argument its message names, else the one
    whose string value it quotes (``No supported gpu backend found!`` -> ``accelerator``)."""
    message = first_line(exc)
    names = list(trainer_config.keys()) if hasattr(trainer_config, "keys") else list(_TRAINER_WORDS)
    named = [(m.start(), n) for n in names for m in [re.search(rf"(?<![\w]){re.escape(n)}(?![\w])", message)] if m]
    name = min(named)[1] if named else None
    if name is None and hasattr(trainer_config, "get"):
        for candidate in _TRAINER_WORDS:
            value = trainer_config.get(candidate)
            if isinstance(value, str) and value != "auto" and re.search(
                    rf"(?<![\w-]){re.escape(value)}(?![\w-])", message):
                name = candidate
                break
    text = f"the Trainer refused it: {message}"
    if name == "strategy" and hasattr(trainer_config, "get"):
        text += _strategy_hint(trainer_config.get("strategy"))
    return Problem(join_key("trainer", name) if name else "trainer", text)


def _strategy_hint(value: Any) -> str:
    if not isinstance(value, str):
        return ""
    from lightning.pytorch.strategies import StrategyRegistry

    close = suggest(value, list(StrategyRegistry.available_strategies()))
    return ((f" (did you mean '{close}'?)" if close else "") +
            "; this project's strategy is 'cudagraph_ddp', or class_path: cg_lightning.CUDAGraphDDPStrategy")


def checkpoint_problems(path: str) -> List[Problem]:
    """A ``ckpt_path`` that is no file, or a file that is not a Lightning checkpoint (read with ``mmap``: the
    tensors are not loaded)."""
    if path in _CKPT_KEYWORDS or path.startswith("registry"):
        return []
    if not os.path.isfile(path):
        what = "is a folder" if os.path.isdir(path) else "no such file"
        return [Problem("ckpt_path", f"{path!r}: {what}; a checkpoint is written at each validation, under "
                                     "<default_root_dir>/lightning_logs/version_N/checkpoints/")]
    import torch

    try:
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # mmap reads only torch's zip format; older files and non-checkpoints come here
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever torch.load says, the file is no checkpoint
        said = f"{type(exc).__name__}: {first_line(exc)}" if str(exc).strip() else type(exc).__name__
        return [Problem("ckpt_path", f"{path!r} is not a checkpoint (torch.load cannot read it: {said})")]
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        kind = f"a dict with keys {sorted(ckpt)[:6]}" if isinstance(ckpt, dict) else type(ckpt).__name__
        return [Problem("ckpt_path", f"{path!r} is not a Lightning checkpoint (no 'state_dict'; it holds {kind})")]
    return []


#: exceptions from a data module's hooks that are about its inputs (missing files, bad contents), not its code
_DATA_ERRORS = (OSError, ValueError, UnicodeError)


def _data_problem(exc: BaseException, datamodule: Any, data_config: Any) -> Optional[Problem]:
    """A data module's own hooks (``prepare_data``, ``setup``, its loaders) refusing their input: keyed to the
    ``data.init_args`` argument whose value the message quotes (the path), else to ``data.class_path``."""
    if datamodule is None or not isinstance(exc, _DATA_ERRORS):
        return None
    if not any(frame.f_locals.get("self") is datamodule for frame, _ in traceback.walk_tb(exc.__traceback__)):
        return None
    text = str(exc).strip().replace("\n", "; ")
    init_args = data_config.get("init_args") if hasattr(data_config, "get") else None
    key = "data.class_path"
    for name, value in (init_args.items() if hasattr(init_args, "items") else []):
        if isinstance(value, str) and value and value in text:
            key = f"data.init_args.{name}"
            break
    kind = "" if type(exc) in (ValueError, ConfigError) else f"{type(exc).__name__}: "
    return Problem(key, f"{kind}{text}")


def _raised_by_lightning_loops(exc: BaseException) -> bool:
    """``exc`` was raised by the code of Lightning's Trainer or loops themselves (checks of the Trainer's arguments
    against the data made at the start of a loop), not by user code they called."""
    frames = list(traceback.walk_tb(exc.__traceback__))
    module = frames[-1][0].f_globals.get("__name__", "") if frames else ""
    return module.startswith(tuple(f"{p}.{sub}" for p in ("lightning.pytorch", "pytorch_lightning")
                                   for sub in ("loops", "trainer")))


def run_time_problems(exc: BaseException, section: Any, datamodule: Any = None) -> Optional[List[Problem]]:
    """The lines of a refusal raised before the first batch; ``None`` for any other exception (it keeps its
    traceback). ``section`` is the parsed configuration (its ``trainer`` and ``data``), ``datamodule`` the built one.

    Refusals: a :class:`ConfigError` (its option keys, ``graphs.*`` / ``ddp.*``, made full:
    ``trainer.strategy.init_args.graphs.layers``); a Lightning ``MisconfigurationException``, or a ``ValueError``
    raised by Lightning's Trainer or loops themselves (``val_check_interval`` beyond the epoch's batches); an
    ``OSError`` or ``ValueError`` from the data module's own hooks (a data file missing, empty, too short, not text).
    """
    trainer_config = section.get("trainer") if hasattr(section, "get") else None
    if isinstance(exc, ConfigError):
        problems = []
        for line in str(exc).splitlines():
            key, sep, text = line.partition(": ")
            if not sep or " " in key:
                problems.append(Problem("", line))
                continue
            if key.split(".")[0] in ("graphs", "ddp"):
                key = f"{STRATEGY_KEY}.init_args.{key}"
            problems.append(Problem(key, text, cite_others=True))
        return problems
    if isinstance(exc, MisconfigurationException):
        if re.search(r"No `\w+_step\(\)` method defined", str(exc)):  # the model cannot run this subcommand
            return [Problem("model.class_path", first_line(exc))]
        return [trainer_problem(exc, trainer_config)]
    if isinstance(exc, ValueError) and _raised_by_lightning_loops(exc):  # `val_check_interval` beyond the epoch
        return [trainer_problem(exc, trainer_config)]
    data = _data_problem(exc, datamodule, section.get("data") if hasattr(section, "get") else None)
    return None if data is None else [data]
