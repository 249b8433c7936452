"""Train the example GPT in a plain Hugging Face Accelerate loop, through cg-lightning or (``--eager``) not.

The run is described by the same YAML as ``python -m cg_lightning fit``, read by the same parser
(:class:`cg_lightning.cli.CGLightningCLI`: several ``--config`` files, ``--key=value`` overrides, ``${...}``
interpolation, the same error lines). Used from it: ``seed_everything``, ``model`` (the LightningModule is used as a
plain ``nn.Module``: its ``forward`` and ``configure_optimizers``; no Trainer), ``data`` (its ``train_dataloader``),
the options of ``trainer.strategy`` (``graphs``, ``ddp``; any other strategy runs the eager reference), and from
``trainer``: ``max_steps``, ``accumulate_grad_batches``, ``gradient_clip_val`` / ``gradient_clip_algorithm``,
``precision``, ``log_every_n_steps`` and ``accelerator`` (``cpu`` forces the CPU). Processes and machines come from
the launcher, not from ``trainer.devices`` / ``num_nodes``. Mixed precision: ``--mixed-precision``, else the
launcher's (``accelerate launch`` always sets one, from its config file), else ``trainer.precision``.

The two modes differ in one line: ``CUDAGraphAccelerator(graphs=..., ddp=...)`` (per-layer graphs under
the ``main_grad`` engine) or ``accelerate.Accelerator()`` (torch DDP, the eager reference). Both see the
same seed and the same batches.

CPU, two processes over gloo (``accelerate launch --cpu --num_processes 2`` starts only one process on
a CPU: Accelerate's own multi-CPU launch needs mpirun; use torchrun or the config below)::

    torchrun --nproc_per_node 2 examples/train_accelerate.py \
        --config cg_lightning/examples/configs/gpt_tiny.yaml --max-steps 60
    accelerate launch --config_file examples/accelerate_configs/cpu_2proc.yaml examples/train_accelerate.py \
        --config cg_lightning/examples/configs/gpt_tiny.yaml --max-steps 60

GPUs of one machine::

    accelerate launch --config_file examples/accelerate_configs/gpu_1node.yaml examples/train_accelerate.py \
        --config cg_lightning/examples/configs/gpt_small.yaml

``--checkpoint-dir DIR``: on SIGTERM (under SLURM also SIGUSR1) to any process, every process stops after the same
optimizer step (``accelerator.check_preemption()``), saves the state to ``DIR`` (``save_state``) and the run exits
with 128 + signal (143); a run started with a ``DIR`` holding a state resumes from it (``load_state``, then the
batches of the epoch not yet taken). ``CUDAGraphAccelerator`` only.

``--out FILE`` (rank 0) saves a ``torch.save`` dict: ``losses`` (one list of per-rank losses per
micro-batch), ``grad_norms`` (total gradient norm before clipping, per optimizer step, when clipping),
``state`` (final state_dict), ``stats`` (graph counters, ``None`` with ``--eager``) and ``run``
(distributed type, processes, mixed precision, steps).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # this checkout's cg_lightning, before an installed one

import torch
import torch.nn.functional as F

from accelerate import Accelerator
from lightning.pytorch.strategies import StrategyRegistry

import cg_lightning

from cg_lightning.accelerate import CUDAGraphAccelerator
from cg_lightning.cli import CGLightningCLI, ConfigError, report
from cg_lightning.examples.configs import path as shipped_config

_PRECISIONS = {"32-true": "no", "32": "no", "bf16-mixed": "bf16", "16-mixed": "fp16"}


def parse_args(argv=None):
    """This script's own options, and the rest of the arguments for the configuration parser."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Every other argument goes to the configuration: --config FILE (repeat to "
                                        "merge several; default: the shipped gpt_tiny), --trainer.max_steps=60, ...")
    ap.add_argument("--eager", action="store_true", help="plain accelerate.Accelerator (torch DDP), the reference")
    ap.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default: trainer.max_steps)")
    ap.add_argument("--gradient-accumulation-steps", type=int, default=None,
                    help="micro-batches per optimizer step (default: trainer.accumulate_grad_batches)")
    ap.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default=None,
                    help="default: the launcher's setting, else trainer.precision")
    ap.add_argument("--cpu", action="store_true", help="train on the CPU even if GPUs are visible")
    ap.add_argument("--log-every", type=int, default=None, help="print the loss every N steps "
                    "(default: trainer.log_every_n_steps)")
    ap.add_argument("--out", default=None, metavar="FILE",
                    help="rank 0 saves losses, final weights and graph counters to this file (torch.save)")
    ap.add_argument("--checkpoint-dir", default=None, help="on SIGTERM save the state here and exit with 143; "
                    "resume from it when it holds a state (not with --eager)")
    args, config_args = ap.parse_known_args(argv)
    if not any(a in ("-c", "--config") or a.startswith("--config=") for a in config_args):
        config_args = ["--config", shipped_config("gpt_tiny"), *config_args]
    return args, config_args


class ConfigOnly(CGLightningCLI):
    """The command line's parser and checks, building the model, the data and the strategy but no Trainer."""

    def __init__(self, args):
        super().__init__(args=args, run=False, save_config_callback=None)

    def instantiate_trainer(self, **kwargs):
        return None


def _mixed_precision(args, cfg) -> str:
    if args.mixed_precision:
        return args.mixed_precision
    if os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return os.environ["ACCELERATE_MIXED_PRECISION"]
    precision = str(cfg.precision or "32-true")
    if precision not in _PRECISIONS:
        raise SystemExit(f"trainer.precision={precision!r} has no Accelerate equivalent; "
                         f"use one of {sorted(_PRECISIONS)} or --mixed-precision")
    return _PRECISIONS[precision]


def _optimizer_and_scheduler(module):
    """``configure_optimizers`` of the LightningModule: an optimizer, or a dict with an ``lr_scheduler``."""
    out = module.configure_optimizers()
    if isinstance(out, torch.optim.Optimizer):
        return out, None
    if isinstance(out, dict) and isinstance(out.get("optimizer"), torch.optim.Optimizer):
        sched = out.get("lr_scheduler")
        if isinstance(sched, dict):
            if sched.get("interval", "epoch") != "step":
                raise SystemExit("this script steps LR schedulers per optimizer step (interval: step) only")
            sched = sched["scheduler"]
        return out["optimizer"], sched
    raise SystemExit(f"configure_optimizers returned {type(out).__name__}; expected an optimizer or a dict")


def main(argv=None) -> None:
    args, config_args = parse_args(argv)
    try:
        cli = ConfigOnly(config_args)  # seeds, then builds the model, the data and the strategy
    except ConfigError as error:
        raise SystemExit(report(error)) from None
    cfg, module, data = cli.config.trainer, cli.model, cli.datamodule
    strategy = cli.config_init.trainer.strategy  # built from class_path; a name is looked up as the Trainer would
    if isinstance(strategy, str) and strategy in StrategyRegistry:
        strategy = StrategyRegistry.get(strategy)
    max_steps = args.max_steps if args.max_steps is not None else cfg.max_steps
    if max_steps <= 0:
        raise SystemExit("set --max-steps or trainer.max_steps to a positive number of optimizer steps")
    accumulation = args.gradient_accumulation_steps or cfg.accumulate_grad_batches
    clip = cfg.gradient_clip_val
    log_every = args.log_every or cfg.log_every_n_steps or 10
    eager = args.eager or not isinstance(strategy, cg_lightning.CUDAGraphDDPStrategy)
    if eager and args.checkpoint_dir:
        raise SystemExit("--checkpoint-dir needs CUDAGraphAccelerator (its check_preemption); it does not go with "
                         "--eager or a strategy other than cudagraph_ddp")

    common = dict(
        cpu=args.cpu or cfg.accelerator == "cpu" or not torch.cuda.is_available(),
        mixed_precision=_mixed_precision(args, cfg),
        gradient_accumulation_steps=accumulation,
    )
    if eager:
        accelerator = Accelerator(**common)
    else:
        accelerator = CUDAGraphAccelerator(graphs=strategy.graph_options, ddp=strategy.ddp_options, **common)

    try:
        data.setup("fit")
        if hasattr(module, "check_data"):
            module.check_data(data)
    except (ConfigError, OSError, ValueError) as error:
        raise SystemExit(report(cli.refusal(error))) from None
    loader = data.train_dataloader()
    optimizer, scheduler = _optimizer_and_scheduler(module)
    if scheduler is None:
        model, optimizer, loader = accelerator.prepare(module, optimizer, loader)
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(module, optimizer, loader, scheduler)
    accelerator.print(
        f"{'eager Accelerate (torch DDP)' if eager else 'cg_lightning CUDAGraphAccelerator'}: "
        f"{accelerator.distributed_type.value}, {accelerator.num_processes} process(es) on {accelerator.device}, "
        f"mixed_precision={accelerator.mixed_precision}, gradient_accumulation_steps={accumulation}, "
        f"clip={clip}, {max_steps} steps"
    )

    taken = 0  # micro-batches a preempted run took before this one
    if args.checkpoint_dir and os.path.isdir(args.checkpoint_dir):
        accelerator.load_state(args.checkpoint_dir)  # weights, optimizer, scheduler, RNG; accelerator.step
        taken = accelerator.step
        accelerator.print(f"resumed from {args.checkpoint_dir} after {taken // accumulation} steps")

    model.train()
    losses, grad_norms = [], []
    step, start, window = taken // accumulation, time.perf_counter(), []
    skip = taken % len(loader)
    while step < max_steps:
        for x, y in accelerator.skip_first_batches(loader, skip) if skip else loader:
            with accelerator.accumulate(model):
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
                accelerator.backward(loss)
                if accelerator.sync_gradients and clip is not None:
                    if cfg.gradient_clip_algorithm == "value":
                        accelerator.clip_grad_value_(model.parameters(), clip)
                    else:
                        grad_norms.append(float(accelerator.clip_grad_norm_(model.parameters(), clip)))
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad()
            per_rank = accelerator.gather(loss.detach().float().reshape(1)).tolist()
            losses.append(per_rank)
            window.append(sum(per_rank) / len(per_rank))
            if not accelerator.sync_gradients:
                continue
            step += 1
            if step % log_every == 0 or step == max_steps:
                accelerator.print(f"step {step:5d}  loss {sum(window) / len(window):.4f}  "
                                  f"{(time.perf_counter() - start) / (step - taken // accumulation) * 1000:.0f} "
                                  "ms/step")
                window = []
            if args.checkpoint_dir and accelerator.check_preemption():  # every process, after each optimizer step
                accelerator.save_state(args.checkpoint_dir)
                accelerator.exit_preempted()  # end_training, then exit with 128 + signal
            if step >= max_steps:
                break
        skip = 0

    stats = getattr(model, "graph_stats", None)
    if accelerator.is_main_process and args.out:
        state = accelerator.unwrap_model(model).state_dict()
        torch.save(
            {
                "losses": losses,
                "grad_norms": grad_norms,
                "state": {k: v.detach().cpu().clone() for k, v in state.items()},
                "stats": dict(vars(stats)) if stats is not None else None,
                "run": {
                    "eager": eager,
                    "distributed_type": accelerator.distributed_type.value,
                    "num_processes": accelerator.num_processes,
                    "mixed_precision": accelerator.mixed_precision,
                    "steps": step,
                    "gradient_accumulation_steps": accumulation,
                },
            },
            args.out,
        )
    if stats is not None:
        accelerator.print(f"graphs: {stats.captured_runners} captured layer calls, {stats.forward_replays} replays, "
                          f"{stats.eager_calls} eager calls, {stats.fallback_calls} fallbacks")
    accelerator.wait_for_everyone()
    # Drop the DDP wrappers before the process groups go: a gloo group still referenced at interpreter
    # exit can abort the process ("terminate called without an active exception"), with torch DDP too.
    del model, optimizer, scheduler
    accelerator.free_memory()
    accelerator.end_training()


if __name__ == "__main__":
    main()
