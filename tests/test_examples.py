"""CPU tests for the example models (``cg_lightning.examples``), their byte-level data module, and the examples
and configurations as a wheel of the package installs them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, seed_everything

from cg_lightning.examples.data import TextDataModule
from cg_lightning.examples.configs import names as shipped_names
from cg_lightning.examples.gpt import GPT, Block, GPTLightningModule
from tests.helpers import ROOT, make_trainer, subprocess_env

# ---------------------------------------------------------------------- model


def _tiny_gpt(**kw) -> GPT:
    cfg = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, d_model=32)
    cfg.update(kw)
    return GPT(**cfg)


def test_gpt_forward_shape():
    torch.manual_seed(0)
    model = _tiny_gpt()
    idx = torch.randint(0, 256, (3, 16))
    logits = model(idx)
    assert logits.shape == (3, 16, 256)
    assert logits.dtype == torch.float32
    assert len(model.blocks) == 2 and all(isinstance(b, Block) for b in model.blocks)
    # Shorter sequences work, longer ones are refused.
    assert model(idx[:, :5]).shape == (3, 5, 256)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.randint(0, 256, (1, 17)))


def test_block_is_single_tensor_in_out():
    torch.manual_seed(0)
    block = Block(32, 4)
    x = torch.randn(2, 7, 32)
    y = block(x)
    assert isinstance(y, torch.Tensor) and y.shape == x.shape


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = _tiny_gpt().eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gpt_init_is_deterministic_and_scaled():
    torch.manual_seed(1)
    m1 = _tiny_gpt(n_layer=4)
    torch.manual_seed(1)
    m2 = _tiny_gpt(n_layer=4)
    for (n1, p1), (n2, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    blk = m1.blocks[0]
    assert torch.count_nonzero(blk.qkv.bias) == 0
    # Residual projections use std 0.02 / sqrt(2 * n_layer) ~ 0.0071.
    assert blk.fc_out.weight.std().item() < 0.012 < blk.fc_in.weight.std().item()


def test_tie_weights_shares_parameter():
    tied = _tiny_gpt(tie_weights=True)
    assert tied.lm_head.weight is tied.tok_emb.weight
    untied = _tiny_gpt(tie_weights=False)
    assert untied.lm_head.weight is not untied.tok_emb.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 256 * 32


def test_configure_optimizers_groups_and_warmup():
    m = GPTLightningModule(block_size=16, n_layer=1, n_head=2, d_model=32, tie_weights=True,
                           weight_decay=0.1, betas=[0.8, 0.9], warmup_lr_steps=4)
    out = m.configure_optimizers()
    opt, sched = out["optimizer"], out["lr_scheduler"]["scheduler"]
    assert out["lr_scheduler"]["interval"] == "step"
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"])
    assert all(p.ndim < 2 for p in no_decay["params"])
    n_opt = sum(len(g["params"]) for g in opt.param_groups)
    assert n_opt == len(list(m.parameters()))  # tied weight counted once
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([3e-3 * f for f in (0.25, 0.5, 0.75, 1.0, 1.0, 1.0)])
    plain = GPTLightningModule(block_size=16, n_layer=1, n_head=2, d_model=32)
    assert isinstance(plain.configure_optimizers(), torch.optim.AdamW)


# ----------------------------------------------------------------------- data


def _check_batch(batch, batch_size, block_size):
    x, y = batch
    assert x.shape == y.shape == (batch_size, block_size)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token


def test_default_stdlib_data():
    dm = TextDataModule(block_size=32, batch_size=4, max_bytes=200_000)
    dm.setup("fit")
    assert dm.vocab_size == 256
    n_tokens = dm.train_dataset.num_tokens + dm.val_dataset.num_tokens
    assert n_tokens == 200_000
    assert dm.train_dataset.num_tokens == 180_000
    assert len(dm.train_dataset) == 180_000 // 33
    _check_batch(next(iter(dm.train_dataloader())), 4, 32)
    _check_batch(next(iter(dm.val_dataloader())), 4, 32)
    x, _ = dm.train_dataset[0]
    assert 0 <= int(x.min()) and int(x.max()) < 256

    dm2 = TextDataModule(block_size=32, batch_size=4, max_bytes=200_000)
    dm2.setup()
    dm2.setup()  # idempotent
    for i in (0, 7, len(dm.train_dataset) - 1):
        for a, b in zip(dm.train_dataset[i], dm2.train_dataset[i]):
            assert torch.equal(a, b)
    for a, b in zip(next(iter(dm.val_dataloader())), next(iter(dm2.val_dataloader()))):
        assert torch.equal(a, b)


def test_text_file_and_directory(tmp_path):
    text = "hello, wörld! " * 200
    f = tmp_path / "a.txt"
    f.write_text(text, encoding="utf-8")
    raw = text.encode("utf-8")

    dm = TextDataModule(path=str(f), block_size=8, batch_size=2, val_fraction=0.25)
    dm.setup()
    assert dm.train_dataset.num_tokens == int(len(raw) * 0.75)
    x, y = dm.train_dataset[0]
    assert bytes(x.tolist()) == raw[:8] and bytes(y.tolist()) == raw[1:9]
    _check_batch(next(iter(dm.train_dataloader())), 2, 8)

    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_bytes(b"B" * 300)
    (d / "sub" / "c.md").write_bytes(b"C" * 300)
    (d / "a.txt").write_bytes(b"A" * 300)
    (d / "blob.dat").write_bytes(b"\xff\xfe\x80" * 100)  # not UTF-8: skipped
    dm = TextDataModule(path=str(d), block_size=8, batch_size=2, val_fraction=0.1)
    dm.setup()
    total = dm.train_dataset.num_tokens + dm.val_dataset.num_tokens
    assert total == 900
    x, _ = dm.train_dataset[0]
    assert bytes(x.tolist()) == b"A" * 8  # sorted order: a.txt, b.txt, sub/c.md
    x, _ = dm.val_dataset[len(dm.val_dataset) - 1]
    assert set(bytes(x.tolist())) == {ord("C")}

    # max_bytes caps directory reading too.
    dm = TextDataModule(path=str(d), block_size=8, val_fraction=0.5, max_bytes=400)
    dm.setup()
    assert dm.train_dataset.num_tokens + dm.val_dataset.num_tokens == 400


def test_bin_file(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, size=5000).astype(np.uint16)
    ids[123] = 1233
    p = tmp_path / "tokens.bin"
    ids.tofile(p)
    dm = TextDataModule(path=str(p), block_size=16, batch_size=4, val_fraction=0.2)
    assert dm.vocab_size is None
    dm.setup()
    assert dm.vocab_size == 1234
    x, y = dm.train_dataset[1]
    np.testing.assert_array_equal(x.numpy(), ids[17:33].astype(np.int64))
    np.testing.assert_array_equal(y.numpy(), ids[18:34].astype(np.int64))
    x, _ = dm.val_dataset[0]
    np.testing.assert_array_equal(x.numpy(), ids[4000:4016].astype(np.int64))
    _check_batch(next(iter(dm.train_dataloader())), 4, 16)
    _check_batch(next(iter(dm.val_dataloader())), 4, 16)


def test_bin_dataset_with_workers(tmp_path):
    ids = np.arange(2000, dtype=np.uint16)
    p = tmp_path / "tokens.bin"
    ids.tofile(p)
    dm = TextDataModule(path=str(p), block_size=8, batch_size=4, num_workers=1)
    dm.setup()
    x, y = next(iter(dm.val_dataloader()))
    assert x[0, 0].item() == 1800 and y[0, 0].item() == 1801


def test_missing_path_errors(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        TextDataModule(path=str(missing)).setup()
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        TextDataModule(path=str(tmp_path / "nope.bin")).setup()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no UTF-8 text"):
        TextDataModule(path=str(empty)).setup()


def test_too_short_data_errors(tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("x" * 100)
    with pytest.raises(ValueError, match=r"val split .* needs block_size \+ 1 = 33"):
        TextDataModule(path=str(f), block_size=32, val_fraction=0.1).setup()
    with pytest.raises(ValueError, match=r"train split .* needs block_size \+ 1 = 129"):
        TextDataModule(path=str(f), block_size=128).setup()
    b = tmp_path / "short.bin"
    np.arange(10, dtype=np.uint16).tofile(b)
    with pytest.raises(ValueError, match="train split"):
        TextDataModule(path=str(b), block_size=16).setup()


def test_no_validation_split(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("abc" * 100)
    dm = TextDataModule(path=str(f), block_size=8, val_fraction=0.0)
    dm.setup()
    assert dm.val_dataset is None and dm.val_dataloader() == []
    assert dm.train_dataset.num_tokens == 300


# -------------------------------------------------------------------- training


class _LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_short_fit_reduces_loss():
    seed_everything(0)
    dm = TextDataModule(block_size=32, batch_size=8, max_bytes=200_000)
    model = GPTLightningModule(vocab_size=256, block_size=32, n_layer=2, n_head=4, d_model=64,
                               lr=3e-3)
    rec = _LossRecorder()
    trainer = make_trainer("auto", 30, [rec], limit_val_batches=2)
    trainer.fit(model, datamodule=dm)
    assert len(rec.losses) == 30
    first, last = np.mean(rec.losses[:3]), np.mean(rec.losses[-3:])
    assert first > 5.0  # ~ln(256) at init
    assert last < first - 1.0, rec.losses
    metrics = trainer.validate(model, datamodule=dm, verbose=False)
    assert metrics[0]["val_loss"] < first


def test_llama_example_trains_graphed_as_ddp():
    """cg_lightning/examples/llama.py (the model of the shipped llama_tiny configuration) on the default text: its
    decoder layers graphed by the default selection, weights equal to ``"ddp"`` bit for bit."""
    pytest.importorskip("transformers")
    from cg_lightning.examples.llama import LlamaLightningModule
    from tests.helpers import cg_strategy

    models, trainers = [], []
    for strategy in ("ddp", cg_strategy("eager", whole_step=False)):
        seed_everything(0)
        dm = TextDataModule(block_size=32, batch_size=4, max_bytes=100_000)
        models.append(LlamaLightningModule(block_size=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32))
        trainers.append(make_trainer(strategy, 5))
        trainers[-1].fit(models[-1], datamodule=dm)
    stats = trainers[1].strategy.last_graph_stats
    assert stats.captured_runners == 2 and stats.forward_replays == 2 * 3, stats
    for (name, a), b in zip(models[1].state_dict().items(), models[0].state_dict().values()):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------- the package as a wheel installs it


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, Path]:
    """A wheel of this tree (built from a copy of it: the build leaves nothing in the checkout) and the folder it
    was installed into, not editable: ``(wheel file, site folder)``."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(os.path.join(ROOT, "cg_lightning"), src / "cg_lightning",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), src / name)

    def pip(*args: str) -> None:
        done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    pip("wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"))
    [built] = (tmp / "dist").glob("*.whl")
    pip("install", "--no-deps", "--target", str(tmp / "site"), str(built))
    return built, tmp / "site"


def test_wheel_ships_the_examples_and_their_configurations(wheel):
    names = set(zipfile.ZipFile(wheel[0]).namelist())
    modules = {f"cg_lightning/examples/{m}.py" for m in ("__init__", "gpt", "data", "llama", "resumable")}
    configs = {f"cg_lightning/examples/configs/{n}.yaml" for n in shipped_names()}
    assert {"gpt_tiny", "gpt_small", "gpt_small_multigpu", "llama_tiny"} <= set(shipped_names())
    assert modules | configs <= names, sorted((modules | configs) - names)


@pytest.mark.timeout(300)
def test_installed_wheel_runs_the_main_job_from_another_directory(wheel, tmp_path):
    """What a user of ``pip install cg-lightning`` runs: the shipped config found by name, trained from a directory
    that is not the repository, with the installed package only on the path."""
    env = subprocess_env(PYTHONPATH=str(wheel[1]))

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=240)

    found = run("-m", "cg_lightning.examples.configs", "gpt_tiny")
    assert found.returncode == 0, found.stderr[-2000:]
    config = found.stdout.strip()
    assert Path(config).is_file() and Path(config).is_relative_to(wheel[1]), config
    fit = run("-m", "cg_lightning", "fit", "--config", config, "--trainer.max_steps=2",
              "--data.init_args.max_bytes=200000", "--trainer.enable_progress_bar=false")
    assert fit.returncode == 0, fit.stdout[-2000:] + fit.stderr[-4000:]
    run_dir = tmp_path / "runs" / "lightning_logs" / "version_0"
    assert (run_dir / "config.yaml").is_file() and (run_dir / "checkpoints" / "epoch=0-step=2.ckpt").is_file()
