"""The callbacks (:mod:`cg_lightning.callbacks`): ``CUDAGraphCallback`` (the capture schedule, kept in checkpoints)
and ``GraphMonitor`` (graph metrics for the logger and the progress bar), under ``strategy="cudagraph_ddp"``."""

import csv
import glob

import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import cg_lightning
from cg_lightning.callbacks import CUDAGraphCallback, GraphMonitor
from cg_lightning.callbacks.monitor import graph_state
from cg_lightning.graphs import GraphStats
from cg_lightning.examples.data import TextDataModule
from cg_lightning.examples.gpt import GPTLightningModule
from tests.helpers import MODEL, PARITY_MODEL, cg_strategy, fit_gpt, make_trainer


def _strategy(**graphs):
    """Per-layer graphs (what these tests count), one warmup step unless ``graphs`` says otherwise."""
    return cg_strategy(**{"warmup_steps": 1, "whole_step": False, **graphs})


def test_callback_overrides_strategy_warmup_steps():
    strategy = _strategy(warmup_steps=3)
    _fit_with(strategy, [], steps=6)
    assert strategy.last_graph_stats.forward_replays == 2 * (6 - 3)
    strategy = _strategy(warmup_steps=3)
    _fit_with(strategy, [CUDAGraphCallback(warmup_steps=1, shape_policy="recapture")], steps=6)
    assert strategy.graph_options.warmup_steps == 1 and strategy.graph_options.shape_policy == "recapture"
    assert strategy.last_graph_stats.forward_replays == 2 * (6 - 1)
    with pytest.raises(ValueError, match="shape_policy"):
        CUDAGraphCallback(shape_policy="sometimes")


def _fit_with(strategy, callbacks, steps, ckpt_path=None, root=None, logger=False, progress=False):
    model, rec, trainer, _ = fit_gpt(
        strategy, steps, model=PARITY_MODEL, data=dict(block_size=32, batch_size=4, max_bytes=2000),
        callbacks=callbacks, ckpt_path=ckpt_path, logger=logger,
        enable_checkpointing=any(type(c).__name__ == "ModelCheckpoint" for c in callbacks),
        enable_progress_bar=progress, default_root_dir=root, log_every_n_steps=1,
    )
    return model, rec, trainer


def test_callback_state_round_trips_and_resume_recaptures(tmp_path):
    strategy = _strategy(warmup_steps=3)
    first = CUDAGraphCallback(warmup_steps=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2, save_top_k=-1)
    _fit_with(strategy, [first, ckpt], steps=4, root=tmp_path)
    assert strategy.last_graph_stats.captures == 1
    assert strategy.last_graph_stats.forward_replays == 2 * (4 - 1)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"]["CUDAGraphCallback"]
    assert saved["captures"] == 1
    assert saved["options"]["warmup_steps"] == 1 and saved["options"]["shape_policy"] == "eager"
    assert len(saved["signatures"]) == 1 and "Tensor[4, 32, 64]" in saved["signatures"][0]

    # resume with a callback given no arguments: the saved schedule (warmup 1) beats the strategy's 3
    strategy = _strategy(warmup_steps=3)
    resumed = CUDAGraphCallback()
    _, rec, trainer = _fit_with(strategy, [resumed], steps=8, ckpt_path=str(tmp_path / "last.ckpt"), root=tmp_path)
    assert trainer.global_step == 8 and len(rec.losses) == 4
    assert strategy.graph_options.warmup_steps == 1
    stats = strategy.last_graph_stats
    assert stats.captures == 1  # captured again after the resume ...
    assert stats.forward_replays == 2 * (8 - 5)  # ... at step 5: one warmup step counted from step 4
    assert resumed.captures == 2 and resumed.state_dict()["captures"] == 2
    assert resumed.signatures == saved["signatures"]


def test_graph_monitor_metrics_and_progress_bar(tmp_path):
    class BarProbe(Callback):
        def __init__(self):
            self.states, self.bar = [], None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.bar = trainer.progress_bar_callback
            self.states.append(self.bar.get_metrics(trainer, pl_module).get("graphs"))

    strategy = _strategy(warmup_steps=2)
    probe = BarProbe()
    _fit_with(strategy, [GraphMonitor(log_every_n_steps=2), probe], steps=8, logger=CSVLogger(tmp_path),
              progress=True)
    rows = list(csv.DictReader(open(glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)[0])))
    logged = [r for r in rows if r.get("graphs/captured")]
    assert logged, rows[:3]
    last = logged[-1]
    for key in ("graphs/capture_s", "graphs/replays_per_step", "graphs/step_time_ms", "graphs/pool_bytes",
                "graphs/sets", "graphs/eager_fallbacks"):
        assert last.get(key) not in (None, ""), key
    assert float(last["graphs/captured"]) == 2.0 and float(last["graphs/replays_per_step"]) == 2.0
    assert float(last["graphs/capture_s"]) > 0 and float(last["graphs/step_time_ms"]) > 0
    assert float(last["graphs/pool_bytes"]) == 0.0  # CPU: no device memory
    assert probe.states[0] == "eager" and probe.states[-1] == "captured 2"
    assert "get_metrics" not in probe.bar.__dict__  # the wrapper is removed at teardown


def test_graph_state_text():
    assert graph_state(GraphStats()) == "eager"
    assert graph_state(GraphStats(captured_runners=4, graph_sets=2, fallback_calls=2)) == "captured 4 in 2 sets, fallback"
    assert graph_state(GraphStats(captured_runners=2, failed_layers=["layers.1"])) == "captured 2, fallback"


def test_graph_monitor_metrics_reach_csv_logger(tmp_path):
    seed_everything(3)
    trainer = make_trainer(cg_lightning.CUDAGraphDDPStrategy(graphs={"warmup_steps": 2, "whole_step": False}), 12,
                           [GraphMonitor(log_every_n_steps=4)], logger=CSVLogger(tmp_path), log_every_n_steps=1)
    trainer.fit(GPTLightningModule(**MODEL),
                datamodule=TextDataModule(block_size=16, batch_size=2, max_bytes=60_000))
    rows = list(csv.DictReader(open(glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)[0])))
    logged = [r for r in rows if r.get("graphs/captured")]
    assert logged, rows[:3]
    assert float(logged[-1]["graphs/captured"]) == 2.0
    assert float(logged[-1]["graphs/replays_per_step"]) == 2.0
    assert float(logged[-1]["graphs/capture_s"]) > 0
