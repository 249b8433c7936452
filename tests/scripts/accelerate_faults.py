"""One process of an Accelerate job under ``CUDAGraphAccelerator`` (CPU, gloo), for ``tests/test_faults_ranks.py``.

Started by torchrun, or directly with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set
(as a cluster launcher starts each task). Trains the small model of ``accelerate_cases.py`` (two graphed blocks,
``warmup_steps=2``, eager backend) for ``--steps`` optimizer steps on batches chosen by step and rank (no loader:
a resumed run needs to skip nothing), AdamW; ``ddp.timeout_s`` from ``--timeout-s``. After every step the loop
follows the preemption recipe of ``docs/accelerate.md``: ``check_preemption()``, then ``save_state(--ckpt)`` and
``exit_preempted()``.

* ``--stop-rank R --stop-step S``: rank R writes the time to ``OUT/stopped`` and stops itself (SIGSTOP) before
  step S.
* ``--step-sleep S``: every rank writes its completed steps to ``OUT/step{rank}`` and sleeps S s after each step.
* ``--resume``: ``load_state(--ckpt)`` first and continue from the saved step.

Every rank writes its pid to ``OUT/pid{rank}``, and on an exception ``OUT/error{rank}.txt`` (the time, then the
exception); rank 0 writes ``OUT/result.pt`` at the end (``losses`` of the steps it ran, ``start``, ``state``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from cg_lightning.accelerate import CUDAGraphAccelerator
from tests.scripts.accelerate_cases import T, V, Net, _loss


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, V, (4, T), generator=g), torch.randint(0, V, (4, T), generator=g)


def train(a, acc: CUDAGraphAccelerator) -> None:
    rank = acc.process_index
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    start = 0
    if a.resume:
        acc.load_state(a.ckpt)
        start = acc.step  # micro-batches taken under accumulate(): one per step here
    losses = []
    for step in range(start, a.steps):
        if step == a.stop_step and rank == a.stop_rank:
            with open(os.path.join(a.out, "stopped"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        x, y = batch(step, rank)
        with acc.accumulate(model):
            loss = _loss(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
        if a.step_sleep:
            with open(os.path.join(a.out, f"step{rank}"), "w") as f:
                f.write(str(step + 1))
            time.sleep(a.step_sleep)
        if acc.sync_gradients and acc.check_preemption():
            acc.save_state(a.ckpt)
            acc.exit_preempted()
    if rank == 0:
        state = {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}
        torch.save({"losses": losses, "start": start, "state": state}, os.path.join(a.out, "result.pt"))
    acc.end_training()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--timeout-s", type=float, default=10.0)
    ap.add_argument("--stop-rank", type=int, default=-1)
    ap.add_argument("--stop-step", type=int, default=-1)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    acc = CUDAGraphAccelerator(cpu=True, graphs={"warmup_steps": 2, "backend": "eager"},
                               ddp={"timeout_s": a.timeout_s})
    rank = acc.process_index
    with open(os.path.join(a.out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    try:
        train(a, acc)
    except Exception as exc:
        path = os.path.join(a.out, f"error{rank}.txt")
        with open(path + ".part", "w") as f:  # renamed when whole: the test reads it as soon as it exists
            f.write(f"{time.time()!r}\n{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        os.replace(path + ".part", path)
        raise


if __name__ == "__main__":
    main()
