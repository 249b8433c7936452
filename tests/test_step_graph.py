"""``graphs.capture_optimizer``: the optimizer step replayed from a graph, against Lightning
``"ddp"`` on the same seed and data. On CPU the eager graph backend runs the step again at every "replay", so
these tests check the bookkeeping (learning-rate tensors under a scheduler, clipping order, the checks that
give up, checkpoints); the ``cuda`` ones check real capture on the GPU machine."""

import warnings

import pytest
import torch
from lightning.pytorch import Callback, seed_everything

from cg_lightning.examples.data import TextDataModule
from cg_lightning.examples.gpt import GPTLightningModule
from tests.helpers import (
    DATA, DEVICES, EPOCH_BATCHES, MODEL, WARMUP, cg_strategy, fit_gpt, fit_whole_epochs, make_trainer, max_rel_diff,
    state_rel_diff, state_rel_diffs, strategy_for,
)

# layers captured in step WARMUP; step WARMUP+1 prepares and runs eagerly; WARMUP+2 captures; then replays
FIRST_REPLAY = WARMUP + 3
STEP_MODEL = dict(MODEL, warmup_lr_steps=10, bias=False)
# no biases: a fused key bias has a true gradient of 0, and AdamW turns the rounding of a float32 learning
# rate (the captured step keeps it on the device) into full-size steps of either sign there


def _fit(name, steps, accelerator="cpu", backend="eager", callbacks=(), model_kwargs=None,
         model_cls=GPTLightningModule, **trainer_kwargs):
    model, rec, trainer, _ = fit_gpt(strategy_for(name, backend, capture_optimizer=True), steps, model_cls=model_cls,
                                     model=STEP_MODEL, model_kwargs=model_kwargs, callbacks=callbacks,
                                     accelerator=accelerator, **trainer_kwargs)
    return model, rec, trainer


class _LRs(Callback):
    """The learning rate of every group as the optimizer sees it at each step (floats)."""

    def __init__(self) -> None:
        self.lrs = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # user code sees Python floats (a held value must not change under it later)
        assert all(isinstance(g["lr"], float) for g in optimizer.param_groups), optimizer.param_groups
        self.lrs.append([g["lr"] for g in optimizer.param_groups])


@pytest.mark.parametrize("accelerator,backend", DEVICES)
def test_replayed_step_with_scheduler_and_clipping_equals_ddp(accelerator, backend):
    """LambdaLR warmup changing the learning rate every step, norm clipping, two param groups (decay / no
    decay), 12 steps: per-step losses, learning rates and final weights equal "ddp" (1e-5; measured on CPU:
    identical); steps from FIRST_REPLAY on are replays; the learning rate user code sees is always a float;
    after fit the groups hold the user's ``capturable`` again."""
    steps = 12
    ref_lrs, lrs = _LRs(), _LRs()
    ref_model, ref, _ = _fit("ddp", steps, accelerator, callbacks=[ref_lrs], gradient_clip_val=0.05)
    model, rec, trainer = _fit("cg", steps, accelerator, backend, callbacks=[lrs], gradient_clip_val=0.05)
    assert trainer.strategy.last_optimizer_replays == steps - FIRST_REPLAY
    flat, ref_flat = [x for step in lrs.lrs for x in step], [x for step in ref_lrs.lrs for x in step]
    assert flat == pytest.approx(ref_flat, rel=1e-6)
    assert len({tuple(x) for x in lrs.lrs[FIRST_REPLAY:]}) > 3  # the scheduler kept changing it during replays
    loss_diff = max_rel_diff(rec.losses, ref.losses)
    weight_diff = state_rel_diff(model.state_dict(), ref_model.state_dict())
    print(f"captured optimizer step ({backend}): max rel loss diff {loss_diff:.1e}, weight diff {weight_diff:.1e}")
    assert loss_diff < 1e-5 and weight_diff < 1e-5
    opt = trainer.optimizers[0]
    assert all(isinstance(g["lr"], float) and g["capturable"] is False for g in opt.param_groups)


class _SetLR(Callback):
    """At ``step`` assigns a float learning rate to every group, as user code or an old scheduler might."""

    def __init__(self, step: int, lr: float) -> None:
        self.step, self.lr = step, lr

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            for g in trainer.optimizers[0].param_groups:
                g["lr"] = self.lr


def test_float_lr_assigned_after_capture_is_used():
    """A float written into ``group["lr"]`` after capture is copied into the captured learning-rate tensor:
    training equals "ddp" with the same assignment, and no step falls back to eager."""
    steps = 10
    model_kwargs = dict(warmup_lr_steps=0)
    ref_model, ref, _ = _fit("ddp", steps, callbacks=[_SetLR(7, 1e-2)], model_kwargs=model_kwargs)
    model, rec, trainer = _fit("cg", steps, callbacks=[_SetLR(7, 1e-2)], model_kwargs=model_kwargs)
    assert trainer.strategy.last_optimizer_replays == steps - FIRST_REPLAY
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5


class _SetWeightDecay(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.optimizers[0].param_groups[0]["weight_decay"] = 0.5


def test_hyperparameter_change_after_capture_falls_back_to_eager_with_a_warning():
    """weight_decay of group 0 changed at step 7 (after capture): the graph would keep the old value, so that
    step and every later one run eagerly, one warning names the key and the group, and training equals "ddp"
    with the same change."""
    steps = 10
    ref_model, ref, _ = _fit("ddp", steps, callbacks=[_SetWeightDecay(7)])
    with pytest.warns(UserWarning, match=r"\['weight_decay'\] of param group 0 changed") as record:
        model, rec, trainer = _fit("cg", steps, callbacks=[_SetWeightDecay(7)])
    assert len([w for w in record if "optimizer step runs eagerly" in str(w.message)]) == 1
    assert trainer.strategy.last_optimizer_replays == 7 - FIRST_REPLAY
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5


def test_grad_scaler_keeps_the_step_eager():
    """16-mixed with a GradScaler (explicit CPU plugin): the scaler inspects the gradients on the host before
    each step, so the step is never captured; one warning says so; training equals "ddp"."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    steps = 8
    out = []
    for name in ("ddp", "cg"):
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
        if name == "cg":
            with pytest.warns(UserWarning, match="GradScaler"):
                out.append(_fit(name, steps, plugins=[plugin]))
        else:
            out.append(_fit(name, steps, plugins=[plugin]))
    (ref_model, ref, _), (model, rec, trainer) = out
    assert trainer.strategy.last_optimizer_replays == 0
    assert max_rel_diff(rec.losses, ref.losses) < 1e-2
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-2


def test_optimizer_with_step_hook_is_refused():
    """An optimizer step hook would be skipped by a replay: the step stays eager, with a warning."""

    class HookedGPT(GPTLightningModule):
        def configure_optimizers(self):
            out = super().configure_optimizers()
            opt = out["optimizer"] if isinstance(out, dict) else out
            opt.register_step_post_hook(lambda *a: None)
            return out

    seed_everything(7)
    trainer = make_trainer(cg_strategy(capture_optimizer=True), 7, validation=True)
    with pytest.warns(UserWarning, match="step pre/post hooks"):
        trainer.fit(HookedGPT(**STEP_MODEL), datamodule=TextDataModule(**DATA))
    assert trainer.strategy.last_optimizer_replays == 0


def test_checkpoint_holds_the_users_optimizer_settings_and_resumes(tmp_path):
    """A checkpoint saved while the step replays from a graph stores float learning rates and ``capturable``
    as the user set it (so it loads into any optimizer). Resuming from it (epoch boundary, as in
    tests/test_training_state.py) under the same strategy captures the step again and continues with the losses of an
    uninterrupted "ddp" run (1e-5); final weights equal within 1e-5, the fused key bias left out (it does not
    affect any output; its true gradient is 0)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def make():
        return cg_strategy(capture_optimizer=True)

    ckpt = ModelCheckpoint(dirpath=str(tmp_path), filename="{step}", every_n_train_steps=EPOCH_BATCHES,
                           save_top_k=-1)
    first = make()
    fit_whole_epochs(first, EPOCH_BATCHES, callbacks=[ckpt], enable_checkpointing=True)
    assert first.last_optimizer_replays == EPOCH_BATCHES - FIRST_REPLAY
    path = tmp_path / f"step={EPOCH_BATCHES}.ckpt"
    groups = torch.load(path, weights_only=False)["optimizer_states"][0]["param_groups"]
    assert all(isinstance(g["lr"], float) and g["capturable"] is False for g in groups), groups

    resumed_strategy = make()
    model, resumed = fit_whole_epochs(resumed_strategy, 2 * EPOCH_BATCHES, ckpt_path=str(path))
    full_model, full = fit_whole_epochs("ddp", 2 * EPOCH_BATCHES)
    assert resumed_strategy.last_optimizer_replays == EPOCH_BATCHES - FIRST_REPLAY
    assert max_rel_diff(resumed.losses, full.losses[EPOCH_BATCHES:]) < 1e-5
    assert max(state_rel_diffs(model.state_dict(), full_model.state_dict(), drop_key_bias=True).values()) < 1e-5


class _SkipBatchGPT(GPTLightningModule):
    """``training_step`` returns None at global step ``skip_at`` (Lightning skips that batch's backward)."""

    skip_at = -1

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == type(self).skip_at:
            return None
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("skip_at", [WARMUP + 2, 7])
def test_skipped_batch_is_not_captured_and_not_replayed(skip_at, monkeypatch):
    """A batch skipped (``training_step`` returns None: no gradients) exactly when the step would be captured
    postpones the capture by one step (an empty step must not become the graph); one skipped after capture
    turns the step eager with a warning (the graph would update from stale buffers). Losses equal "ddp"."""
    steps = 10
    monkeypatch.setattr(_SkipBatchGPT, "skip_at", skip_at)
    ref_model, ref, _ = _fit("ddp", steps, model_cls=_SkipBatchGPT)
    if skip_at == 7:
        with pytest.warns(UserWarning, match="set to None by a skipped backward"):
            model, rec, trainer = _fit("cg", steps, model_cls=_SkipBatchGPT)
        assert trainer.strategy.last_optimizer_replays == skip_at - FIRST_REPLAY
    else:
        model, rec, trainer = _fit("cg", steps, model_cls=_SkipBatchGPT)
        assert trainer.strategy.last_optimizer_replays == steps - FIRST_REPLAY - 1
    skipped = [i for i, x in enumerate(rec.losses) if x != x]  # NaN: the batch recorded no loss
    assert skipped == [i for i, x in enumerate(ref.losses) if x != x] == [skip_at]
    kept = [i for i in range(steps) if i != skip_at]
    assert max_rel_diff([rec.losses[i] for i in kept], [ref.losses[i] for i in kept]) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5


class _TwoStageGPT(GPTLightningModule):
    """Starts with the matrices only; ``_AddGroup`` adds the other parameters as a second group."""

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.ndim >= 2], lr=3e-3)


class _AddGroup(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.optimizers[0].add_param_group(
                {"params": [p for p in pl_module.parameters() if p.ndim < 2], "weight_decay": 0.0})


def test_param_group_added_before_capture_is_included(tmp_path):
    """A group added between the prepared eager step and the capture is prepared too and captured with the
    others: replays go on, losses equal "ddp", and a checkpoint written during replays holds both groups."""
    steps = 10
    ref_model, ref, _ = _fit("ddp", steps, model_cls=_TwoStageGPT, callbacks=[_AddGroup(WARMUP + 2)])
    model, rec, trainer = _fit("cg", steps, model_cls=_TwoStageGPT, callbacks=[_AddGroup(WARMUP + 2)])
    assert trainer.strategy.last_optimizer_replays == steps - FIRST_REPLAY - 1
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    path = tmp_path / "c.ckpt"
    trainer.save_checkpoint(path)
    groups = torch.load(path, weights_only=False)["optimizer_states"][0]["param_groups"]
    assert [len(g["params"]) for g in groups] == [len(g["params"]) for g in trainer.optimizers[0].param_groups]
    assert len(groups) == 2


class _ForeachGPT(GPTLightningModule):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, foreach=True)


def test_foreach_adamw_on_the_eager_backend():
    """AdamW(foreach=True) on CPU (the graph backend there is "eager"): trains like "ddp"."""
    steps = 8
    ref_model, ref, _ = _fit("ddp", steps, model_cls=_ForeachGPT)
    model, rec, trainer = _fit("cg", steps, model_cls=_ForeachGPT)
    assert trainer.strategy.last_optimizer_replays == steps - FIRST_REPLAY
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5


def test_grad_dtype_other_than_the_parameters_is_refused_with_a_reason():
    """bf16-true with ``ddp.grad_dtype=float32``: the optimizer gets a fresh cast of main_grad every step, so
    the step is not captured, and the warning names ddp.grad_dtype (not user code)."""
    seed_everything(7)
    strategy = cg_strategy(capture_optimizer=True, ddp={"grad_dtype": "float32"})
    trainer = make_trainer(strategy, 7, precision="bf16-true")
    with pytest.warns(UserWarning, match="ddp.grad_dtype differs"):
        trainer.fit(GPTLightningModule(**STEP_MODEL), datamodule=TextDataModule(**DATA))
    assert strategy.last_optimizer_replays == 0


def test_replay_count_is_per_fit():
    """``last_optimizer_replays`` counts the last fit only (fit called twice on one Trainer)."""
    seed_everything(7)
    strategy = cg_strategy(capture_optimizer=True)
    trainer = make_trainer(strategy, 8)
    model, data = GPTLightningModule(**STEP_MODEL), TextDataModule(**DATA)
    trainer.fit(model, datamodule=data)
    assert strategy.last_optimizer_replays == 8 - FIRST_REPLAY
    trainer.fit_loop.epoch_loop.max_steps = 16
    trainer.fit(model, datamodule=data)
    assert strategy.last_optimizer_replays == 8 - FIRST_REPLAY  # the second fit warms up and captures again


class _SkipOddSteps(GPTLightningModule):
    """A user ``optimizer_step`` that runs the closure but skips ``optimizer.step`` on odd batches."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        if batch_idx % 2 == 1:
            optimizer_closure()
            return
        optimizer.step(closure=optimizer_closure)


@pytest.mark.parametrize("capture_optimizer", [False, True])
def test_user_optimizer_step_that_skips_the_update(capture_optimizer):
    """The skipped batch's gradients are dropped before the next backward, as Lightning's zero_grad drops
    them under "ddp" (not added to the next step's main_grad): losses equal "ddp" (1e-5)."""
    steps = 8
    ref_model, ref, _ = _fit("ddp", steps, model_cls=_SkipOddSteps)
    strategy = cg_strategy(capture_optimizer=capture_optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped steps turn a captured step eager, with a warning
        model, rec, _, _ = fit_gpt(strategy, steps, model_cls=_SkipOddSteps, model=STEP_MODEL)
    assert len(rec.losses) == len(ref.losses)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5


def test_monitor_logs_optimizer_replays(tmp_path):
    """``GraphMonitor`` logs ``graphs/optimizer_replays`` through the CSV logger when the step is captured."""
    import csv
    import glob

    from lightning.pytorch.loggers import CSVLogger

    from cg_lightning.callbacks import GraphMonitor

    steps = 10
    _, _, trainer = _fit("cg", steps, callbacks=[GraphMonitor(log_every_n_steps=2)], logger=CSVLogger(tmp_path),
                         log_every_n_steps=2)
    rows = list(csv.DictReader(open(glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)[0])))
    logged = [float(r["graphs/optimizer_replays"]) for r in rows if r.get("graphs/optimizer_replays")]
    assert logged and logged == sorted(logged) and logged[-1] >= steps - FIRST_REPLAY - 2, logged
    assert trainer.strategy.last_optimizer_replays == steps - FIRST_REPLAY
