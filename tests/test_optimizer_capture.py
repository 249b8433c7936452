"""``graphs.capture_optimizer``: the optimizer step replayed from a graph (issue 8 lever), against Lightning
``"ddp"`` on the same seed and data. On CPU the eager graph backend runs the step again at every "replay", so
these tests check the bookkeeping (learning-rate tensors under a scheduler, clipping order, the checks that
give up, checkpoints); the ``cuda`` ones check real capture on the GPU machine."""

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

import cg_lightning
from examples.data import TextDataModule
from examples.gpt import GPTLightningModule
from tests.helpers import GradRecorder, max_rel_diff, state_rel_diff

WARMUP = 2
# layers captured in step WARMUP; step WARMUP+1 prepares and runs eagerly; WARMUP+2 captures; then replays
FIRST_REPLAY = WARMUP + 3
MODEL = dict(n_layer=2, d_model=32, n_head=2, block_size=16, lr=3e-3, warmup_lr_steps=10, bias=False)
# no biases: a fused key bias has a true gradient of 0, and AdamW turns the rounding of a float32 learning
# rate (the captured step keeps it on the device) into full-size steps of either sign there
DATA = dict(block_size=16, batch_size=4, max_bytes=100_000)
DEVICES = [pytest.param("cpu", "eager", id="cpu"), pytest.param("gpu", "cuda", marks=pytest.mark.cuda, id="cuda")]


def _fit(name, steps, accelerator="cpu", backend="eager", callbacks=(), model_kwargs=None, **trainer_kwargs):
    seed_everything(7, workers=True)
    model = GPTLightningModule(**{**MODEL, **(model_kwargs or {})})
    strategy = "ddp" if name == "ddp" else cg_lightning.CUDAGraphDDPStrategy(
        graphs={"warmup_steps": WARMUP, "backend": backend, "capture_optimizer": True})
    rec = GradRecorder()
    trainer_kwargs.setdefault("enable_checkpointing", False)
    trainer = Trainer(accelerator=accelerator, devices=1, strategy=strategy, max_steps=steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, callbacks=[rec, *callbacks], **trainer_kwargs)
    trainer.fit(model, datamodule=TextDataModule(**DATA))
    return model, rec, trainer


class _LRs(Callback):
    """The learning rate of every group as the optimizer sees it at each step (floats)."""

    def __init__(self) -> None:
        self.lrs = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs.append([float(g["lr"]) for g in optimizer.param_groups])


@pytest.mark.parametrize("accelerator,backend", DEVICES)
def test_replayed_step_with_scheduler_and_clipping_equals_ddp(accelerator, backend):
    """LambdaLR warmup changing the learning rate every step, norm clipping, two param groups (decay / no
    decay), 12 steps: per-step losses, learning rates and final weights equal "ddp" (1e-5; measured on CPU:
    identical); steps from FIRST_REPLAY on are replays; after fit the groups hold float learning rates and
    the user's ``capturable`` again."""
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
    strategy = cg_lightning.CUDAGraphDDPStrategy(graphs={"warmup_steps": WARMUP, "backend": "eager",
                                                         "capture_optimizer": True})
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=7, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.warns(UserWarning, match="step pre/post hooks"):
        trainer.fit(HookedGPT(**MODEL), datamodule=TextDataModule(**DATA))
    assert trainer.strategy.last_optimizer_replays == 0


def test_checkpoint_holds_the_users_optimizer_settings_and_resumes(tmp_path):
    """A checkpoint saved while the step replays from a graph stores float learning rates and ``capturable``
    as the user set it (so it loads into any optimizer). Resuming from it (epoch boundary, as in
    tests/test_state.py) under the same strategy captures the step again and continues with the losses of an
    uninterrupted "ddp" run (1e-5); final weights equal within 1e-5, the fused key bias left out (it does not
    affect any output; its true gradient is 0)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers import state_rel_diffs
    from tests.test_state import EPOCH_BATCHES, _fit_gpt

    def make():
        return cg_lightning.CUDAGraphDDPStrategy(graphs={"warmup_steps": WARMUP, "backend": "eager",
                                                         "capture_optimizer": True})

    ckpt = ModelCheckpoint(dirpath=str(tmp_path), filename="{step}", every_n_train_steps=EPOCH_BATCHES,
                           save_top_k=-1)
    first = make()
    _fit_gpt(first, EPOCH_BATCHES, callbacks=[ckpt], enable_checkpointing=True)
    assert first.last_optimizer_replays == EPOCH_BATCHES - FIRST_REPLAY
    path = tmp_path / f"step={EPOCH_BATCHES}.ckpt"
    groups = torch.load(path, weights_only=False)["optimizer_states"][0]["param_groups"]
    assert all(isinstance(g["lr"], float) and g["capturable"] is False for g in groups), groups

    resumed_strategy = make()
    model, resumed = _fit_gpt(resumed_strategy, 2 * EPOCH_BATCHES, ckpt_path=str(path))
    full_model, full = _fit_gpt("ddp", 2 * EPOCH_BATCHES)
    assert resumed_strategy.last_optimizer_replays == EPOCH_BATCHES - FIRST_REPLAY
    assert max_rel_diff(resumed.losses, full.losses[EPOCH_BATCHES:]) < 1e-5
    assert max(state_rel_diffs(model.state_dict(), full_model.state_dict(), drop_key_bias=True).values()) < 1e-5
