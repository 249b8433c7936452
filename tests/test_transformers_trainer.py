"""``CUDAGraphTrainer`` against the plain ``transformers.Trainer``, bit for bit on a tiny random Llama (no downloads):
accumulation, clipping, bf16, evaluation, checkpoints and ``resume_from_checkpoint``; graphs on the eager backend on
the CPU, real CUDA graphs on the GPU; the settings it refuses."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cg_lightning.accelerate import CUDAGraphAccelerator  # noqa: E402
from cg_lightning.transformers import CUDAGraphTrainer  # noqa: E402
from tests.hf_models import TokenDataset, logged, tiny_llama, trainer_args  # noqa: E402

def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_llama(attn_implementation="eager")


@pytest.fixture(autouse=True)
def _one_process(fresh_accelerate_state):
    """Every test here runs in a fresh single-process world (``tests/conftest.py``)."""


def _args(tmp_path, name: str, **overrides) -> "transformers.TrainingArguments":
    return trainer_args(str(tmp_path / name), **overrides)


class _StopAt(transformers.TrainerCallback):
    """Stops training after ``step`` optimizer steps, as a preempted job would (the schedule still ends at
    ``max_steps``)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


def _fit(cls, tmp_path, name: str, resume=None, stop_at=None, **overrides):
    AcceleratorState = __import__("accelerate.state", fromlist=["AcceleratorState"]).AcceleratorState
    AcceleratorState._reset_state(True)
    extra = {"graphs": {"warmup_steps": 1}} if cls is CUDAGraphTrainer else {}
    callbacks = [_StopAt(stop_at)] if stop_at else None
    trainer = cls(model=_llama(), args=_args(tmp_path, name, **overrides), train_dataset=TokenDataset(64, 1),
                  eval_dataset=TokenDataset(16, 2), callbacks=callbacks, **extra)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _assert_same(got, ref):
    assert logged(got) == logged(ref)
    for (name, p), q in zip(got.model.named_parameters(), ref.model.parameters()):
        assert torch.equal(p, q), f"{name}: max abs diff {(p - q).abs().max().item():.3g}"


@pytest.mark.parametrize("bf16", [False, True])
def test_training_equals_the_plain_trainer(tmp_path, bf16):
    ref = _fit(transformers.Trainer, tmp_path, "ref", bf16=bf16)
    got = _fit(CUDAGraphTrainer, tmp_path, "cg", bf16=bf16)
    assert isinstance(got.accelerator, CUDAGraphAccelerator)
    _assert_same(got, ref)
    assert any("eval_loss" in e for e in got.state.log_history)
    assert os.path.isdir(tmp_path / "cg" / "checkpoint-3") and os.path.isdir(tmp_path / "cg" / "checkpoint-6")


def test_the_layers_are_graphed_and_replayed(tmp_path):
    seen = {}

    class Probe(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            engines = trainer.accelerator._graph_engines
            seen[state.global_step] = engines[0].graph_stats.forward_replays if engines else None

    trainer = CUDAGraphTrainer(model=_llama(), args=_args(tmp_path, "cg", eval_strategy="no"),
                               train_dataset=TokenDataset(64, 1), graphs={"warmup_steps": 1}, callbacks=[Probe()])
    trainer.train()
    assert seen[1] == 0 and seen[6] > seen[3] > 0, seen  # 3 decoder layers replayed from the second step on


def test_resume_from_a_checkpoint_equals_the_run_that_did_not_stop(tmp_path):
    whole = _fit(CUDAGraphTrainer, tmp_path, "whole")
    _fit(CUDAGraphTrainer, tmp_path, "first", stop_at=3)
    resumed = _fit(CUDAGraphTrainer, tmp_path, "first", resume=str(tmp_path / "first" / "checkpoint-3"))
    for (name, p), q in zip(resumed.model.named_parameters(), whole.model.parameters()):
        assert torch.equal(p, q), name
    ref_resumed = _fit(transformers.Trainer, tmp_path, "first", resume=str(tmp_path / "first" / "checkpoint-3"))
    _assert_same(resumed, ref_resumed)


def test_training_arguments_ddp_settings_become_the_engine_options(tmp_path):
    trainer = CUDAGraphTrainer(model=_llama(), args=_args(tmp_path, "cg", ddp_bucket_cap_mb=7, eval_strategy="no",
                                                         ddp_find_unused_parameters=False),
                               train_dataset=TokenDataset(8, 1), ddp={"timeout_s": 60})
    opts = trainer.accelerator.ddp_options
    assert (opts.bucket_size_mb, opts.find_unused_parameters, opts.timeout_s) == (7, False, 60)
    given = CUDAGraphTrainer(model=_llama(), args=_args(tmp_path, "cg2", ddp_bucket_cap_mb=7, eval_strategy="no"),
                             train_dataset=TokenDataset(8, 1), ddp={"bucket_size_mb": 3})
    assert given.accelerator.ddp_options.bucket_size_mb == 3  # ddp= wins over TrainingArguments


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("bf16", [False, True])
def test_two_processes_equal_the_plain_trainer(tmp_path, bf16):
    """Under torchrun's environment on 2 processes (gloo): every rank's logged losses, evaluation losses, gradient
    norms and final weights equal the plain ``transformers.Trainer``'s (torch DDP) bit for bit, the layers replayed."""
    from tests.launchers import run_ranks

    run_ranks("tests/scripts/hf_trainer_dist.py", [(["--out", str(tmp_path), *(["--bf16"] if bf16 else [])], 2)],
              str(tmp_path), timeout=240)
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        ref, got = res["Trainer"], res["CUDAGraphTrainer"]
        assert ref["world_size"] == got["world_size"] == 2
        assert got["logged"] == ref["logged"] and any(v for _, v in ref["logged"]), rank
        for name, p in ref["weights"].items():
            assert torch.equal(got["weights"][name], p), f"rank {rank}: {name}"
        assert got["forward_replays"] > 0, got["forward_replays"]


@pytest.mark.parametrize("overrides, match", [
    ({"torch_compile": True}, "torch_compile"),
    ({"ddp_static_graph": True}, "ddp_static_graph"),
])
def test_settings_the_engine_does_not_serve_are_refused(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=f"CUDAGraphTrainer does not support TrainingArguments {match}"):
        CUDAGraphTrainer(model=_llama(), args=_args(tmp_path, "cg", **overrides), train_dataset=TokenDataset(8, 1))


def test_the_distributed_optimizer_is_refused(tmp_path):
    """The Trainer saves the main process's optimizer state only: with each rank's shard that would lose state."""
    with pytest.raises(ValueError, match="with ddp.distributed_optimizer .*saves the optimizer state of the main"):
        CUDAGraphTrainer(model=_llama(), args=_args(tmp_path, "cg"), train_dataset=TokenDataset(8, 1),
                         ddp={"distributed_optimizer": True})


def test_a_bad_option_is_named(tmp_path):
    with pytest.raises((TypeError, ValueError), match="graphs.warmup_steps"):
        CUDAGraphTrainer(model=_llama(), args=_args(tmp_path, "cg"), train_dataset=TokenDataset(8, 1),
                         graphs={"warmup_steps": -1})


def test_the_example_script_fine_tunes_with_evaluation_and_checkpoints(tmp_path):
    import subprocess
    import sys

    from tests.helpers import ROOT, subprocess_env

    out = str(tmp_path / "run")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_transformers.py"), "--cpu",
                           "--size", "tiny", "--steps", "4", "--log-every", "1", "--out", out],
                          env=subprocess_env(PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "captured 2 layer calls" in done.stdout + done.stderr and "eval_loss" in done.stdout, done.stdout
    assert os.path.isdir(os.path.join(out, "checkpoint-4"))


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_real_graphs_equal_the_plain_trainer(tmp_path, precision, deterministic):
    """On the GPU with CUDA graphs (fp16 through Accelerate's GradScaler), deterministic kernels, bit for bit."""
    kw = dict(use_cpu=False, bf16=precision == "bf16", fp16=precision == "fp16")
    ref = _fit(transformers.Trainer, tmp_path, "ref", **kw)
    got = _fit(CUDAGraphTrainer, tmp_path, "cg", **kw)
    _assert_same(got, ref)
    print(f"transformers.Trainer {precision} cuda graphs: losses and weights equal")
