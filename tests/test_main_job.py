"""The main job end to end through the CLI: the shipped gpt_tiny configuration, short run, the logged loss falls;
and two refusals with their exit status from real processes. The three processes start together
(tests.launchers.StartedTogether)."""

import csv
import glob
import os
import sys

import pytest

from cg_lightning.examples.configs import path as shipped_config
from tests.helpers import local_master, subprocess_env
from tests.launchers import StartedTogether

TINY = shipped_config("gpt_tiny")


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """The module's three CLI processes (started together on first use) and their folders."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in ("main", "bad", "windows")}
    bad = dirs["bad"] / "bad.yaml"
    bad.write_text("trainer:\n  max_step: 5\n")
    fit = [sys.executable, "-m", "cg_lightning", "fit", "--config", TINY]
    started = StartedTogether()
    started.add("main", [*fit, "--trainer.max_steps=60", "--trainer.val_check_interval=30",
                         "--trainer.limit_val_batches=2", "--trainer.log_every_n_steps=1",
                         f"--trainer.default_root_dir={dirs['main']}", "--trainer.enable_progress_bar=false",
                         "--data.init_args.max_bytes=600000"], subprocess_env(**local_master()))
    started.add("bad", [*fit, "--config", str(bad)])
    started.add("windows", [*fit, "--data.init_args.block_size=256", "--data.init_args.max_bytes=600000",
                            f"--trainer.default_root_dir={dirs['windows']}", "--trainer.enable_progress_bar=false"],
                subprocess_env(**local_master()))
    return started, dirs


@pytest.mark.timeout(600)
def test_cli_main_job_loss_falls(cli):
    started, dirs = cli
    proc = started.result("main", timeout=540)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    metrics = glob.glob(str(dirs["main"] / "**" / "metrics.csv"), recursive=True)
    assert len(metrics) == 1, metrics
    rows = [r for r in csv.DictReader(open(metrics[0])) if r.get("train_loss")]
    losses = [float(r["train_loss"]) for r in rows]
    assert len(losses) >= 10
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.5, losses
    assert os.path.exists(os.path.join(os.path.dirname(metrics[0]), "config.yaml"))


@pytest.mark.timeout(600)
def test_cli_refuses_bad_config_before_training(cli):
    """The exit status of a configuration error, from a real process (the messages: tests/test_cli_errors.py)."""
    started, dirs = cli
    proc = started.result("bad")
    bad = dirs["bad"] / "bad.yaml"
    assert proc.returncode == 2
    assert f"error: {bad}: trainer.max_step: unknown key (did you mean 'max_steps'?)" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(600)
def test_cli_refuses_data_windows_longer_than_the_model_context(cli):
    """data.init_args.block_size above the model's: one error line naming both keys and their sources, exit 2,
    before any training step (unchecked, the first forward would fail with a traceback)."""
    started, dirs = cli
    proc = started.result("windows")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("error: command line: data.init_args.block_size: 256 is longer than the model's context, "
            "model.init_args.block_size: 128") in proc.stderr
    assert f"(model.init_args.block_size from {TINY})" in proc.stderr
    assert "Traceback" not in proc.stderr and not glob.glob(str(dirs["windows"] / "**" / "metrics.csv"),
                                                            recursive=True)
