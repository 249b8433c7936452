"""Training state across steps under ``strategy="cudagraph_ddp"``.

* Buffers: BatchNorm running statistics inside graphed layers evolve as in eager training (warmup and
  capture leave them untouched) and, with several processes, are broadcast from rank 0 before forwards
  on torch DDP's schedule (``DDPOptions.broadcast_buffers``), in place.
* Dropout inside graphed layers: a new mask at every replay, reproducible from the seed, and on the
  eager backend the same losses as Lightning's ``"ddp"``.
* Resume: a run checkpointed by ``ModelCheckpoint`` mid-epoch and resumed with ``trainer.fit(ckpt_path=...)``
  continues bit for bit as the uninterrupted run, re-capturing its graphs.

References are Lightning's own ``"ddp"`` strategy on the same seed and data.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from cg_lightning.examples.gpt import GPT
from tests.engine_models import BACKENDS, graphed_engine
from tests.helpers import (
    cg_strategy, fit_whole_epochs, make_trainer, max_rel_diff, state_rel_diff, train_in_process,
    train_subprocess,
)
from tests.recorders import GradRecorder
from tests.scripts.train_parity import BNData, BNLightningModule


# ----------------------------------------------------------------------------------------------- buffers
def _fit_bn(strategy, steps=5, seed=3):
    seed_everything(seed, workers=True)
    model = BNLightningModule()
    rec = GradRecorder()
    make_trainer(strategy, steps, [rec]).fit(model, datamodule=BNData())
    return model, rec


def test_batchnorm_running_stats_single_process_match_ddp():
    """BatchNorm1d inside two graphed blocks (``GraphOptions(layers=["blocks.*"])``), 5 steps, 1 process:
    losses, weights and every buffer (running_mean, running_var, num_batches_tracked) equal "ddp" within
    1e-6. The probe, warmup and capture forwards (three per block on the eager backend) ran BatchNorm in
    train mode; ``capture_in_order`` restored the layers' buffers afterwards, so ``num_batches_tracked`` is
    exactly the number of training steps and the running statistics saw each batch once."""
    steps, warmup = 5, 2
    ref_model, ref = _fit_bn("ddp", steps)
    strategy = cg_strategy(warmup_steps=warmup, layers=["blocks.*"], whole_step=False)
    model, rec = _fit_bn(strategy, steps)

    stats = strategy.last_graph_stats
    assert stats.captured_runners == 2
    assert stats.forward_replays == 2 * (steps - warmup)
    assert len(rec.losses) == len(ref.losses) == steps
    assert max_rel_diff(rec.losses, ref.losses) < 1e-6
    got, want = model.state_dict(), ref_model.state_dict()
    assert got.keys() == want.keys()
    assert {k for k in got if "running" in k} == {f"blocks.{i}.bn.running_{s}" for i in (0, 1) for s in ("mean", "var")}
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6, msg=k)
    for i in (0, 1):
        assert int(got[f"blocks.{i}.bn.num_batches_tracked"]) == steps
        # the statistics moved away from their initial values (0 and 1): the test is not vacuous
        assert float(got[f"blocks.{i}.bn.running_mean"].abs().max()) > 1e-2


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_batchnorm_two_process_buffer_broadcast(tmp_path):
    """gloo, 2 processes, 6 optimizer steps of 2 accumulated micro-batches, the BatchNorm model on
    rank-dependent data (odd samples, rank 1's, are shifted and scaled): losses, weights and rank 0's
    buffers equal "ddp" within 1e-5, and so do rank 1's buffers, which only the broadcast from rank 0
    makes equal; with accumulation that takes torch DDP's schedule (a broadcast before the first
    micro-batch of each optimizer step, none before the ones that follow a ``no_sync`` forward). Control: with
    ``ddp.broadcast_buffers=False`` rank 1's running statistics differ from "ddp" by far more (while rank
    0's, the broadcast source, and the losses do not change: in train mode BatchNorm normalizes with the
    batch statistics, so running statistics never reach the loss)."""
    common = ["--model", "bn", "--devices", "2", "--steps", "6", "--accumulate", "2", "--backend", "eager",
              "--warmup-steps", "2"]
    ref = train_subprocess(str(tmp_path / "ddp.pt"), "--strategy", "ddp", *common, timeout=200)
    cg = train_subprocess(str(tmp_path / "cg.pt"), "--strategy", "cudagraph_ddp", *common, timeout=200)
    off = train_subprocess(str(tmp_path / "off.pt"), "--strategy", "cudagraph_ddp", "--no-broadcast-buffers",
                           *common, timeout=200)

    assert cg["stats"]["captured_runners"] == 2
    assert cg["stats"]["forward_replays"] == 2 * 2 * (6 - 2)  # blocks x micro-batches x replayed steps
    assert len(cg["losses"]) == len(ref["losses"]) == 12
    assert max_rel_diff(cg["losses"], ref["losses"]) < 1e-5
    assert state_rel_diff(cg["state"], ref["state"]) < 1e-5
    assert len(cg["rank_buffers"]) == len(ref["rank_buffers"]) == 2
    for rank in (0, 1):
        assert state_rel_diff(cg["rank_buffers"][rank], ref["rank_buffers"][rank]) < 1e-5, rank
        assert int(cg["rank_buffers"][rank]["blocks.0.bn.num_batches_tracked"]) == 12
    # the ranks' data differ, so their statistics do (the last forward updated each with its own batch)
    assert state_rel_diff(ref["rank_buffers"][1], ref["rank_buffers"][0]) > 1e-2

    assert max_rel_diff(off["losses"], ref["losses"]) < 1e-5
    assert state_rel_diff(off["rank_buffers"][0], ref["rank_buffers"][0]) < 1e-5
    assert state_rel_diff(off["rank_buffers"][1], ref["rank_buffers"][1]) > 1e-2


# ----------------------------------------------------------------------------------------------- dropout
class _Blocks(nn.Module):
    """The example GPT's blocks alone: the embedding dropout (eager, outside any graph) is left out, so
    any change between two calls on the same input comes from inside the graphed blocks."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.blocks = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32, dropout=dropout).blocks

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _replayed_outputs(device: str, backend: str, dropout: float, steps: int = 4):
    torch.manual_seed(0)
    model = _Blocks(dropout).to(device)
    manager, engine = graphed_engine(model, device, layers=["blocks.*"], backend=backend)
    x = torch.randn(4, 16, 32, device=device, requires_grad=True)
    outs = []
    for step in range(steps):  # no optimizer step: the weights never change
        manager.begin_step(step)
        y = engine(x)
        y.square().mean().backward()
        manager.end_step()
        engine.finish_grad_sync()
        outs.append(y.detach().clone())
        engine.zero_grad_buffer()
        x.grad = None
    assert manager.captured
    assert manager.stats.forward_replays == 2 * (steps - 1)  # step 0 eager, steps 1.. replayed
    manager.remove()
    engine.close()
    return outs


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_dropout_masks_change_between_replays(backend, device):
    """Same input, same weights (no optimizer step), train mode: two consecutive replayed steps give
    different outputs with dropout 0.2 (a new mask per replay), identical ones with dropout 0 (the
    difference comes from dropout, nothing else). On the eager backend this holds by construction; on the
    ``cuda`` backend it checks graph-safe RNG (a mask frozen at capture would repeat)."""
    outs = _replayed_outputs(device, backend, dropout=0.2)
    for a, b in ((outs[1], outs[2]), (outs[2], outs[3])):
        assert float((a - b).abs().max()) > 1e-2
    same = _replayed_outputs(device, backend, dropout=0.0)
    assert torch.equal(same[1], same[2]) and torch.equal(same[2], same[3])


def test_dropout_reproducible_and_matches_ddp():
    """The example GPT with dropout 0.1 (embedding, attention, residual; the last two inside the graphed
    blocks), 8 steps of which 6 replayed, eager backend: two runs from ``seed_everything(7)`` give
    identical losses; the losses and final weights equal Lightning "ddp" with the same seed (warmup and
    capture draw random numbers, but ``capture_in_order`` restores the RNG state, and an eager-backend
    replay draws exactly what the eager forward draws). Control: the same run without dropout gives other
    losses (dropout is really active in the graphed run)."""
    steps, warmup = 8, 2
    mk = {"dropout": 0.1}

    s1, s2 = cg_strategy(warmup_steps=warmup, whole_step=False), cg_strategy(warmup_steps=warmup, whole_step=False)
    m1, r1, _ = train_in_process(s1, steps=steps, model_kwargs=mk)
    m2, r2, _ = train_in_process(s2, steps=steps, model_kwargs=mk)
    ref_model, ref, _ = train_in_process("ddp", steps=steps, model_kwargs=mk)
    _, plain, _ = train_in_process(cg_strategy(warmup_steps=warmup, whole_step=False), steps=steps, model_kwargs={"dropout": 0.0})

    assert s1.last_graph_stats.forward_replays == 2 * (steps - warmup)
    assert len(r1.losses) == steps
    assert r1.losses == r2.losses
    assert state_rel_diff(m1.state_dict(), m2.state_dict()) == 0.0
    assert max_rel_diff(r1.losses, ref.losses) < 1e-6
    assert state_rel_diff(m1.state_dict(), ref_model.state_dict()) < 1e-5
    # measured >= 1.7e-3; runs of the same computation agree to ~1e-7 here, so 1e-4 separates them clearly
    assert max_rel_diff(plain.losses, r1.losses) > 1e-4


# ----------------------------------------------------------------------------------------------- resume
RESUME_AT = 6  # a checkpoint in the middle of the first 10-batch epoch
TOTAL = 16  # the resumed run crosses into the second epoch


def _interrupted_run(make_strategy, tmp_path):
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), filename="{step}", every_n_train_steps=RESUME_AT, save_top_k=-1)
    _, first = fit_whole_epochs(make_strategy(), RESUME_AT, callbacks=[ckpt], enable_checkpointing=True)
    paths = sorted(tmp_path.glob("*.ckpt"))
    assert [p.name for p in paths] == [f"step={RESUME_AT}.ckpt"]
    resumed_strategy = make_strategy()
    model, resumed = fit_whole_epochs(resumed_strategy, TOTAL, ckpt_path=str(paths[0]))
    return first, resumed, model, resumed_strategy


def assert_same_state(a, b) -> None:
    """Bit for bit: every tensor of two state dicts equal."""
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"differ: {different}"


@pytest.mark.parametrize("strategy_name", ["ddp", "cudagraph_ddp"])
def test_resume_mid_epoch_continues_bit_for_bit(strategy_name, tmp_path):
    """16 uninterrupted steps vs 6 steps saved by ``ModelCheckpoint`` in the middle of a 10-batch epoch + a new
    Trainer resumed with ``trainer.fit(ckpt_path=...)`` to 16: the resumed run's 10 losses and the final weights
    equal the uninterrupted run's bit for bit (CPU). Lightning "ddp" too: the reference is resumable this way.

    Exactness mid-epoch comes from the example data module's resumable loader
    (``cg_lightning/examples/resumable.py``): its place in the epoch is saved in the checkpoint and restored, so the resumed run takes batch 7 of the same
    shuffled order, then the next epoch's (``DistributedSampler.set_epoch``). AdamW's moments and the per-step
    LR warmup scheduler are restored with the weights. The models have no dropout: Lightning's checkpoint does
    not hold the RNG state.

    Under "cudagraph_ddp" the resumed run builds new graphs: the graph manager counts warmup from the first
    step it sees, so the resumed run's first ``warmup_steps`` (2) steps run eagerly, then it captures and
    replays."""
    warmup = 2
    if strategy_name == "ddp":
        def make():
            return "ddp"
    else:
        def make():
            return cg_strategy(warmup_steps=warmup, whole_step=False)

    full_model, full = fit_whole_epochs(make(), TOTAL)
    first, resumed, model, strategy = _interrupted_run(make, tmp_path)

    assert len(full.losses) == TOTAL
    assert first.losses == full.losses[:RESUME_AT]
    assert resumed.losses == full.losses[RESUME_AT:]
    assert_same_state(model.state_dict(), full_model.state_dict())
    if strategy_name == "cudagraph_ddp":
        stats = strategy.last_graph_stats
        assert stats.captured_runners == 2
        assert stats.forward_replays == 2 * (TOTAL - RESUME_AT - warmup)
        assert stats.eager_calls == 2 * warmup  # the resumed run's warmup steps
