"""One rank of a two-process fit (``--devices N``: N processes) of the example GPT under ``cudagraph_ddp``, for
``tests/test_faults.py`` and ``tests/test_faults_ranks.py``.

Started once per rank as a cluster launcher starts processes (``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` in the environment; Lightning then creates no processes of its own). The run:
eager backend, ``warmup_steps=2`` (steps 0 and 1 eager, capture in step 2, replays after), validation every 3
steps (2 batches, ``val_loss`` reduced with ``sync_dist``), a ``ModelCheckpoint`` every 3 steps, ``hpc``
checkpoints in ``--out``.

* ``--stop PHASE``: rank ``--victim`` (default 1) writes the time to ``OUT/stopped`` and stops itself (SIGSTOP;
  ``--kill``: SIGKILL; ``--error``: raises ``ValueError``) in that phase: ``warmup`` (start of step 1), ``replay``
  (start of step 4), ``validation`` (first validation batch), ``checkpoint`` (inside the first checkpoint's
  ``on_save_checkpoint``).
* ``--lag S``: rank ``--lag-rank`` (default 0) sleeps S s where the victim stops (it reaches the next collective S s
  later than the others).
* ``--step-sleep S``: every rank sleeps ``S`` s after each batch and writes its step to ``OUT/step{rank}`` (the test
  sends SIGTERM to the whole job while it trains).
* Rank 0 writes ``OUT/result{tag}.pt`` however ``fit`` ends: ``losses`` (one per batch taken), ``state`` (the
  weights), ``global_step``, ``error`` (the exception's type and message, or ``None``).

``--fork SPEC``: import everything once, then fork one process per entry of the JSON list ``SPEC`` (``env``,
``argv``, ``log``), each a rank that ends as the program would (exceptions, exit status, interpreter shutdown);
write ``pid`` lines to ``SPEC.pids`` and ``pid exit-status time`` lines to ``SPEC.exits`` as they end. Several
two-process jobs then start in the time of one import instead of one per process (2 CPU cores in CI).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

import cg_lightning
from cg_lightning.examples.data import TextDataModule
from cg_lightning.examples.gpt import GPTLightningModule
MODEL = dict(n_layer=2, d_model=32, n_head=2, block_size=16, lr=3e-3)  # tests.helpers.MODEL
DATA = dict(block_size=16, batch_size=4, max_bytes=60 * 17, val_fraction=0.2)  # 6 batches per rank and epoch


class Faults(Callback):
    """Records losses; stops rank 1 in the chosen phase; sleeps and reports progress after each batch."""

    def __init__(self, out: str, stop: str, step_sleep: float, victim: int = 1, how: str = "stop",
                 lag: float = 0.0, lag_rank: int = 0) -> None:
        self.out, self.stop, self.step_sleep, self.victim, self.how = out, stop, step_sleep, victim, how
        self.lag, self.lag_rank = lag, lag_rank
        self.losses = []

    def _stop_here(self, trainer, phase: str) -> None:
        if self.stop == phase and self.lag and trainer.global_rank == self.lag_rank:
            time.sleep(self.lag)
        if self.stop == phase and trainer.global_rank == self.victim:
            with open(os.path.join(self.out, "stopped"), "w") as f:
                f.write(repr(time.time()))
            if self.how == "error":
                raise ValueError("a bad batch (on purpose)")
            os.kill(os.getpid(), signal.SIGKILL if self.how == "kill" else signal.SIGSTOP)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == {"warmup": 1, "replay": 4}.get(self.stop):
            self._stop_here(trainer, self.stop)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._stop_here(trainer, "validation")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._stop_here(trainer, "checkpoint")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"].detach()))
        if self.step_sleep:
            with open(os.path.join(self.out, f"step{trainer.global_rank}"), "w") as f:
                f.write(str(trainer.global_step))
            time.sleep(self.step_sleep)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", default="")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--timeout-s", type=float, default=3.0)
    ap.add_argument("--stop", default="none", choices=["none", "warmup", "replay", "validation", "checkpoint"])
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--kill", dest="how", action="store_const", const="kill", default="stop")
    ap.add_argument("--error", dest="how", action="store_const", const="error")
    ap.add_argument("--lag", type=float, default=0.0)
    ap.add_argument("--lag-rank", type=int, default=0)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--ckpt-path", default=None)
    ap.add_argument("--devices", type=int, default=2)
    a = ap.parse_args(argv)

    seed_everything(7, workers=True)
    model = GPTLightningModule(**MODEL)
    faults = Faults(a.out, a.stop, a.step_sleep, a.victim, a.how, a.lag, a.lag_rank)
    strategy = cg_lightning.CUDAGraphDDPStrategy(graphs={"warmup_steps": 2, "backend": "eager"},
                                                 ddp={"timeout_s": a.timeout_s})
    trainer = Trainer(
        accelerator="cpu", devices=a.devices, strategy=strategy, max_steps=a.steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, val_check_interval=3, limit_val_batches=2,
        default_root_dir=a.out,
        callbacks=[faults, ModelCheckpoint(dirpath=os.path.join(a.out, "ckpts"), every_n_train_steps=3,
                                           save_top_k=-1)],
    )
    error = None
    try:
        trainer.fit(model, datamodule=TextDataModule(**DATA), ckpt_path=a.ckpt_path)
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        print(f"fit ended at {time.time()!r}", flush=True)
        raise
    finally:
        if trainer.global_rank == 0:
            torch.save({"losses": faults.losses, "global_step": trainer.global_step, "error": error,
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}},
                       os.path.join(a.out, f"result{a.tag}.pt"))


def fork(spec_path: str) -> None:
    """The ``--fork`` launcher (see the module docstring); returns in each child, to run its rank."""
    with open(spec_path) as f:
        ranks = json.load(f)
    children = {}
    gc.freeze()  # the imported modules' objects stay out of the children's collections (fewer copied pages)
    for rank in ranks:
        pid = os.fork()
        if pid == 0:
            fd = os.open(rank["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.update(rank["env"])
            main(rank["argv"])
            sys.exit(0)
        children[pid] = rank
        with open(spec_path + ".pids", "a") as f:
            f.write(f"{pid}\n")
    while children:
        pid, status = os.wait()
        children.pop(pid, None)
        with open(spec_path + ".exits", "a") as f:
            f.write(f"{pid} {os.waitstatus_to_exitcode(status)} {time.time()!r}\n")
    sys.exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "--fork":
        fork(sys.argv[2])
    else:
        main()
