"""``graphs.capture_optimizer``: a fused AdamW step recorded and replayed from a graph while its values hold,
against Lightning ``"ddp"`` on the same seed and data, bit for bit. On CPU the eager graph backend runs the step
again at every "replay", so these tests check the bookkeeping (when a step is recorded, replayed or run eagerly,
checkpoints, refusals); the ``cuda`` ones check real capture on the GPU machine."""

import warnings

import pytest
import torch
from lightning.pytorch import Callback, seed_everything

from cg_lightning.examples.data import TextDataModule
from cg_lightning.examples.gpt import GPTLightningModule
from tests.helpers import (
    DATA, DEVICES, EPOCH_BATCHES, MODEL, WARMUP, cg_strategy, fit_gpt, fit_whole_epochs, make_trainer, max_rel_diff,
    state_rel_diff, strategy_for,
)

# step 0 is torch's own step (the cached lists are built after it), step 1 runs on the lists (no previous step to
# compare its values with), step 2 records the step (its values held for two steps), every later step replays
FIRST_REPLAY = 3
STEP_MODEL = dict(MODEL, warmup_lr_steps=0, fused=True, bias=False)


def _fit(name, steps, accelerator="cpu", backend="eager", callbacks=(), model_kwargs=None,
         model_cls=GPTLightningModule, graphs=None, **trainer_kwargs):
    strategy = strategy_for(name, backend, capture_optimizer=True, **(graphs or {}))
    model, rec, trainer, _ = fit_gpt(strategy, steps, model_cls=model_cls,
                                     model=STEP_MODEL, model_kwargs=model_kwargs, callbacks=callbacks,
                                     accelerator=accelerator, **trainer_kwargs)
    return model, rec, trainer


def _assert_exact(model, rec, ref_model, ref, label):
    loss_diff = max_rel_diff(rec.losses, ref.losses)
    weight_diff = state_rel_diff(model.state_dict(), ref_model.state_dict())
    print(f"{label}: max rel loss diff {loss_diff:.1e}, weight diff {weight_diff:.1e}")
    assert loss_diff == 0.0 and weight_diff == 0.0


class _LRs(Callback):
    """The learning rate of every group as the optimizer sees it at each step (floats)."""

    def __init__(self) -> None:
        self.lrs = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        assert all(isinstance(g["lr"], float) for g in optimizer.param_groups), optimizer.param_groups
        self.lrs.append([g["lr"] for g in optimizer.param_groups])


@pytest.mark.parametrize("accelerator,backend", DEVICES)
def test_replayed_step_with_scheduler_and_clipping_equals_ddp(accelerator, backend):
    """LambdaLR warmup over 10 steps, then a constant learning rate, norm clipping, two param groups (decay / no
    decay), 16 steps: per-step losses and final weights equal "ddp" bit for bit. While the warmup changes the
    learning rate every step the step runs eagerly; the first step whose values equal the previous step's records
    the step, and every later one replays it; the groups keep the user's floats and ``capturable``."""
    steps = 16
    lrs = _LRs()
    ref_model, ref, _ = _fit("ddp", steps, accelerator, model_kwargs=dict(warmup_lr_steps=10),
                             gradient_clip_val=0.05)
    model, rec, trainer = _fit("cg", steps, accelerator, backend, callbacks=[lrs], model_kwargs=dict(warmup_lr_steps=10),
                               gradient_clip_val=0.05)
    stable = next(s for s in range(WARMUP + 1, steps) if lrs.lrs[s] == lrs.lrs[s - 1])
    assert stable > FIRST_REPLAY + 3  # the warmup kept the step eager for a while
    assert trainer.strategy.last_optimizer_replays == steps - stable - 1
    _assert_exact(model, rec, ref_model, ref, f"captured optimizer step ({backend})")
    opt = trainer.optimizers[0]
    assert all(isinstance(g["lr"], float) and g["capturable"] is False for g in opt.param_groups)


@pytest.mark.parametrize("whole_step", [None, False], ids=["whole-step", "per-layer"])
@pytest.mark.parametrize("accelerator,backend", DEVICES)
def test_constant_learning_rate_replays_from_the_second_step_after_capture(accelerator, backend, whole_step):
    """No scheduler: the step is recorded once, in step FIRST_REPLAY-1, and replayed in every later step; bit for bit
    "ddp". With the default ``graphs.whole_step`` the training step replays from its own graph beside it (a whole
    iteration is two graph launches); with ``false`` the layers replay from theirs."""
    steps = 10
    ref_model, ref, _ = _fit("ddp", steps, accelerator)
    model, rec, trainer = _fit("cg", steps, accelerator, backend, graphs=dict(whole_step=whole_step))
    assert trainer.strategy.last_optimizer_replays == steps - FIRST_REPLAY
    step_stats = trainer.strategy.last_step_graph_stats
    if whole_step is None:
        assert step_stats.refusal is None and step_stats.replays >= steps - WARMUP - 1, step_stats
    else:
        assert step_stats is None and trainer.strategy.last_graph_stats.forward_replays > 0
    _assert_exact(model, rec, ref_model, ref, f"captured optimizer step, constant lr, {whole_step=} ({backend})")


class _SetLR(Callback):
    """At ``step`` assigns a float learning rate to every group, as user code or an old scheduler might."""

    def __init__(self, step: int, lr: float) -> None:
        self.step, self.lr = step, lr

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            for g in trainer.optimizers[0].param_groups:
                g["lr"] = self.lr


def test_learning_rate_assigned_after_capture_runs_eagerly_then_is_recorded_again():
    """A float written into ``group["lr"]`` at step 7 (after the step was recorded): step 7 runs eagerly with the
    new value, step 8 records the step again, step 9 replays; no warning; bit for bit "ddp" with the same
    assignment."""
    steps = 10
    assert FIRST_REPLAY < 7
    ref_model, ref, _ = _fit("ddp", steps, callbacks=[_SetLR(7, 1e-2)])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*optimizer step runs eagerly.*")
        model, rec, trainer = _fit("cg", steps, callbacks=[_SetLR(7, 1e-2)])
    assert trainer.strategy.last_optimizer_replays == (7 - FIRST_REPLAY) + 1
    _assert_exact(model, rec, ref_model, ref, "lr assigned after capture")


class _SetWeightDecay(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.optimizers[0].param_groups[0]["weight_decay"] = 0.5


def test_hyperparameter_changed_after_capture_is_not_replayed_with_the_old_value():
    """weight_decay of group 0 changed at step 7 (after capture): the graph holds the old value, so step 7 runs
    eagerly, step 8 records the step again; bit for bit "ddp" with the same change."""
    steps = 10
    ref_model, ref, _ = _fit("ddp", steps, callbacks=[_SetWeightDecay(7)])
    model, rec, trainer = _fit("cg", steps, callbacks=[_SetWeightDecay(7)])
    assert trainer.strategy.last_optimizer_replays == (7 - FIRST_REPLAY) + 1
    _assert_exact(model, rec, ref_model, ref, "weight decay changed after capture")


class _SwapStorage(Callback):
    """At ``step`` moves every parameter of the first group to new storage (``param.data = param.data.clone()``)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            for p in trainer.optimizers[0].param_groups[0]["params"]:
                p.data = p.data.clone()


def test_parameter_moved_to_new_storage_is_not_replayed():
    """``param.data`` replaced by a copy at step 7: a replay would update the old storage, so step 7 records the step
    anew (on CPU the eager backend shows the count; the storage check is what the GPU needs), step 8 replays;
    bit for bit "ddp" with the same replacement."""
    steps = 9
    ref_model, ref, _ = _fit("ddp", steps, callbacks=[_SwapStorage(7)])
    model, rec, trainer = _fit("cg", steps, callbacks=[_SwapStorage(7)])
    assert trainer.strategy.last_optimizer_replays == (7 - FIRST_REPLAY) + 1
    _assert_exact(model, rec, ref_model, ref, "parameter storage replaced")


class _SwapGradStorage(Callback):
    """At ``step``, just before the optimizer step, moves one gradient to new storage (``grad.data = copy``)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step:
            p = optimizer.param_groups[0]["params"][0]
            p.grad.data = p.grad.data.clone()


def test_gradient_moved_to_new_storage_is_not_replayed():
    """A gradient's storage replaced just before the step at step 7: the graph would read the old storage, so step 7
    records the step anew, step 8 again (the engine put the storage back before its backward), step 9 replays; bit
    for bit "ddp" with the same replacement."""
    steps = 10
    ref_model, ref, _ = _fit("ddp", steps, callbacks=[_SwapGradStorage(7)])
    model, rec, trainer = _fit("cg", steps, callbacks=[_SwapGradStorage(7)])
    assert trainer.strategy.last_optimizer_replays == (7 - FIRST_REPLAY) + (steps - 9)
    _assert_exact(model, rec, ref_model, ref, "gradient storage replaced")


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
    """A checkpoint saved while the step replays from a graph stores the groups as the user set them (float
    learning rates, ``capturable`` False). Resuming from it (epoch boundary, as in tests/test_training_state.py) under
    the same strategy records the step again and continues with the losses and weights of an uninterrupted "ddp" run,
    bit for bit."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    constant = dict(warmup_lr_steps=0, fused=True)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), filename="{step}", every_n_train_steps=EPOCH_BATCHES,
                           save_top_k=-1)
    first = cg_strategy(capture_optimizer=True)
    fit_whole_epochs(first, EPOCH_BATCHES, callbacks=[ckpt], enable_checkpointing=True, model_kwargs=constant)
    assert first.last_optimizer_replays == EPOCH_BATCHES - FIRST_REPLAY
    path = tmp_path / f"step={EPOCH_BATCHES}.ckpt"
    groups = torch.load(path, weights_only=False)["optimizer_states"][0]["param_groups"]
    assert all(isinstance(g["lr"], float) and g["capturable"] is False for g in groups), groups

    resumed_strategy = cg_strategy(capture_optimizer=True)
    model, resumed = fit_whole_epochs(resumed_strategy, 2 * EPOCH_BATCHES, ckpt_path=str(path), model_kwargs=constant)
    full_model, full = fit_whole_epochs("ddp", 2 * EPOCH_BATCHES, model_kwargs=constant)
    assert resumed_strategy.last_optimizer_replays == EPOCH_BATCHES - FIRST_REPLAY
    assert max_rel_diff(resumed.losses, full.losses[EPOCH_BATCHES:]) == 0.0
    assert state_rel_diff(model.state_dict(), full_model.state_dict()) == 0.0


class _SkipBatchGPT(GPTLightningModule):
    """``training_step`` returns None at global step ``skip_at`` (Lightning skips that batch's backward)."""

    skip_at = -1

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == type(self).skip_at:
            return None
        return super().training_step(batch, batch_idx)


# replays in 10 steps: a skip at s before the recording makes s and s+1 torch's own steps, s+2 a step on the new lists
# and s+3 the recording
@pytest.mark.parametrize("skip_at,replays", [(FIRST_REPLAY - 2, 10 - (FIRST_REPLAY + 2)),
                                             (FIRST_REPLAY - 1, 10 - (FIRST_REPLAY + 3)), (7, 7 - FIRST_REPLAY)])
def test_skipped_batch_is_not_replayed(skip_at, replays, monkeypatch):
    """A batch skipped (``training_step`` returns None: no gradients) before the recording, where it would record
    the step, or after replays: that step and the next are torch's own steps (``.grad`` is not the tensor the lists
    hold: the lists are rebuilt), the one after runs on the new lists, then the step is recorded again; no warning.
    Losses and weights equal "ddp" bit for bit."""
    steps = 10
    monkeypatch.setattr(_SkipBatchGPT, "skip_at", skip_at)
    ref_model, ref, _ = _fit("ddp", steps, model_cls=_SkipBatchGPT)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*optimizer step runs eagerly.*")
        model, rec, trainer = _fit("cg", steps, model_cls=_SkipBatchGPT)
    assert trainer.strategy.last_optimizer_replays == replays
    skipped = [i for i, x in enumerate(rec.losses) if x != x]  # NaN: the batch recorded no loss
    assert skipped == [i for i, x in enumerate(ref.losses) if x != x] == [skip_at]
    kept = [i for i in range(steps) if i != skip_at]
    assert max_rel_diff([rec.losses[i] for i in kept], [ref.losses[i] for i in kept]) == 0.0
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) == 0.0


class _TwoStageGPT(GPTLightningModule):
    """Starts with the matrices only; ``_AddGroup`` adds the other parameters as a second group."""

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.ndim >= 2], lr=3e-3, fused=True)


class _AddGroup(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.optimizers[0].add_param_group(
                {"params": [p for p in pl_module.parameters() if p.ndim < 2], "weight_decay": 0.0})


def test_param_group_added_after_capture_is_recorded_with_the_others(tmp_path):
    """A group added at step FIRST_REPLAY+1 (after one replay): that step is torch's own, the next runs on the
    rebuilt lists, the one after records both groups, and replays go on; bit for bit "ddp"; a checkpoint written
    during replays holds both groups."""
    steps, added = 10, FIRST_REPLAY + 1
    ref_model, ref, _ = _fit("ddp", steps, model_cls=_TwoStageGPT, callbacks=[_AddGroup(added)])
    model, rec, trainer = _fit("cg", steps, model_cls=_TwoStageGPT, callbacks=[_AddGroup(added)])
    assert trainer.strategy.last_optimizer_replays == (added - FIRST_REPLAY) + (steps - (added + 3))
    _assert_exact(model, rec, ref_model, ref, "param group added")
    path = tmp_path / "c.ckpt"
    trainer.save_checkpoint(path)
    groups = torch.load(path, weights_only=False)["optimizer_states"][0]["param_groups"]
    assert [len(g["params"]) for g in groups] == [len(g["params"]) for g in trainer.optimizers[0].param_groups]
    assert len(groups) == 2


class _ForeachGPT(GPTLightningModule):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, foreach=True)


def test_foreach_adamw_is_refused_and_trains_eagerly():
    """AdamW(foreach=True): its step computes on the host's values in another order than a recording could keep,
    so it is refused with one warning that names fused=True, never replayed; bit for bit "ddp"."""
    steps = 8
    ref_model, ref, _ = _fit("ddp", steps, model_cls=_ForeachGPT)
    with pytest.warns(UserWarning, match="build it with fused=True") as record:
        model, rec, trainer = _fit("cg", steps, model_cls=_ForeachGPT)
    assert len([w for w in record if "optimizer step runs eagerly" in str(w.message)]) == 1
    assert trainer.strategy.last_optimizer_replays == 0
    _assert_exact(model, rec, ref_model, ref, "foreach AdamW")


def test_grad_dtype_other_than_the_parameters_is_refused_with_a_reason():
    """bf16-true with ``ddp.grad_dtype=float32``: the optimizer gets a fresh cast of main_grad every step, so
    the step is not captured, and the warning names ddp.grad_dtype (not user code)."""
    seed_everything(7)
    strategy = cg_strategy(capture_optimizer=True, ddp={"grad_dtype": "float32"})
    trainer = make_trainer(strategy, 7, precision="bf16-true")
    with pytest.warns(UserWarning, match="ddp.grad_dtype differs"):
        trainer.fit(GPTLightningModule(**STEP_MODEL), datamodule=TextDataModule(**DATA))
    assert strategy.last_optimizer_replays == 0


@pytest.mark.parametrize("whole_step", [None, False], ids=["iteration-graph", "per-layer"])
def test_replay_count_is_per_fit(whole_step):
    """``last_optimizer_replays`` counts the last fit only (fit called twice on one Trainer). Without a hook between
    the backward and the step, the whole step's graph holds the update from the capture step on (every step after
    warmup counts); with per-layer graphs the optimizer's own graph replays from FIRST_REPLAY on."""
    seed_everything(7)
    strategy = cg_strategy(capture_optimizer=True, whole_step=whole_step)
    trainer = make_trainer(strategy, 8)
    model, data = GPTLightningModule(**STEP_MODEL), TextDataModule(**DATA)
    trainer.fit(model, datamodule=data)
    expected = 8 - (WARMUP if whole_step is None else FIRST_REPLAY)
    assert strategy.last_optimizer_replays == expected
    trainer.fit_loop.epoch_loop.max_steps = 16
    trainer.fit(model, datamodule=data)
    assert strategy.last_optimizer_replays == expected  # the second fit warms up and captures again
    if whole_step is None:
        assert strategy.last_step_graph_stats.updates == expected


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
    them under "ddp" (not added to the next step's main_grad): losses and weights equal "ddp" bit for bit."""
    steps = 8
    ref_model, ref, _ = _fit("ddp", steps, model_cls=_SkipOddSteps)
    strategy = cg_strategy(capture_optimizer=capture_optimizer)
    model, rec, _, _ = fit_gpt(strategy, steps, model_cls=_SkipOddSteps, model=STEP_MODEL)
    assert len(rec.losses) == len(ref.losses)
    _assert_exact(model, rec, ref_model, ref, "user optimizer_step skipping updates")


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
