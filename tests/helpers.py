"""Shared test helpers: train the example GPT under a strategy and collect what the tests compare."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

import cg_lightning  # noqa: F401  (registers the strategy name)
from examples.data import TextDataModule
from examples.gpt import GPTLightningModule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_parity.py")


class GradRecorder(Callback):
    """Records losses every step, every parameter's gradient (``.grad``) at chosen global steps, and (under
    ``cudagraph_ddp``) the engine's grad-ready counts by parameter name at every optimizer step."""

    def __init__(self, at_steps=(), record_batches: bool = False) -> None:
        self.losses: List[float] = []
        self.ready_counts: List[Dict[str, int]] = []
        self.record_batches = record_batches
        self.batches: list = []
        self.at_steps = set(at_steps)
        self.grads: Dict[int, Dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.record_batches:
            self.batches.append([t.detach().clone() for t in batch])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if outputs is None or "loss" not in outputs:  # a batch the LightningModule skipped (returned None)
            self.losses.append(float("nan"))
            return
        self.losses.append(float(outputs["loss"].detach()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            self.ready_counts.append(dict(engine.last_ready_counts))
        if trainer.global_step in self.at_steps:
            self.grads[trainer.global_step] = {
                n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None
            }


def train_in_process(strategy, steps: int = 20, seed: int = 7, at_steps=(), precision="32-true",
                     accelerator="cpu", model_kwargs=None, data_kwargs=None, accumulate=1, record_batches=False):
    """One-process fit of a tiny GPT; returns (model, recorder, trainer)."""
    seed_everything(seed, workers=True)
    mk = dict(n_layer=2, d_model=64, n_head=4, block_size=32, lr=3e-3)
    mk.update(model_kwargs or {})
    dk = dict(block_size=mk["block_size"], batch_size=4, max_bytes=300_000)
    dk.update(data_kwargs or {})
    model = GPTLightningModule(**mk)
    data = TextDataModule(**dk)
    rec = GradRecorder(at_steps, record_batches)
    trainer = Trainer(
        accelerator=accelerator, devices=1, strategy=strategy, precision=precision, max_steps=steps,
        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[rec],
    )
    trainer.fit(model, datamodule=data)
    return model, rec, trainer


_DIST_VARS = {"MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE",
              "GROUP_RANK", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_subprocess(out: str, *args: str, timeout: float = 240) -> dict:
    """Run tests/scripts/train_parity.py (which may launch several processes); return its saved dict."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env.update(PYTHONPATH=ROOT, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--out", out, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(f"training script failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return torch.load(out)


def train_plain_pytorch(batches, seed: int = 7, model_kwargs=None, accumulate: int = 1, device="cpu"):
    """The eager reference without Lightning: the GPT of :func:`train_in_process` (same seed, so same init),
    its AdamW, one optimizer step per ``accumulate`` batches of ``batches`` (as Lightning scales the loss:
    divided by ``accumulate``). Returns (model, per-micro-batch losses divided by ``accumulate``, the value
    Lightning hands to ``on_train_batch_end`` as ``outputs["loss"]``)."""
    seed_everything(seed, workers=True)
    mk = dict(n_layer=2, d_model=64, n_head=4, block_size=32, lr=3e-3)
    mk.update(model_kwargs or {})
    model = GPTLightningModule(**mk).to(device)
    opt = model.configure_optimizers()
    losses = []
    for i, batch in enumerate(batches):
        loss = model._loss([t.to(device) for t in batch]) / accumulate
        losses.append(float(loss.detach()))
        loss.backward()
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model, losses


def max_rel_diff(a, b) -> float:
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    return float(((a - b).abs() / b.abs().clamp_min(1e-12)).max())


def state_rel_diffs(sa: Dict[str, torch.Tensor], sb: Dict[str, torch.Tensor], drop_key_bias: bool = False) -> Dict[str, float]:
    """||a-b|| / ||b|| per tensor. ``drop_key_bias``: of a fused ``*.qkv.bias`` (3d entries) compare only the q and v
    thirds; the key bias's true gradient is 0 (softmax ignores a shift shared by all keys), so AdamW turns
    rounding noise there into full-size steps of either sign, and two exact engines may still differ there."""
    assert sa.keys() == sb.keys()
    out = {}
    for k in sa:
        a, b = sa[k].detach().cpu().double(), sb[k].detach().cpu().double()
        if drop_key_bias and k.endswith("qkv.bias"):
            d = b.numel() // 3
            a, b = torch.cat([a[:d], a[2 * d:]]), torch.cat([b[:d], b[2 * d:]])
        out[k] = float((a - b).norm() / b.norm().clamp_min(1e-12))
    return out


def state_rel_diff(sa: Dict[str, torch.Tensor], sb: Dict[str, torch.Tensor]) -> float:
    """max over tensors of ||a-b|| / ||b||."""
    assert sa.keys() == sb.keys()
    worst = 0.0
    for k in sa:
        a, b = sa[k].detach().cpu().double(), sb[k].detach().cpu().double()
        worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-12)))
    return worst
