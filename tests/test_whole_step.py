"""``graphs.whole_step``: forward, loss, backward and gradient sync of each training step replayed from one graph.

On a CPU the eager graph backend "replays" by running the captured step function again on the static batch, so
these tests check the bookkeeping against Lightning's ``"ddp"`` bit for bit: the static batch, the step output and
the logged values handed to Lightning, the backward that Lightning's closure no longer runs, the gradients the
optimizer, clipping and the hooks see, the refusals and the fallback to per-layer graphs, the batch-signature
policy. Real CUDA graphs: ``tests/test_cuda_models.py``; two processes: ``tests/test_lightning_parity.py``.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import pytest
import torch
from lightning.pytorch import Callback
from torch.utils.data import DataLoader

from cg_lightning.graphs import GraphSignatureError
from tests.helpers import cg_strategy
from tests.lightning_manual_models import ManualModel
from tests.lightning_models import ParityModel, dataset
from tests.lightning_runs import assert_same, train

STEPS = 8  # warmup steps 0-1, capture in step 2, replays in steps 3-7


def whole_step(**graphs):
    """The strategy with ``graphs.whole_step`` true, unless ``graphs`` says otherwise (``None``: the default)."""
    graphs.setdefault("whole_step", True)
    return cg_strategy(**graphs)


def _cg_warnings(record) -> list:
    return [str(w.message) for w in record if "cg_lightning" in str(w.message)]


def _check(model, expect_replays: Optional[bool] = True, graphs=None, **trainer_kwargs):
    """Train under ``"ddp"`` and under ``graphs.whole_step``; every recorded fact equal. ``expect_replays``: every
    step after warmup and capture replayed (``True``), none captured (``False``), checked by the caller (``None``).
    Returns (strategy, run, cg_lightning warnings)."""
    trainer_kwargs.setdefault("max_steps", STEPS)
    ref = train("ddp", model, **trainer_kwargs)
    strategy = whole_step(**(graphs or {}))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cand = train(strategy, model, **trainer_kwargs)
    assert_same(ref.facts(), cand.facts())
    stats = strategy.last_step_graph_stats
    if expect_replays:
        assert stats.captures == 1 and stats.replays == trainer_kwargs["max_steps"] - 3, stats
    elif expect_replays is not None:
        assert stats.captures == 0 and stats.replays == 0, stats
    return strategy, cand, _cg_warnings(record)


@pytest.mark.parametrize("body, kwargs", [
    ("modulelist", dict(optimizer="adam", scheduler="step")),
    ("linear", dict(optimizer="sgd")),  # no repeated layers: the step is still graphed
    ("sequential", dict(optimizer="adam", scheduler="plateau_step")),  # the scheduler reads the logged train_loss
])
def test_lightning_models_equal_ddp_with_logs_schedulers_and_validation(body, kwargs):
    """Every hook's view (gradients at the optimizer step, outputs, weights, learning rates), the logged values
    (``self.log`` in training_step: per step and per epoch) and validation equal ``"ddp"``'s."""
    strategy, run, warned = _check(functools.partial(ParityModel, body=body, **kwargs), limit_val_batches=2,
                                   val_check_interval=4)
    assert not [w for w in warned if "whole_step" in w], warned
    metrics = run.trainer.callback_metrics
    assert "train_loss" in metrics and "train_loss_mean" in metrics and "val_loss" in metrics


def test_gradient_clipping_and_hooks_see_the_replayed_gradients():
    """Clipping by norm and ``on_after_backward`` / ``on_before_optimizer_step`` (recorded gradients) run eagerly
    after the replayed backward, on the same gradients as under ``"ddp"``."""

    class AfterBackward(ParityModel):
        def on_after_backward(self):
            self.events.append(("after_backward", {n: p.grad.clone() for n, p in self.named_parameters()}))

    _check(functools.partial(AfterBackward, optimizer="adam"), gradient_clip_val=0.05)


def test_transformers_models_equal_ddp():
    """A transformers Llama and GPT-2 (random tiny configs): weights bit-equal to ``"ddp"``, steps replayed."""
    hf = pytest.importorskip("tests.hf_models")
    for build in (hf.tiny_llama, hf.tiny_gpt2):
        ref, _ = hf.fit_hf("ddp", build, steps=STEPS)
        strategy = whole_step()
        got, _ = hf.fit_hf(strategy, build, steps=STEPS)
        hf.assert_same_weights(got.model, ref.model)
        assert strategy.last_step_graph_stats.replays == STEPS - 3, strategy.last_step_graph_stats


class _LogsNumber(ParityModel):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("step_number", float(batch_idx))
        return loss


class _OwnBackward(ParityModel):
    def backward(self, loss, *args, **kwargs):
        loss.backward(*args, **kwargs)


class _ZeroGradHook(Callback):
    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        pass


@pytest.mark.parametrize("case, model, kwargs, reason", [
    ("manual", functools.partial(ManualModel, accumulate=1), {}, "manual optimization"),
    ("accumulation", ParityModel, dict(accumulate_grad_batches=2), "gradient accumulation"),
    ("own backward", _OwnBackward, {}, "_OwnBackward.backward is overridden"),
    ("zero-grad hook", ParityModel, dict(callbacks=[_ZeroGradHook()]), "_ZeroGradHook implements on_before_zero_grad"),
    ("logs a number", _LogsNumber, {}, "logs 'step_number' as a Python number"),
    ("returns None at capture", functools.partial(ParityModel, skip_every=3), {}, "without a loss tensor"),
])
def test_what_cannot_be_replayed_is_refused_with_the_reason_and_trains_like_ddp(case, model, kwargs, reason):
    """Each refusal is one warning naming the cause; the layers then get per-layer graphs (or run eagerly), and
    training equals ``"ddp"``. A capture that fails midway (``None`` returned in the capture step) keeps nothing."""
    _, _, warned = _check(model, expect_replays=False, **kwargs)
    refusals = [w for w in warned if "graphs.whole_step" in w]
    assert len(refusals) == 1 and reason in refusals[0], warned


def _uneven_loader():
    """14 samples in batches of 4: the last batch of every epoch has 2 rows, another batch signature. With 9 steps:
    steps 0-1 warm up, 2 captures, 3 and 7 are the short batches, 4-6 and 8 replay."""
    return DataLoader(dataset(14), batch_size=4)


class _Uneven(ParityModel):
    def train_dataloader(self):
        return _uneven_loader()


def test_a_batch_of_another_shape_runs_eagerly_with_one_warning():
    strategy, _, warned = _check(_Uneven, expect_replays=None, max_steps=9, max_epochs=3)
    stats = strategy.last_step_graph_stats
    assert stats.captures == 1 and stats.replays == 4 and stats.eager_steps == 2, stats
    assert sum("a batch unlike the captured ones" in w for w in warned) == 1, warned
    assert any("Tensor[2, 8]" in w for w in warned), warned


def test_a_batch_of_another_shape_is_captured_too_under_recapture():
    strategy, _, _ = _check(_Uneven, expect_replays=None, max_steps=9, max_epochs=3, graphs={"shape_policy": "recapture"})
    stats = strategy.last_step_graph_stats
    assert stats.captures == 2 and stats.replays == 5 and stats.eager_steps == 0, stats


class _VariableLength(ParityModel):
    """Sequences of 8 features, mean-pooled; the loader yields ready batches of 4: four of length 5, two of 3 (in
    the order of the sampler Lightning's DDP strategies put on it)."""

    def loss(self, batch, batch_idx: int = 0) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x).mean(dim=1), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randn(4, 5 if i < 4 else 3, 8, generator=g), torch.randn(4, 1, generator=g))
                   for i in range(6)]
        return DataLoader(batches, batch_size=None)


def test_a_batch_of_another_shape_is_an_error_under_shape_policy_error():
    strategy = whole_step(shape_policy="error")
    with pytest.raises(GraphSignatureError, match=r"batch\[0\]: captured Tensor\[4, (5|3), 8\].*got Tensor\[4, (3|5), 8\]"):
        train(strategy, _VariableLength, max_steps=6)
    assert strategy.last_step_graph_stats.captures == 1


def test_the_optimizer_step_keeps_the_cached_fused_adam_step():
    """The optimizer step after a replayed backward is the cached fused AdamW step (bit-identical to AdamW's)."""

    class FusedAdam(ParityModel):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01, fused=True)

    strategy, _, _ = _check(FusedAdam)
    assert strategy.last_cached_optimizer_steps > 0


def test_graph_monitor_logs_the_replayed_steps_of_a_model_without_layers(tmp_path):
    """A model without repeated layers: no per-layer graphs, the whole step replayed; ``GraphMonitor`` logs
    ``graphs/step_replays`` through Lightning's CSV logger and the progress bar says ``whole step``."""
    import csv
    import glob

    from lightning.pytorch.loggers import CSVLogger

    from cg_lightning.callbacks import GraphMonitor

    class BarProbe(Callback):
        def __init__(self):
            self.states = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.states.append(trainer.progress_bar_callback.get_metrics(trainer, pl_module).get("graphs"))

    strategy = whole_step()
    run = train(strategy, functools.partial(ParityModel, body="linear"), max_steps=STEPS,
                callbacks=[GraphMonitor(log_every_n_steps=2), BarProbe()], logger=CSVLogger(tmp_path),
                log_every_n_steps=1, enable_progress_bar=True)
    probe = next(c for c in run.trainer.callbacks if isinstance(c, BarProbe))  # train() copies the callbacks
    assert strategy.last_graph_stats is None  # nothing per layer
    rows = list(csv.DictReader(open(glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)[0])))
    logged = [float(r["graphs/step_replays"]) for r in rows if r.get("graphs/step_replays")]
    assert logged and logged[-1] == STEPS - 3, rows  # every step after warmup (2) and capture (1)
    assert probe.states[-1] == "whole step" and probe.states[0] is None, probe.states
