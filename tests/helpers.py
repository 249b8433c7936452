"""Shared test code: the constants the tests share, builders of strategies and Trainers, the training runs the
tests compare and the comparisons. Engine-level runs (no Lightning) are in :mod:`tests.engine_models`."""

from __future__ import annotations

import os
import socket
from typing import Dict

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

import cg_lightning  # registers the strategy name
from cg_lightning.examples.data import TextDataModule
from cg_lightning.examples.gpt import GPTLightningModule
from tests.recorders import GradRecorder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_parity.py")

WARMUP = 2  # graphs.warmup_steps of most Trainer runs: steps 0 and 1 eager, capture in step 2
# The example GPT most Trainer tests train (2 blocks, d=32, T=16) and its text data.
MODEL = dict(n_layer=2, d_model=32, n_head=2, block_size=16, lr=3e-3)
N_LAYER = MODEL["n_layer"]
DATA = dict(block_size=16, batch_size=4, max_bytes=100_000)
# The GPT of train_in_process and of tests/scripts/train_parity.py's defaults (2 blocks, d=64, T=32).
PARITY_MODEL = dict(n_layer=2, d_model=64, n_head=4, block_size=32, lr=3e-3)
EPOCH_BATCHES = 10  # batches per epoch of fit_whole_epochs

# (accelerator, graph backend): the eager backend on CPU everywhere, real CUDA graphs on the GPU machine
DEVICES = [pytest.param("cpu", "eager", id="cpu"), pytest.param("gpu", "cuda", marks=pytest.mark.cuda, id="cuda")]


def cg_strategy(backend: str = "eager", warmup_steps: int = WARMUP, ddp=None, **graphs):
    """``CUDAGraphDDPStrategy(graphs={"warmup_steps": ..., "backend": ..., **graphs}, ddp=ddp)``."""
    return cg_lightning.CUDAGraphDDPStrategy(graphs={"warmup_steps": warmup_steps, "backend": backend, **graphs},
                                             ddp=ddp)


def strategy_for(name: str, backend: str = "eager", **graphs):
    """Lightning's ``"ddp"`` for ``name == "ddp"``, else :func:`cg_strategy` with ``graphs``."""
    return "ddp" if name == "ddp" else cg_strategy(backend, **graphs)


def make_trainer(strategy, steps: int, callbacks=(), *, accelerator: str = "cpu", validation: bool = False,
                 **overrides) -> Trainer:
    """A one-device Trainer of ``steps`` optimizer steps without logger, checkpoints, progress bar or model summary.

    ``validation=False`` also turns off the sanity check and validation (``num_sanity_val_steps=0``,
    ``limit_val_batches=0``); ``True`` keeps Lightning's defaults. ``overrides`` win over all of these."""
    kwargs = dict(accelerator=accelerator, devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False)
    if not validation:
        kwargs.update(num_sanity_val_steps=0, limit_val_batches=0)
    kwargs.update(overrides)
    return Trainer(strategy=strategy, callbacks=list(callbacks), **kwargs)


def fit_gpt(strategy, steps: int, *, model_cls=GPTLightningModule, model=MODEL, model_kwargs=None, data=DATA,
            seed: int = 7, callbacks=(), ckpt_path=None, **trainer_kwargs):
    """Seed, build ``model_cls(**model, **model_kwargs)`` and ``TextDataModule(**data)`` and fit them with
    :func:`make_trainer` (``trainer_kwargs``) and a :class:`GradRecorder` first among the callbacks.
    Returns (model, recorder, trainer, datamodule)."""
    seed_everything(seed, workers=True)
    module = model_cls(**{**model, **(model_kwargs or {})})
    datamodule = TextDataModule(**data)
    rec = GradRecorder()
    trainer = make_trainer(strategy, steps, [rec, *callbacks], **trainer_kwargs)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return module, rec, trainer, datamodule


def fit_whole_epochs(strategy, steps: int, callbacks=(), ckpt_path=None, model_kwargs=None, **trainer_kwargs):
    """The PARITY_MODEL GPT with a per-step LR warmup (``model_kwargs`` override) on 40 windows of 33 bytes, 4 per
    batch: exactly EPOCH_BATCHES batches per epoch, no validation split (a checkpoint at ``step=EPOCH_BATCHES`` lies
    on an epoch boundary). Returns (model, recorder)."""
    model = {**PARITY_MODEL, "warmup_lr_steps": 15, **(model_kwargs or {})}
    model, rec, trainer, _ = fit_gpt(strategy, steps, model=model,
                                     data=dict(block_size=32, batch_size=4, val_fraction=0.0, max_bytes=40 * 33),
                                     callbacks=callbacks, ckpt_path=ckpt_path, **trainer_kwargs)
    assert trainer.num_training_batches == EPOCH_BATCHES
    assert trainer.global_step == steps
    return model, rec


class EvalGPT(GPTLightningModule):
    """The example GPT with a ``test_step`` (logs ``test_loss``) and a ``predict_step`` (the logits)."""

    def test_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        x, _ = batch
        return self(x)


def train_in_process(strategy, steps: int = 20, seed: int = 7, at_steps=(), precision="32-true",
                     accelerator="cpu", model_kwargs=None, data_kwargs=None, accumulate=1, record_batches=False):
    """One-process fit of the PARITY_MODEL GPT; returns (model, recorder, trainer)."""
    seed_everything(seed, workers=True)
    mk = dict(PARITY_MODEL)
    mk.update(model_kwargs or {})
    dk = dict(block_size=mk["block_size"], batch_size=4, max_bytes=300_000)
    dk.update(data_kwargs or {})
    model = GPTLightningModule(**mk)
    data = TextDataModule(**dk)
    rec = GradRecorder(at_steps, record_batches)
    trainer = make_trainer(strategy, steps, [rec], accelerator=accelerator, precision=precision,
                           accumulate_grad_batches=accumulate)
    trainer.fit(model, datamodule=data)
    return model, rec, trainer


def train_plain_pytorch(batches, seed: int = 7, model_kwargs=None, accumulate: int = 1, device="cpu"):
    """The eager reference without Lightning: the GPT of :func:`train_in_process` (same seed, so same init),
    its AdamW, one optimizer step per ``accumulate`` batches of ``batches`` (as Lightning scales the loss:
    divided by ``accumulate``). Returns (model, per-micro-batch losses divided by ``accumulate``, the value
    Lightning hands to ``on_train_batch_end`` as ``outputs["loss"]``)."""
    seed_everything(seed, workers=True)
    mk = dict(PARITY_MODEL)
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


# ------------------------------------------------------------------------------------------ other processes
DIST_VARS = {"MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE",
             "GROUP_RANK", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(**extra: str) -> dict:
    """This environment without distributed variables (a test may itself run under a launcher), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(extra)
    return env


def local_master() -> dict:
    """``MASTER_ADDR``/``MASTER_PORT`` of a free port on localhost."""
    return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def train_subprocess(out: str, *args: str, timeout: float = 240) -> dict:
    """Run tests/scripts/train_parity.py (``--devices N``: N ranks, forked with torchrun's environment by the
    session's rank server, :func:`tests.launchers.run_ranks`); return its saved dict."""
    from tests.launchers import run_ranks

    nproc = int(args[args.index("--devices") + 1]) if "--devices" in args else 1
    logs = os.path.abspath(out) + ".logs"
    os.makedirs(logs, exist_ok=True)
    run_ranks(SCRIPT, [(["--out", out, *args], nproc)], logs, timeout=timeout)
    return torch.load(out)


# ------------------------------------------------------------------------------------------ comparisons
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
