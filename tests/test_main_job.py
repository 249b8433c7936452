"""The main job end to end through the CLI: configs/gpt_tiny.yaml, short run, the logged loss falls."""

import csv
import glob
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, local_master, subprocess_env


@pytest.mark.timeout(600)
def test_cli_main_job_loss_falls(tmp_path):
    env = subprocess_env(**local_master())
    cmd = [
        sys.executable, "-m", "cg_lightning", "fit", "--config", "configs/gpt_tiny.yaml",
        "--trainer.max_steps=60", "--trainer.val_check_interval=30", "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1", f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
        "--data.init_args.max_bytes=600000",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    metrics = glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)
    assert len(metrics) == 1, metrics
    rows = [r for r in csv.DictReader(open(metrics[0])) if r.get("train_loss")]
    losses = [float(r["train_loss"]) for r in rows]
    assert len(losses) >= 10
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.5, losses
    assert os.path.exists(os.path.join(os.path.dirname(metrics[0]), "config.yaml"))


def test_cli_refuses_bad_config_before_training(tmp_path):
    """The exit status of a configuration error, from a real process (the messages: tests/test_cli_errors.py)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_step: 5\n")
    proc = subprocess.run(
        [sys.executable, "-m", "cg_lightning", "fit", "--config", "configs/gpt_tiny.yaml", "--config", str(bad)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert f"error: {bad}: trainer.max_step: unknown key (did you mean 'max_steps'?)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_refuses_data_windows_longer_than_the_model_context(tmp_path):
    """data.init_args.block_size above the model's: one error line naming both keys and their sources, exit 2,
    before any training step (unchecked, the first forward would fail with a traceback)."""
    env = subprocess_env(**local_master())
    proc = subprocess.run(
        [sys.executable, "-m", "cg_lightning", "fit", "--config", "configs/gpt_tiny.yaml",
         "--data.init_args.block_size=256", "--data.init_args.max_bytes=600000",
         f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("error: command line: data.init_args.block_size: 256 is longer than the model's context, "
            "model.init_args.block_size: 128") in proc.stderr
    assert "(model.init_args.block_size from configs/gpt_tiny.yaml)" in proc.stderr
    assert "Traceback" not in proc.stderr and not glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)
