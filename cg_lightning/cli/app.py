"""``CGLightningCLI``: Lightning's ``LightningCLI`` in OmegaConf mode, with messages that name the key and its file.

Everything about parsing is Lightning's and jsonargparse's: the ``fit|validate|test|predict`` subcommands, every
``Trainer`` argument with its type, ``class_path`` / ``init_args`` sections for the model, the data, the optimizer,
the LR scheduler, the strategy, loggers and callbacks, several ``--config`` files and ``--key=value`` overrides,
``--print_config``. The parser mode is ``omegaconf+``: the sources are merged first, then ``${...}``
interpolations are resolved, so an override also reaches the values that interpolate it. This class adds, around
those steps:

1. before parsing, the sources are read and walked (:mod:`~cg_lightning.cli.sources`, :mod:`~cg_lightning.cli.keys`):
   unreadable files, unknown keys (with a close match), class paths that do not import, a missing model;
2. a parse error is turned into lines that name the full key and the file it came from, every problem of the
   configuration at once (:mod:`~cg_lightning.cli.messages`);
3. a constructor or the ``Trainer`` refusing its arguments, a checkpoint that is not one, and any
   :class:`~cg_lightning.errors.ConfigError` or Lightning ``MisconfigurationException`` raised before the first
   batch (the strategy's setup checks, :mod:`cg_lightning.trainer.setup_checks`) become such lines too.

Each of these raises :class:`~cg_lightning.errors.ConfigError`; :func:`main` prints one ``error:`` line per problem
and returns exit status 2, before any training step. The package's own errors of a run that has started
(:data:`RUN_ERRORS`: a layer that cannot be captured, gradients that do not sync, a lost peer) end as ``error:``
lines too, with exit status 1. Their traceback, and a configuration error's, is printed only with
``CG_LIGHTNING_TRACEBACK=1`` in the environment.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Dict, Optional, Sequence

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI
from typing_extensions import override

from cg_lightning.ddp.errors import GradSyncError
from cg_lightning.errors import ConfigError
from cg_lightning.graphs.errors import GraphCaptureError, GraphSignatureError, HostSyncError, SegmentError

from .keys import Problem, check_keys
from .diagnosis import parse_problems
from .messages import Reporter
from .refusals import checkpoint_problems, instantiation_problems, run_time_problems, trainer_problem
from .schema import canonical, parser_schema
from .values import check_values, int_before_float, restore_written_ints
from .sources import COMMAND_LINE, Provenance, leaf_key, merge, read_sources, relative_interpolations

__all__ = ["CGLightningCLI", "main", "report"]

EXIT_CONFIG_ERROR = 2
#: a run that started stopped on one of :data:`RUN_ERRORS` (steps may have run): Python's status for any exception
EXIT_RUN_ERROR = 1
#: the errors of a run whose message says all there is (the layer or parameter, the cause, the source line, the fix);
#: ``PeerLostError`` is a ``GradSyncError``
RUN_ERRORS = (GraphCaptureError, GraphSignatureError, HostSyncError, SegmentError, GradSyncError)
#: set to ``1`` to print the traceback above the ``error:`` lines
TRACEBACK_VARIABLE = "CG_LIGHTNING_TRACEBACK"
#: the parser settings every (sub)command parser gets: OmegaConf merging and interpolation, no abbreviated options
#: (``--trainer.max_step`` must not silently mean ``max_steps``), errors raised to this class instead of printed
PARSER_DEFAULTS = {"parser_mode": "omegaconf+", "exit_on_error": False, "allow_abbrev": False}


#: parsers kept by :meth:`CGLightningCLI.setup_parser` for ``reuse_parsers=True``, per class and subcommand mode
_PARSERS: Dict[Any, Any] = {}


class _FirstBatch(Callback):
    """Notes when the first batch of any loop starts: errors before it are configuration errors."""

    started = False

    @override
    def _start(self, *args: Any, **kwargs: Any) -> None:
        self.started = True

    on_train_batch_start = on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _start


class CGLightningCLI(LightningCLI):
    """``LightningCLI`` with OmegaConf interpolation and configuration errors that name the key and its file.

    Takes ``LightningCLI``'s arguments, and ``reuse_parsers`` (keep the parsers for the next instance of this class in
    the process; for a fixed configuration of the class only). Defaults that differ: the parser mode ``omegaconf+``,
    ``trainer.strategy`` ``"cudagraph_ddp"``, the saved ``config.yaml`` may overwrite an earlier one (a run without
    logger writes it to ``default_root_dir``).

    Attributes:
        provenance: the source (file path or ``command line``) of every key, once parsed.

    Raises:
        ConfigError: every problem of the configuration, one per line, each naming the key and its source, before
            any training step (see the module docstring).
    """

    def __init__(self, *args: Any, trainer_defaults: Optional[Dict[str, Any]] = None,
                 save_config_kwargs: Optional[Dict[str, Any]] = None, reuse_parsers: bool = False,
                 **kwargs: Any) -> None:
        from jsonargparse import set_parsing_settings

        self._reuse_parsers = reuse_parsers

        # absolute ${a.b} in a file are resolved inside the subcommand's section, where they are written
        set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
        self.provenance = Provenance()
        self._reporter = Reporter(self.provenance)
        self._first_batch = _FirstBatch()
        super().__init__(*args, trainer_defaults={"strategy": "cudagraph_ddp", **(trainer_defaults or {})},
                         save_config_kwargs={"overwrite": True, **(save_config_kwargs or {})}, **kwargs)

    @override
    def init_parser(self, **kwargs: Any) -> Any:
        return super().init_parser(**{**PARSER_DEFAULTS, **kwargs})

    @override
    def setup_parser(self, add_subcommands: bool, main_kwargs: Dict[str, Any], subparser_kwargs: Dict[str, Any]) -> None:
        """``LightningCLI``'s parsers; with ``reuse_parsers`` (what :func:`main` asks for) built once per process and
        class: their construction (every signature of the Trainer, four times) costs more than a parse."""
        key = (type(self), add_subcommands)
        cached = _PARSERS.get(key) if self._reuse_parsers else None
        if cached is not None:
            self.parser, subcommand_parsers, method_arguments = cached
            if subcommand_parsers is not None:
                self._subcommand_parsers, self._subcommand_method_arguments = subcommand_parsers, method_arguments
            return
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        int_before_float(self.parser)
        if self._reuse_parsers:
            _PARSERS[key] = (self.parser, getattr(self, "_subcommand_parsers", None),
                             getattr(self, "_subcommand_method_arguments", None))

    # ------------------------------------------------------------------ parsing
    @override
    def parse_arguments(self, parser: Any, args: Any) -> None:
        if isinstance(args, dict) or not (args is None or isinstance(args, (list, tuple))):
            return super().parse_arguments(parser, args)  # a dict or Namespace: no files, nothing to trace
        args = list(sys.argv[1:] if args is None else args)
        subcommands = getattr(self, "_subcommand_parsers", None)
        invocation = read_sources(args, expect_subcommand=subcommands is not None)
        if invocation.help:
            self.config = parser.parse_args(args)  # prints the help and exits
            return
        problems = list(invocation.problems)
        subcommand = invocation.subcommand
        sub_parser = subcommands.get(subcommand) if subcommands and subcommand else parser
        if subcommands and subcommand is None:
            problems.append(f"{COMMAND_LINE}: expected a subcommand first: one of {', '.join(subcommands)} "
                            "(e.g. python -m cg_lightning fit --config FILE)")
        if problems:
            raise ConfigError("\n".join(problems))
        top = parser_schema(sub_parser)
        merged: Dict[str, Any] = {}
        for source in invocation.sources:
            source.data = canonical(source.data, top)
            self.provenance.record(source.data, source.name)
            merged = merge(merged, source.data)
        found = check_keys(merged, top, subcommand or "the run")
        if any(not p.value for p in found):
            self._reporter.raise_if(found)  # unknown keys and classes: what the parser makes of the rest is noise
        if found:  # bad option values only: together with whatever else the parser rejects
            skip = [p.key for p in found]
            self._reporter.raise_if(found + parse_problems(sub_parser, invocation, None, subcommand, skip))
        for source in invocation.sources:  # absolute ${...} in overrides, made relative (as in files)
            if source.arg_index is not None and "${" in args[source.arg_index]:
                key, eq, value = args[source.arg_index].partition("=")
                if eq:
                    canonical_key = leaf_key(source.data)
                    args[source.arg_index] = f"{key}={relative_interpolations(value, canonical_key)}"
        try:
            self.config = parser.parse_args(args)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - jsonargparse's ArgumentError, OmegaConf's interpolation errors
            self._reporter.raise_if(parse_problems(sub_parser, invocation, exc, subcommand), exc)
        section = self.config.get(subcommand, self.config) if subcommand else self.config
        restore_written_ints(section.get("trainer"), merged.get("trainer"))
        self._reporter.raise_if(check_values(section))

    @override
    def _parse_ckpt_path(self) -> None:
        """Refuses a ``ckpt_path`` that is no file or not a Lightning checkpoint, then reads its hyperparameters as
        ``LightningCLI`` does."""
        if not self.config.get("subcommand"):
            return
        path = self.config[self.config.subcommand].get("ckpt_path")
        if path:
            self._reporter.raise_if(checkpoint_problems(str(path)))
        try:
            super()._parse_ckpt_path()
        except Exception as exc:  # noqa: BLE001 - the model's hyperparameters saved in it do not fit the parser
            self._reporter.raise_if([Problem("ckpt_path", f"{path!r}: the model hyperparameters saved in it do not "
                                                          f"parse: {' '.join(str(exc).split())[:300]}")], exc)

    # ------------------------------------------------------------------ building
    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ConfigError:
            raise
        except Exception as exc:
            self._reporter.raise_if(instantiation_problems(self._section(), exc), exc)

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Any:
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except Exception as exc:
            self._reporter.raise_if([trainer_problem(exc, self._get(self.config, "trainer"))], exc)
        trainer.callbacks.append(self._first_batch)
        return trainer

    def refusal(self, error: BaseException) -> ConfigError:
        """``error``, raised by a user's own loop before training (a :class:`ConfigError` such as the example
        models' data check, a ``MisconfigurationException``), worded as the command line words it: full keys, each
        with the file it came from."""
        problems = run_time_problems(error, self._section(), getattr(self, "datamodule", None))
        return self._reporter.error(problems or [Problem("", f"{type(error).__name__}: {error}")])

    def _section(self) -> Any:
        """The parsed configuration of the subcommand (the whole one without subcommands)."""
        return self.config.get(str(self.subcommand), self.config) if getattr(self, "subcommand", None) else self.config

    # ------------------------------------------------------------------ running
    @override
    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except Exception as exc:
            problems = None if self._first_batch.started else run_time_problems(exc, self._section(), self.datamodule)
            if problems is None:
                raise
            self._reporter.raise_if(problems, exc)


def _traceback_asked() -> bool:
    return os.environ.get(TRACEBACK_VARIABLE, "").strip().lower() not in ("", "0", "false", "no")


def report(error: BaseException, stream: Any = None) -> int:
    """Print ``error`` as ``error: ...`` lines (after its traceback, with ``CG_LIGHTNING_TRACEBACK=1``).

    Returns:
        2 for a :class:`ConfigError` (after its lines, its ``details``: e.g. the traceback of the user's module that
        failed to import), 1 for one of :data:`RUN_ERRORS` (its type's name first, and how to see its traceback).
    """
    stream = stream or sys.stderr
    if _traceback_asked():
        traceback.print_exception(error, file=stream)
    config = isinstance(error, ConfigError)
    text = str(error) if config else f"{type(error).__name__}: {error}"
    for line in text.splitlines() or [""]:
        print(f"error: {line}", file=stream)
    details = getattr(error, "details", "")
    if details:
        print(details.rstrip(), file=stream)
    if not config and not _traceback_asked():
        print(f"(its traceback: run again with {TRACEBACK_VARIABLE}=1)", file=stream)
    stream.flush()
    return EXIT_CONFIG_ERROR if config else EXIT_RUN_ERROR


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m cg_lightning fit|validate|test|predict --config A.yaml [--config B.yaml] [--key=value ...]``.

    Returns:
        The exit status: 0 after the run, 2 for a configuration error, 1 for one of :data:`RUN_ERRORS` (both printed
        as ``error:`` lines), the code of ``--help`` / ``--print_config`` (0).
    """
    saved = sys.argv
    if argv is not None:  # Lightning's launcher of further processes re-runs sys.argv: it must hold the arguments
        sys.argv = [sys.argv[0] if sys.argv else "cg_lightning", *argv]
    try:
        CGLightningCLI(reuse_parsers=True, parser_kwargs={"prog": "python -m cg_lightning"})
    except (ConfigError, *RUN_ERRORS) as error:
        return report(error)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_CONFIG_ERROR)
    finally:
        sys.argv = saved
    return 0
