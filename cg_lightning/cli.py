"""Command line: ``python -m cg_lightning fit|validate --config A.yaml [--config B.yaml ...] [key=value ...]``.

Configuration files are merged in order, then the ``dotted.key=value`` overrides (see
:func:`cg_lightning.config.load_config`). ``--print-config`` prints the resolved configuration as
YAML and exits without building anything; that output is itself a valid ``--config``. The run's
resolved configuration is saved as ``config.yaml`` in its log folder.

A configuration error is printed as ``error: ...`` on stderr (one line per problem, each naming the
key, the file it came from and what was expected) and exits with status 2 before any training step
runs: problems of the files and overrides before any object is built, settings that conflict with
the model (:func:`cg_lightning.config.conflicts.check_model`) before the trainer runs, and training
data that conflicts with ``strategy.graphs.shape_policy: error`` at the start of training, before
its first batch (:class:`cg_lightning.config.conflicts.ShapePolicyDataCheck`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from cg_lightning.config import (
    ConfigError,
    build_datamodule,
    build_model,
    build_trainer,
    config_to_yaml,
    load_config,
)
from cg_lightning.config.conflicts import check_model

__all__ = ["build_parser", "main"]

COMMANDS = ("fit", "validate")
EXIT_CONFIG_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m cg_lightning``."""
    parser = argparse.ArgumentParser(
        prog="python -m cg_lightning",
        description="Train or validate a LightningModule with per-layer CUDA graphs, configured by YAML.",
        epilog="Example: python -m cg_lightning fit --config configs/gpt_tiny.yaml trainer.max_steps=50",
    )
    parser.add_argument("command", choices=COMMANDS, help="fit: Trainer.fit; validate: Trainer.validate")
    parser.add_argument(
        "-c",
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="YAML config file (at least one, unless --print-config); repeat to merge several, later files win",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration as YAML and exit without running",
    )
    parser.add_argument(
        "--ckpt-path",
        default=None,
        metavar="PATH",
        help="checkpoint to resume fit from / to validate (Lightning's ckpt_path)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],  # else argparse also lists KEY=VALUE as missing when the command is
        metavar="KEY=VALUE",
        help="dotted overrides applied after the files, e.g. trainer.max_steps=100 strategy.name=ddp",
    )
    return parser


def _report(error: ConfigError) -> None:
    for line in str(error).splitlines() or [""]:
        print(f"error: {line}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the process exit status."""
    parser = build_parser()
    try:
        args = parser.parse_intermixed_args(None if argv is None else list(argv))
    except SystemExit as exc:  # --help or a usage error (argparse already printed it)
        return exc.code if isinstance(exc.code, int) else EXIT_CONFIG_ERROR

    if args.ckpt_path is not None and not os.path.isfile(args.ckpt_path):
        print(f"error: --ckpt-path {args.ckpt_path!r}: no such file (a checkpoint is written at each validation, "
              "under runs/lightning_logs/version_N/checkpoints/)", file=sys.stderr)
        return EXIT_CONFIG_ERROR

    if not args.config and not args.print_config:
        # the schema's defaults alone describe a full GPT run: refuse to start one by accident
        print(f"{parser.prog}: error: give at least one --config FILE", file=sys.stderr)
        return EXIT_CONFIG_ERROR

    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            sys.stdout.write(config_to_yaml(cfg))
            sys.stdout.flush()
            return 0
        from lightning.pytorch import seed_everything

        seed_everything(cfg.seed, workers=True)
        model = build_model(cfg)
        check_model(cfg, model, args.command)
        datamodule = build_datamodule(cfg)
        trainer = build_trainer(cfg)
    except ConfigError as error:
        _report(error)
        return EXIT_CONFIG_ERROR

    try:
        if args.command == "fit":
            trainer.fit(model, datamodule=datamodule, ckpt_path=args.ckpt_path)
        else:
            trainer.validate(model, datamodule=datamodule, ckpt_path=args.ckpt_path)
    except ConfigError as error:  # refused at the start of the run (e.g. ShapePolicyDataCheck)
        _report(error)
        return EXIT_CONFIG_ERROR
    return 0
