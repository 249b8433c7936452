"""``graphs.capture_optimizer`` with the whole step replayed from a graph: the fused AdamW update recorded at the end
of the step's graph (one launch an iteration) while the optimizer's values hold, against Lightning ``"ddp"`` on the
same seed and data, bit for bit. On CPU the eager graph backend runs the step (and its update) again at every
"replay", so these tests check when the update is inside the graph, beside it or eager, and that every mode trains
exactly like ``"ddp"``; the ``cuda`` tests run real captures on the GPU machine."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback

from cg_lightning.trainer.step_update import EAGER, KEEP, PATIENCE, RESET, StepUpdate
from tests.helpers import WARMUP, cg_strategy
from tests.lightning_models import PlainAdamModel, loader
from tests.lightning_runs import OutcomeRecorder, assert_same, train

STEPS = 14


class WarmupAdamStep(PlainAdamModel):
    """The learning rate warmed up linearly over ``warmup`` steps by a per-step scheduler, then constant (or a
    cosine over the whole run: a new value every step)."""

    def __init__(self, warmup: int = 4, cosine: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.warmup, self.cosine = warmup, cosine

    def configure_optimizers(self):
        opt = self.make_optimizer(self.parameters())
        if self.cosine:
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
        else:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / self.warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _pair(model, *, steps=STEPS, recorder=OutcomeRecorder, graphs=None, **kwargs):
    """The same fit under "ddp" and under the strategy with ``graphs.capture_optimizer``; facts compared bit for bit.
    Returns the strategy."""
    ref = train("ddp", model, max_steps=steps, recorder=recorder, **kwargs)
    strategy = cg_strategy(capture_optimizer=True, **(graphs or {}))
    got = train(strategy, model, max_steps=steps, recorder=recorder, **kwargs)
    assert_same(ref.facts(), got.facts())
    return strategy


def test_with_a_constant_learning_rate_every_update_after_warmup_runs_in_the_step_graph(caplog):
    """No scheduler: the step is captured with the update at its end in step 2 and replayed with it in every later
    step; Lightning's ``optimizer.step()`` then only marks the step taken (the optimizer's own graph never
    records). One line announces the iteration graph. Weights, outputs, optimizer state and learning rates after
    every batch equal "ddp"."""
    with caplog.at_level(logging.INFO):
        strategy = _pair(PlainAdamModel, max_epochs=2)
    stats = strategy.last_step_graph_stats
    assert stats.refusal is None and stats.update_refusal is None, stats
    assert stats.captures == 1 and stats.updates == STEPS - WARMUP and stats.eager_steps == 0, stats
    assert strategy.last_optimizer_replays == stats.updates  # none from the optimizer's own graph
    lines = [r.getMessage() for r in caplog.records if "captured the whole training" in r.getMessage()]
    assert len(lines) == 1 and "iteration" in lines[0] and "optimizer update" in lines[0], lines


def test_a_warmup_schedule_keeps_the_update_beside_the_graph_until_the_rate_holds():
    """A per-step warmup over 6 steps: the step is captured without the update in step 2 (the rate changes every
    step) and the optimizer's own graph or cached step updates beside it; once the rate held two steps and the
    first recording served PATIENCE steps the step is captured again with the update. Exact throughout."""
    steps = 24
    strategy = _pair(lambda: WarmupAdamStep(warmup=6, batches=32), steps=steps)
    stats = strategy.last_step_graph_stats
    recaptured = WARMUP + PATIENCE  # the first step whose plain recording (step 2) served PATIENCE steps
    assert recaptured > 6  # the rate holds by then
    assert stats.captures == 2 and stats.updates == steps - recaptured and stats.eager_steps == 0, stats


def test_a_rate_that_changes_every_step_never_joins_the_step_graph():
    """A cosine schedule (a new rate every step): one capture without the update, the update beside it every step,
    exact."""
    strategy = _pair(lambda: WarmupAdamStep(cosine=True, batches=32), steps=STEPS)
    stats = strategy.last_step_graph_stats
    assert stats.captures == 1 and stats.updates == 0 and stats.update_refusal is None, stats


class EpochAdamStep(PlainAdamModel):
    """The learning rate halved at every epoch's end (a StepLR stepped per epoch)."""

    def configure_optimizers(self):
        opt = self.make_optimizer(self.parameters())
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def test_an_epoch_schedule_runs_one_eager_step_at_each_change_and_records_the_update_again():
    """16 batches an epoch, 3 epochs: the first step of each later epoch (a new rate) runs eagerly, the second
    captures the iteration again with the new rate; every other step after warmup replays with its update."""
    per_epoch = 16
    steps = 3 * per_epoch
    strategy = _pair(lambda: EpochAdamStep(batches=per_epoch), steps=steps, max_epochs=3)
    stats = strategy.last_step_graph_stats
    assert stats.eager_steps == 2 and stats.captures == 3, stats
    assert stats.updates == steps - WARMUP - 2, stats


class _SetLR(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            for g in trainer.optimizers[0].param_groups:
                g["lr"] = 0.003


def test_a_rate_set_by_a_callback_after_capture_is_never_replayed_with_the_old_value():
    """A float assigned to every group's ``lr`` at step 12: that step runs eagerly with it, step 13 records the
    iteration again, the rest replay; exact."""
    strategy = _pair(PlainAdamModel, steps=18, max_epochs=3, callbacks=[_SetLR(12)])
    stats = strategy.last_step_graph_stats
    assert stats.eager_steps == 1 and stats.captures == 2 and stats.updates == 18 - WARMUP - 1, stats


class _ReadsGradients(Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        pl_module.seen = [p.grad.clone() for p in pl_module.parameters()]


class _AfterBackward(PlainAdamModel):
    def on_after_backward(self) -> None:
        for p in self.parameters():
            p.grad.mul_(0.5)


@pytest.mark.parametrize("case,expected", [
    ("clip", "gradient clipping (gradient_clip_val=0.5)"),
    ("callback", "the callback _ReadsGradients implements on_before_optimizer_step"),
    ("hook", "_AfterBackward.on_after_backward is overridden"),
    ("sgd", "only a fused torch.optim.Adam/AdamW step"),
])
def test_what_runs_between_the_backward_and_the_update_keeps_the_update_out_of_the_step_graph(case, expected):
    """Clipping, a hook that sees the gradients before the update (it could change them, or read the weights), or an
    optimizer the step graph refuses: the step graph holds no update (the reason is kept), the optimizer steps beside
    it; the hooks see and do what they do under "ddp", bit for bit."""
    model, kwargs = PlainAdamModel, {}
    if case == "clip":
        kwargs = dict(gradient_clip_val=0.5)
    elif case == "callback":
        kwargs = dict(callbacks=[_ReadsGradients()])
    elif case == "hook":
        model = _AfterBackward
    else:
        def model():
            m = PlainAdamModel()
            m.optimizer_name = "adam"  # foreach Adam
            return m
    strategy = _pair(model, recorder=OutcomeRecorder, **kwargs)
    stats = strategy.last_step_graph_stats
    assert stats.refusal is None and stats.updates == 0 and expected in stats.update_refusal, stats


def test_a_transformers_llama_trains_with_its_whole_iteration_in_one_graph():
    """A random tiny ``LlamaForCausalLM`` with fused AdamW: the iteration (its constant host reads answered at
    capture) replays with the update from step 2 on; its weights equal "ddp"'s bit for bit."""
    hf = pytest.importorskip("tests.hf_models")
    steps = 8
    ref, _ = hf.fit_hf("ddp", hf.tiny_llama, steps=steps, fused=True)
    strategy = cg_strategy(capture_optimizer=True)
    got, _ = hf.fit_hf(strategy, hf.tiny_llama, steps=steps, fused=True)
    hf.assert_same_weights(got.model, ref.model)
    stats = strategy.last_step_graph_stats
    assert stats.refusal is None and stats.update_refusal is None and stats.updates == steps - WARMUP, stats


def _update(lr: float = 0.01) -> StepUpdate:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=lr, fused=True)
    p.grad = torch.ones(3)
    opt.step()
    trainer = SimpleNamespace(gradient_clip_val=None, callbacks=[])
    strategy = SimpleNamespace(optimizers=[opt], lightning_module=SimpleNamespace(trainer=trainer),
                               graph_options=SimpleNamespace(capture_optimizer=True),
                               engine=SimpleNamespace(params=[p], unused=None))
    p.main_grad = p.grad
    return StepUpdate(strategy, lambda: None, "eager", 30.0)


def test_values_that_flip_back_and_forth_cost_ever_fewer_recaptures():
    """The plan alone: a rate held two steps is recorded with the update; a change runs one step eagerly, then
    (held again) is recorded anew only if the recording served PATIENCE steps; one that served fewer is replaced by
    a recording without the update and the patience grows fourfold. A reset waits for a batch of a captured
    signature (``fits``)."""
    update = _update()
    group = update.optimizer.param_groups[0]
    update.observe()
    assert update.plan(has_graphs=False, fits=False) == (KEEP, True)
    update.tail()()  # what the capture records (here: runs)
    update.captured(include=True, first=True)
    for _ in range(PATIENCE):
        assert update.plan(has_graphs=True, fits=True) == (KEEP, True)
    group["lr"] = 0.02
    assert update.plan(has_graphs=True, fits=True) == (EAGER, False)
    assert update.plan(has_graphs=True, fits=False) == (EAGER, False)  # a short last batch: not captured
    assert update.plan(has_graphs=True, fits=True) == (RESET, True)  # held, the recording served PATIENCE
    update.tail()()
    update.captured(include=True, first=True)
    group["lr"] = 0.03  # a change right after the recording
    assert update.plan(has_graphs=True, fits=True) == (EAGER, False)
    assert update.plan(has_graphs=True, fits=True) == (RESET, False) and update.patience == 4 * PATIENCE
    update.captured(include=False, first=True)
    for _ in range(4 * PATIENCE - 1):
        assert update.plan(has_graphs=True, fits=True) == (KEEP, False)
    assert update.plan(has_graphs=True, fits=True) == (RESET, True)  # the 4 * PATIENCE-th step


def test_state_moved_to_other_storage_is_not_replayed_on_the_old_addresses():
    """``exp_avg.data = exp_avg.data.clone()`` (an offloaded state brought back): the same tensor object, new storage.
    A recording's kernels hold the old addresses, so the plan stops replaying it."""
    update = _update()
    update.observe()
    update.plan(has_graphs=False, fits=False)
    update.tail()()
    update.captured(include=True, first=True)
    assert update.plan(has_graphs=True, fits=True) == (KEEP, True)
    state = update.optimizer.state[update.optimizer.param_groups[0]["params"][0]]
    state["exp_avg"].data = state["exp_avg"].data.clone()
    assert update.plan(has_graphs=True, fits=True) != (KEEP, True)


def _lambda_clip(trainer, pl_module, optimizer):
    for p in pl_module.parameters():
        p.grad.mul_(0.5)


@pytest.mark.parametrize("how", ["lambda_callback", "module_attribute"])
def test_hooks_given_as_instance_attributes_keep_the_update_out_of_the_step_graph(how):
    """``LambdaCallback(on_before_optimizer_step=f)`` and a hook assigned to the module instance (``model.on_after_
    backward = ...``) are hooks like any other: the update stays out of the step's graph and the hook halves the
    gradients before it, as under "ddp"."""
    from lightning.pytorch.callbacks import LambdaCallback

    def model():
        m = PlainAdamModel()
        if how == "module_attribute":
            m.on_after_backward = lambda: [p.grad.mul_(0.5) for p in m.parameters()]
        return m

    callbacks = [LambdaCallback(on_before_optimizer_step=_lambda_clip)] if how == "lambda_callback" else []
    strategy = _pair(model, callbacks=callbacks)
    stats = strategy.last_step_graph_stats
    assert stats.updates == 0 and stats.update_refusal, stats


class _NewOptimizer(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 6:
            trainer.strategy.setup_optimizers(trainer)


class _ClipFrom(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 6:
            trainer.gradient_clip_val = 0.01


class _OptionOff(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 6 and hasattr(trainer.strategy, "graph_options"):  # not "ddp"'s
            trainer.strategy.graph_options.capture_optimizer = False


@pytest.mark.parametrize("callback,reason", [(_NewOptimizer, "the optimizer was replaced"),
                                             (_ClipFrom, "gradient clipping (gradient_clip_val=0.01)"),
                                             (_OptionOff, "graphs.capture_optimizer was turned off")])
def test_a_new_optimizer_or_clipping_during_the_fit_takes_the_update_out_of_the_graph(callback, reason, caplog):
    """``strategy.setup_optimizers``, ``trainer.gradient_clip_val`` or ``graphs.capture_optimizer: false`` set at step
    6, after the update joined the step's graph: from that step on the step's graph holds no update (one line says
    why) and the new optimizer steps, or the gradients are clipped before the update, as under "ddp"."""
    with caplog.at_level(logging.INFO):
        strategy = _pair(PlainAdamModel, steps=12, max_epochs=2, callbacks=[callback()])
    stats = strategy.last_step_graph_stats
    assert stats.updates == 6 - WARMUP and reason in stats.update_refusal, stats
    assert any("leaves the step's graph" in r.getMessage() for r in caplog.records)


def test_a_change_on_an_epochs_short_last_batch_records_again_on_a_full_batch():
    """30 samples in batches of 4 (a batch of 2 ends each epoch) and a new rate at the step before a short batch:
    the update is recorded again on the next full batch, not for the short one (which would leave every full batch
    eager)."""
    class Ragged(PlainAdamModel):
        def train_dataloader(self):
            return loader(30)

    strategy = _pair(Ragged, steps=24, max_epochs=3, callbacks=[_SetLR(6)])
    stats = strategy.last_step_graph_stats
    assert stats.signatures[-1].startswith("Tensor[4") and stats.eager_steps <= 6, stats


class _GradsAfterStep(Callback):
    """Every parameter's ``.grad`` after each batch (``None`` where it is ``None``), into the recorded facts."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.events.append({"hook": "grads_after_step", "step": trainer.global_step, "grads": {
            n: None if p.grad is None else p.grad.detach().clone() for n, p in pl_module.named_parameters()}})


def test_find_unused_parameters_keeps_the_update_out_and_trains_like_ddp():
    """``find_unused_parameters`` with a head that never joins the loss: which parameters have a gradient is known
    only after each backward (the engine hides the others' from the optimizer), so the update is not recorded into
    the step's graph; the reason says so, and the hooks after the step see the gradients "ddp" shows."""
    class Unused(PlainAdamModel):
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Linear(8, 1)

    kwargs = dict(max_steps=STEPS, max_epochs=2, recorder=OutcomeRecorder, callbacks=[_GradsAfterStep()])
    ref = train("ddp_find_unused_parameters_true", Unused, **kwargs)
    strategy = cg_strategy(capture_optimizer=True, ddp={"find_unused_parameters": True})
    got = train(strategy, Unused, **kwargs)
    assert_same(ref.facts(), got.facts())
    stats = strategy.last_step_graph_stats
    assert stats.updates == 0 and "find_unused_parameters" in stats.update_refusal, stats


class _HookFrom(Callback):
    """At step 6 sets ``on_after_backward`` on the module, or ``on_before_optimizer_step`` on this callback, as
    instance attributes: each halves the gradients before the update."""

    def __init__(self, where: str) -> None:
        self.where = where

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != 6:
            return
        if self.where == "module":
            pl_module.on_after_backward = lambda: [p.grad.mul_(0.5) for p in pl_module.parameters()]
        else:
            self.on_before_optimizer_step = lambda trainer, module, optimizer: [
                p.grad.mul_(0.5) for p in module.parameters()]


@pytest.mark.parametrize("where", ["module", "callback"])
def test_a_hook_set_as_an_attribute_during_the_fit_takes_the_update_out(where):
    """A hook between the backward and the update set on the module or on a callback during the fit (step 6): the
    update leaves the step's graph at that step, so the hook runs before it, as under "ddp"."""
    strategy = _pair(PlainAdamModel, steps=12, max_epochs=2, callbacks=[_HookFrom(where)])
    stats = strategy.last_step_graph_stats
    assert stats.updates == 6 - WARMUP and "changed during the fit" in stats.update_refusal, stats


def test_a_callback_swapped_for_another_is_seen_even_where_python_reuses_its_id():
    """The fingerprint keeps the callbacks themselves (compared by identity): a callback removed and another appended
    in its place, with a hook before the update, refuses the update at the next step."""
    update = _update()
    update.observe()
    update.plan(has_graphs=False, fits=False)
    callbacks = update.strategy.lightning_module.trainer.callbacks
    callbacks.append(Callback())
    assert update.plan(has_graphs=False, fits=False)[0] == KEEP and update.refusal is None

    class Scales(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            pass

    callbacks[0] = Scales()
    update.plan(has_graphs=False, fits=False)
    assert "Scales implements on_before_optimizer_step" in update.refusal


def test_a_capture_that_found_a_parameter_without_state_takes_the_update_out():
    """The tail of a capture found a parameter with a gradient and no Adam state (its first gradient): that graph
    holds no update (the step's own ``optimizer.step()`` runs), and the next step drops the graphs, for good."""
    update = _update()
    update.observe()
    assert update.plan(has_graphs=False, fits=False) == (KEEP, True)
    update.missing = True  # as the tail leaves it
    assert update.captured(include=True, first=True) is False
    assert update.refusal and update.plan(has_graphs=True, fits=True) == (RESET, False)
