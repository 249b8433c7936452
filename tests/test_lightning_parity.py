"""Wherever ``Trainer(strategy="ddp")`` trains, ``Trainer(strategy="cudagraph_ddp")`` trains too, with equal results.

Each case trains the same module on the same seed and data twice on the CPU, under a reference strategy
(``"ddp"``) and under its candidate (the plain string ``"cudagraph_ddp"``; :data:`tests.lightning_runs.CANDIDATE`),
and requires every recorded fact to be bit-for-bit equal (``torch.equal``, tolerance zero): losses, gradients in the
hooks that see them, weights and learning rates after every batch, evaluation outputs, final weights, optimizer,
scheduler and loop state. Behaviours follow Lightning's own loop, optimization and hook tests
(Lightning-AI/pytorch-lightning, tests/tests_pytorch/{loops,trainer,core,models}).
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint

from tests.lightning_manual_models import (CallLogManualModel, CallLogModel, GANModel, ManualModel,
                                           TwoOptimizerModel)
from tests.lightning_models import (ClipHeadModel, ParityModel, SkipStepModel, WarmupStepModel,
                                    ZeroGradModel)
from tests.lightning_runs import (GRAD_HOOKS, CallLog, GradProbe, assert_same, candidate, check,
                                  first_difference, train)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _restore_determinism():
    """``Trainer(deterministic=True)`` switches torch's deterministic algorithms on for the process."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


# ----------------------------------------------------------------- models and optimizers
@pytest.mark.parametrize("body", ["linear", "sequential", "modulelist"])
def test_fit(body):
    check("ddp", lambda: ParityModel(body), max_epochs=2)


@pytest.mark.parametrize("optimizer", ["adam", "lbfgs"])
def test_optimizer(optimizer):
    """Adam; LBFGS, whose closure runs forward and backward several times per optimizer step."""
    check("ddp", lambda: ParityModel(optimizer=optimizer, lr=0.5 if optimizer == "lbfgs" else 0.01), max_steps=5)


def test_precision_64_true():
    check("ddp", lambda: ParityModel(), precision="64-true", max_epochs=2)


def test_dropout_in_blocks():
    check("ddp", lambda: ParityModel(dropout=0.2), max_epochs=2)


def test_frozen_parameters():
    check("ddp", lambda: ParityModel(frozen=True), max_epochs=2)


def test_find_unused_parameters_branch_used_on_some_steps():
    """An extra head joins the loss on even batches only: its ``.grad`` stays ``None`` on the others, and SGD
    with momentum skips it there."""
    check("ddp_find_unused_parameters_true", lambda: ParityModel(branch="step"), max_epochs=2)


def test_training_step_returns_none_on_some_batches():
    check("ddp", lambda: ParityModel(skip_every=3), max_epochs=2)


@pytest.mark.parametrize("model", [WarmupStepModel, SkipStepModel, ZeroGradModel],
                         ids=["optimizer_step_lr_warmup", "optimizer_step_skipped", "zero_grad_in_place"])
def test_overridden_step_hooks(model):
    check("ddp", lambda: model(), max_epochs=2)


def test_fit_twice_continues_from_the_trained_weights():
    def twice(strategy):
        first = train(strategy, lambda: ParityModel(optimizer="adam", lr=0.01), max_epochs=1)
        return train(strategy, first.model, seed=None, max_epochs=2)

    assert_same(twice("ddp").facts(), twice(candidate("ddp")).facts())


# ----------------------------------------------------------------- accumulation and clipping
@pytest.mark.parametrize("body,accumulate", [("modulelist", 2), ("modulelist", 3), ("sequential", 2)])
def test_accumulate_grad_batches(body, accumulate):
    """8 batches an epoch: with 3 the last window of each epoch has 2 batches, stepped at the epoch's end."""
    check("ddp", lambda: ParityModel(body, optimizer="adam", lr=0.01), max_epochs=2,
          accumulate_grad_batches=accumulate)


def test_gradient_accumulation_scheduler():
    check("ddp", lambda: ParityModel(), max_epochs=3,
          callbacks=[GradientAccumulationScheduler(scheduling={0: 1, 1: 2, 2: 4})])


@pytest.mark.parametrize("algorithm,value,accumulate", [("norm", 0.05, 1), ("value", 0.01, 1), ("norm", 0.05, 2)])
def test_gradient_clipping(algorithm, value, accumulate):
    check("ddp", lambda: ParityModel(), max_epochs=2, gradient_clip_algorithm=algorithm, gradient_clip_val=value,
          accumulate_grad_batches=accumulate)


def test_configure_gradient_clipping_override_sees_gradients():
    check("ddp", lambda: ClipHeadModel(), max_epochs=2)


# ----------------------------------------------------------------- learning-rate schedulers
@pytest.mark.parametrize("scheduler", ["step", "epoch", "plateau", "plateau_val", "plateau_step"])
def test_lr_scheduler(scheduler):
    check("ddp", lambda: ParityModel(scheduler=scheduler), max_epochs=4,
          limit_val_batches=1.0 if scheduler == "plateau_val" else 0)


# ----------------------------------------------------------------- checkpoints and resuming
def _fit_and_save(strategy, tmp_path, **kwargs):
    run = train(strategy, lambda: ParityModel(optimizer="adam", lr=0.01, scheduler="epoch"), max_epochs=2, **kwargs)
    path = tmp_path / f"{strategy}.ckpt"
    run.trainer.save_checkpoint(path)
    return run, path


def _resume(strategy, path, **kwargs):
    """A module built from another seed (so only the checkpoint can make it equal), resumed to epoch 4."""
    return train(strategy, lambda: ParityModel(optimizer="adam", lr=0.01, scheduler="epoch"), seed=99,
                 calls=[("fit", {"ckpt_path": str(path)})], max_epochs=4, **kwargs)


def test_checkpoint_contents(tmp_path):
    """Every entry of the reference's checkpoint is in the candidate's, equal (weights, optimizer and scheduler
    states, loops, epoch, global step)."""
    _, ref_path = _fit_and_save("ddp", tmp_path, accumulate_grad_batches=2)
    _, cand_path = _fit_and_save(candidate("ddp"), tmp_path, accumulate_grad_batches=2)
    ref, cand = torch.load(ref_path, weights_only=False), torch.load(cand_path, weights_only=False)
    assert_same(ref, {k: cand.get(k) for k in ref})


def test_resume_from_own_checkpoint(tmp_path):
    refs = _resume("ddp", _fit_and_save("ddp", tmp_path)[1])
    cands = _resume(candidate("ddp"), _fit_and_save(candidate("ddp"), tmp_path)[1])
    assert refs.trainer.global_step == 32
    assert_same(refs.facts(), cands.facts())


@pytest.mark.parametrize("saved_by", ["reference", "candidate"])
def test_resume_across_strategies(tmp_path, saved_by):
    """Either strategy resumes the other's checkpoint as the reference resumes its own."""
    ref_path = _fit_and_save("ddp", tmp_path)[1]
    own = _resume("ddp", ref_path)
    if saved_by == "reference":
        other = _resume(candidate("ddp"), ref_path)
    else:
        other = _resume("ddp", _fit_and_save(candidate("ddp"), tmp_path)[1])
    assert_same(own.facts(), other.facts())


def test_resume_mid_epoch_restores_loop_state(tmp_path):
    """A checkpoint saved every 3 optimizer steps (accumulating 2 batches a step); resuming from the step-3 one
    restores global step, epoch and batch progress as under the reference."""
    def run(strategy):
        ckpt = ModelCheckpoint(dirpath=tmp_path / strategy, every_n_train_steps=3, save_top_k=-1)
        first = train(strategy, lambda: ParityModel(optimizer="adam", lr=0.01), max_epochs=1,
                      accumulate_grad_batches=2, callbacks=[ckpt], enable_checkpointing=True)
        path = tmp_path / strategy / "epoch=0-step=3.ckpt"
        second = train(strategy, lambda: ParityModel(optimizer="adam", lr=0.01), seed=99, max_epochs=2,
                       accumulate_grad_batches=2, calls=[("fit", {"ckpt_path": str(path)})])
        return first, second

    ref_first, ref = run("ddp")
    cand_first, cand = run(candidate("ddp"))
    assert ref.model.events[0] == {"hook": "train_start", "step": 3, "epoch": 0}
    assert_same(ref_first.facts(), cand_first.facts())
    assert_same(ref.facts(), cand.facts())


# ----------------------------------------------------------------- manual optimization
@pytest.mark.parametrize("kwargs", [{}, {"accumulate": 2}, {"accumulate": 2, "no_sync": True}, {"closure": True},
                                    {"schedule": True, "scheduler": "epoch"}],
                         ids=["one_optimizer", "accumulate_by_hand", "accumulate_without_sync", "step_with_closure",
                              "scheduler_by_hand"])
def test_manual_optimization(kwargs):
    check("ddp", lambda: ManualModel(**kwargs), max_epochs=2)


@pytest.mark.parametrize("shared,reference", [(False, "ddp_find_unused_parameters_true"), (True, "ddp")],
                         ids=["toggled_disjoint", "shared_parameters"])
def test_manual_two_optimizers(shared, reference):
    """Toggling leaves the other optimizer's parameters without gradients, which "ddp" refuses: Lightning's
    multi-optimizer examples use its find-unused variant."""
    check(reference, lambda: TwoOptimizerModel(shared=shared), max_epochs=2)


def test_manual_gan_blocks_run_unequal_times_per_backward():
    check("ddp_find_unused_parameters_true", GANModel, max_epochs=2)


# ----------------------------------------------------------------- hooks
@pytest.mark.parametrize("hook", GRAD_HOOKS)
def test_gradients_visible_in_hook(hook):
    """The gradients each hook sees, with 2 batches accumulated per step: mid-window sums, the step's
    gradients, and (``on_before_zero_grad``, ``on_train_batch_end``) the previous step's until zeroed."""
    check("ddp", lambda: ParityModel(), max_epochs=2, accumulate_grad_batches=2, callbacks=[GradProbe([hook])])


def test_hook_order_automatic():
    check("ddp", lambda: CallLogModel(scheduler="step"), max_epochs=2, accumulate_grad_batches=2,
          gradient_clip_val=1.0, limit_val_batches=1.0, callbacks=[CallLog()])


def test_hook_order_and_gradients_manual():
    check("ddp", lambda: CallLogManualModel(accumulate=2), max_epochs=2, callbacks=[CallLog(), GradProbe()])


# ----------------------------------------------------------------- validate, test, predict
@pytest.mark.parametrize("after_fit", [False, True], ids=["fresh", "after_fit"])
@pytest.mark.parametrize("fn", ["validate", "test", "predict"])
def test_evaluation(fn, after_fit):
    check("ddp", lambda: ParityModel(), calls=["fit", fn] if after_fit else [fn], limit_val_batches=1.0)


def test_validation_during_fit():
    check("ddp", lambda: ParityModel(), max_epochs=2, limit_val_batches=1.0, val_check_interval=3,
          num_sanity_val_steps=2)


# ----------------------------------------------------------------- the comparison itself
def test_comparison_names_the_first_difference():
    a = {"events": [{"hook": "x", "step": 0, "g": torch.ones(2)}], "w": torch.zeros(1)}
    b = {"events": [{"hook": "x", "step": 0, "g": torch.tensor([1.0, 1.5])}], "w": torch.ones(1)}
    assert first_difference(a, a) is None
    assert first_difference(a, b).startswith("events[0]<x step 0>['g']: values differ")
    assert "None" in first_difference({"g": torch.ones(1)}, {"g": None})
    assert "float64" in first_difference(torch.ones(1), torch.ones(1, dtype=torch.float64))


# ----------------------------------------------------------------- two processes over gloo
DIST_SCENARIOS = ["fit", "accumulate_clip", "manual_accumulate", "manual_accumulate_no_sync", "gan",
                  "find_unused_by_rank", "whole_step", "iteration_graph", "iteration_graph_rank_rate",
                  "iteration_graph_rank_shapes", "iteration_graph_rank_warmup_rate", "iteration_graph_rank_hook"]


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory):
    """Both sides of every two-process scenario: one two-process run of ``tests/scripts/lightning_parity_dist.py`` (torchrun's environment)
    (at most 200 s); maps side -> directory of per-scenario, per-rank results."""
    from tests.launchers import run_ranks

    out = tmp_path_factory.mktemp("dist")
    try:
        run_ranks("tests/scripts/lightning_parity_dist.py", [(["--out", str(out), *DIST_SCENARIOS], 2)], str(out),
                  timeout=200)
    except AssertionError as e:  # each scenario reports its own missing results
        (out / "launch.log").write_text(str(e))
    return {side: out / side for side in ("reference", "candidate")}


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("scenario", DIST_SCENARIOS)
def test_two_processes(dist_runs, scenario):
    """Each rank's facts equal between the sides: plain training; Adam with 2 batches accumulated and clipping
    by norm; manual accumulation; the GAN; a head used on one rank at a time (find-unused strategies); the whole
    step replayed as one graph (``graphs.whole_step``) with clipping; the fused AdamW update inside the step's graph
    (``graphs.capture_optimizer``); a rate changed on rank 0 only, which takes the update out on both ranks (their
    agreement) instead of leaving them to capture at different steps; a rate changed on both while one rank's next
    batch has another shape (both capture again one step later); a rate that held two steps at the capture on one
    rank only; a hook before the update on one rank only (both keep the update out)."""
    for rank in (0, 1):
        sides = {}
        for side, folder in dist_runs.items():
            err = folder / f"{scenario}.rank{rank}.err"
            assert not err.exists(), f"{side} rank {rank}: {err.read_text().splitlines()[0]}"
            path = folder / f"{scenario}.rank{rank}.pt"
            log = folder.parent / "launch.log"
            assert path.exists(), f"{side} rank {rank}: no result; {log.read_text()[-3000:] if log.exists() else ''}"
            sides[side] = torch.load(path, weights_only=False)
        assert_same(sides["reference"], sides["candidate"])
        if scenario == "whole_step":  # the candidate's steps after warmup were replayed from its step graph
            replays = dist_runs["candidate"] / f"{scenario}.rank{rank}.replays"
            assert replays.exists() and int(replays.read_text()) > 0, f"rank {rank}: no step replayed"
        if scenario.startswith("iteration_graph"):  # 2 steps of warmup, then updates in the step's graph
            updates, refusal = (dist_runs["candidate"] / f"{scenario}.rank{rank}.updates").read_text().split("\n")
            if scenario == "iteration_graph":  # 12 steps
                assert int(updates) == 10 and refusal == "None", (rank, updates, refusal)
            elif scenario == "iteration_graph_rank_rate":  # out from step 5
                assert int(updates) == 3 and "differ between ranks" in refusal, (rank, updates, refusal)
            elif scenario == "iteration_graph_rank_shapes":  # 14 steps: 10 (a new rate) and 11 (rank 1's other
                # shape) eager, recorded again at 12
                assert int(updates) == 10 and refusal == "None", (rank, updates, refusal)
            elif scenario == "iteration_graph_rank_warmup_rate":  # 12 steps, recorded at step 2 + 8
                assert int(updates) == 2 and refusal == "None", (rank, updates, refusal)
            else:
                why = "on_before_optimizer_step is overridden" if rank == 0 else "another rank refuses it"
                assert int(updates) == 0 and why in refusal, (rank, updates, refusal)

