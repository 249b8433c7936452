"""A Lightning Fabric training loop, run under Fabric's ``"ddp"`` and under ``"cudagraph_ddp"`` on the same seed and
data (``tests/test_fabric.py``): accumulation with ``fabric.no_backward_sync``, clipping with
``fabric.clip_gradients``, ``fabric.save`` / ``fabric.load``. In-process with one device (:func:`train`), or as a
script with two (``fabric.launch()`` starts the second process; rank 0 writes the result to ``--out``).

As a script, ``--stop-rank R --stop-step S --faults DIR``: rank R writes the time to ``DIR/stopped`` and stops
itself (SIGSTOP) before step S; every rank writes its pid to ``DIR/pid{rank}`` and, on an exception,
``DIR/error{rank}.txt`` (the time, then ``Type: message``); ``ddp.timeout_s`` is ``--timeout-s``."""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import time
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

from tests.lightning_models import BATCH, dataset, make_body  # noqa: E402

VOCAB, SEQ = 64, 16


def _llama() -> torch.nn.Module:
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False, attn_implementation="eager"))


def _data(model: str):
    if model == "llama":
        ids = torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(1))
        return torch.utils.data.TensorDataset(ids)
    return dataset(64)


def _loss(model_name: str, model, batch) -> torch.Tensor:
    if model_name == "llama":
        (ids,) = batch
        return model(input_ids=ids, labels=ids).loss
    x, y = batch
    return F.mse_loss(model(x), y)


def train(strategy: Any, *, precision: str = "32-true", devices: int = 1, accelerator: str = "cpu",
          **run: Any) -> Dict[str, Any]:
    """Train under a new ``Fabric`` (:func:`run_loop` takes ``run``)."""
    fabric = Fabric(accelerator=accelerator, devices=devices, strategy=strategy, precision=precision)
    if not os.environ.get("LT_CLI_USED"):  # `fabric run` started the processes itself
        fabric.launch()
    return run_loop(fabric, **run)


def _optimizer_state(fabric: Fabric, opt) -> Dict[str, Any]:
    """``opt``'s state; under ``ddp.distributed_optimizer`` every rank's shard joined into the full state."""
    from cg_lightning.optim.sharded_state import full_state_dict, is_shard

    state = opt.state_dict()
    if is_shard(state):
        shards = [None] * fabric.world_size
        if fabric.world_size > 1:
            torch.distributed.all_gather_object(shards, state)
        else:
            shards = [state]
        state = full_state_dict(shards)
    return {"state": {k: {n: v.cpu() for n, v in s.items()} for k, s in state["state"].items()}}


def run_loop(fabric: Fabric, *, model: str = "parity", steps: int = 6, accumulate: int = 1,
             clip: Optional[float] = None, save: Optional[str] = None, save_at: int = 0, resume: Optional[str] = None,
             stop: Optional[Callable[[int, int], None]] = None) -> Dict[str, Any]:
    """Train for ``steps`` optimizer steps of ``accumulate`` micro-batches each; returns the losses (rank 0's), the
    final parameters, the optimizer state and, under the engine, its graph counters (``stats``)."""
    fabric.seed_everything(0)
    net = _llama() if model == "llama" else make_body("modulelist")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net, opt = fabric.setup(net, opt)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(_data(model), batch_size=BATCH))
    batches = list(loader)
    start = 0
    if resume is not None:
        state = {"model": net, "optimizer": opt, "step": 0}
        fabric.load(resume, state)
        start = state["step"]
    losses = []
    cycle = itertools.islice(itertools.cycle(batches), start * accumulate, None)
    for step in range(start, steps):
        if stop is not None:
            stop(step, fabric.global_rank)
        for micro in range(accumulate):
            batch = next(cycle)
            with fabric.no_backward_sync(net, enabled=micro < accumulate - 1):
                loss = _loss(model, net, batch)
                fabric.backward(loss / accumulate)
            losses.append(loss.detach().float())
        if clip is not None:  # a GradScaler's first steps overflow (16-mixed) and are skipped: no error for them
            fabric.clip_gradients(net, opt, max_norm=clip, error_if_nonfinite=False)
        opt.step()
        opt.zero_grad()
        if save is not None and step + 1 == save_at:
            fabric.save(save, {"model": net, "optimizer": opt, "step": step + 1})
    engine = net._forward_module
    stats = engine.graph_stats if hasattr(engine, "graph_stats") else None
    result = {
        "losses": torch.stack(losses).cpu(),
        "weights": {n: p.detach().cpu() for n, p in net.named_parameters()},
        "optimizer": _optimizer_state(fabric, opt),
        "scaler": getattr(fabric._precision, "scaler", None) is not None,
        "stats": None if stats is None else {"forward_replays": stats.forward_replays,
                                             "captured_runners": stats.captured_runners},
        "world_size": fabric.world_size,
    }
    fabric.barrier()
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--use", required=True, help="the strategy: ddp or cudagraph_ddp")
    # none of `fabric run`'s own option names (--precision, --devices, --strategy ...): it would take them
    ap.add_argument("--net", default="parity")
    ap.add_argument("--amp", default="32-true", help="Fabric's precision")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--stop-rank", type=int, default=-1)
    ap.add_argument("--stop-step", type=int, default=-1)
    ap.add_argument("--faults", default=None, help="folder for pid, stopped and error files")
    ap.add_argument("--distributed-optimizer", action="store_true", help="ddp.distributed_optimizer on")
    ap.add_argument("--save", default=None, help="a checkpoint saved after --save-at steps")
    ap.add_argument("--save-at", type=int, default=3)
    ap.add_argument("--then-resume", action="store_true",
                    help="then train a new model from the checkpoint, in the same processes, into out['resumed']")
    a = ap.parse_args()
    strategy: Any = a.use
    if strategy == "cudagraph_ddp":
        from cg_lightning.fabric import CUDAGraphDDPStrategy

        strategy = CUDAGraphDDPStrategy(graphs={"warmup_steps": 1}, ddp={
            "timeout_s": a.timeout_s, "distributed_optimizer": a.distributed_optimizer})

    def stop(step: int, rank: int) -> None:
        if a.faults is None:
            return
        with open(os.path.join(a.faults, f"pid{rank}"), "w") as f:
            f.write(str(os.getpid()))
        if step == a.stop_step and rank == a.stop_rank:
            with open(os.path.join(a.faults, "stopped"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)

    try:
        fabric = Fabric(accelerator="cpu", devices=a.processes, strategy=strategy, precision=a.amp)
        if not os.environ.get("LT_CLI_USED"):  # `fabric run` started the processes itself
            fabric.launch()
        loop = dict(model=a.net, accumulate=a.accumulate, clip=a.clip, steps=a.steps)
        out = run_loop(fabric, **loop, stop=stop, save=a.save, save_at=a.save_at)
        if a.then_resume:
            out["resumed"] = run_loop(fabric, **loop, resume=a.save)
    except Exception as exc:
        if a.faults is not None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            path = os.path.join(a.faults, f"error{rank}.txt")
            with open(path + ".part", "w") as f:  # renamed when whole: the test reads it as soon as it exists
                f.write(f"{time.time()!r}\n{type(exc).__name__}: {exc}")
            os.replace(path + ".part", path)
        raise
    if torch.distributed.get_rank() == 0:
        torch.save(out, a.out)
