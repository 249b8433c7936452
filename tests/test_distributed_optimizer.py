"""``ddp.distributed_optimizer`` (:mod:`cg_lightning.ddp.shards`, :mod:`cg_lightning.optim.sharded_optimizer`,
:mod:`cg_lightning.optim.sharded_state`, :mod:`cg_lightning.trainer.distributed_optimizer`).

In one process, against plain PyTorch: the sharded step with clipping equals ``AdamW`` bit for bit (fp32), and with
bf16 parameters equals ``AdamW`` on fp32 master weights written out by hand; its state round-trips. Across 2 and
then 4 processes (gloo; ``tests/scripts/distopt_dist.py``), against Lightning ``"ddp"`` with fused AdamW, clipping
by norm and 2 batches accumulated: per-step losses and final weights within 1e-6 (relative), each rank's state
holding its shard's elements only, a resume from the sharded checkpoint bit-equal to the uninterrupted run, and the
2-process checkpoint resumed by 4 processes.
"""

from __future__ import annotations

import pytest
import torch

from cg_lightning.ddp import DataParallelEngine, DDPOptions
from cg_lightning.optim.sharded_optimizer import ShardedOptimizer, clip_grad_norm_
from cg_lightning.optim.sharded_state import full_state_dict

TOL = 1e-6


def _model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(dtype)


def _groups(module):
    named = list(module.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")]},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


def _sharded(dtype, fused):
    model = _model(dtype)
    engine = DataParallelEngine(model, DDPOptions(distributed_optimizer=True, bucket_size_mb=0.0001))
    opt = torch.optim.AdamW(_groups(model), lr=0.01, weight_decay=0.1, fused=fused)
    return model, engine, opt, ShardedOptimizer(opt, engine.shards)


def _sharded_step(model, engine, sharded, x):
    engine.take_back_grads()
    model(x).square().sum().backward()
    engine.finish_grad_sync()
    engine.expose_grads()
    clip_grad_norm_([sharded], 0.5)
    sharded.step()
    sharded.optimizer.zero_grad()


@pytest.mark.parametrize("fused", [False, True])
def test_one_process_equals_adamw_and_master_weights(fused):
    """fp32: equal to AdamW with torch's clip_grad_norm_ (over the optimizer's parameters), bit for bit. bf16: equal
    to AdamW stepping fp32 copies of the bf16 parameters on the bf16 gradients (clipped, then cast up), each step's
    result cast down, bit for bit. Then the state: the shard joined into a full state equals AdamW's; a second sharded
    optimizer loaded from the shard (and one from the full state) continues exactly as the first."""
    torch.manual_seed(1)
    xs = [torch.randn(4, 5) for _ in range(4)]
    for dtype in (torch.float32, torch.bfloat16):
        ref = _model(dtype)
        masters = [p.detach().float().clone() for p in ref.parameters()] if dtype is torch.bfloat16 else None
        if masters is not None:
            ref_params = dict(zip(ref.parameters(), masters))
            groups = [{**g, "params": [ref_params[p] for p in g["params"]]} for g in _groups(ref)]
        else:
            groups = _groups(ref)
        ref_opt = torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1, fused=fused)
        model, engine, opt, sharded = _sharded(dtype, fused)
        for x in xs:
            ref(x.to(dtype)).square().sum().backward()
            torch.nn.utils.clip_grad_norm_([p for g in _groups(ref) for p in g["params"]], 0.5)
            if masters is not None:
                for p in ref.parameters():
                    ref_params[p].grad = p.grad.float()
            ref_opt.step()
            ref_opt.zero_grad()
            ref.zero_grad()
            if masters is not None:
                with torch.no_grad():
                    for p in ref.parameters():
                        p.copy_(ref_params[p])
            _sharded_step(model, engine, sharded, x.to(dtype))
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a, b), dtype
        shard = opt.state_dict()
        assert sharded.shard_numel == sum(p.numel() for p in model.parameters())  # one process owns everything
        if dtype is torch.float32:
            full, expected = full_state_dict([shard])["state"], ref_opt.state_dict()["state"]
            assert all(torch.equal(full[i][k], expected[i][k]) for i in expected for k in expected[i])
        twins = []
        for state in (shard, full_state_dict([shard])):
            model2, engine2, opt2, sharded2 = _sharded(dtype, fused)
            model2.load_state_dict(model.state_dict())
            opt2.load_state_dict(state)
            twins.append((model2, engine2, sharded2))
        for x in xs[:2]:
            _sharded_step(model, engine, sharded, x.to(dtype))
            for twin in twins:
                _sharded_step(*twin, x.to(dtype))
        if dtype is torch.float32:  # a full state dict has no master weights: bf16 restarts from the bf16 values
            twins_checked = twins
        else:
            twins_checked = twins[:1]
        for twin_model, *_ in twins_checked:
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))
        sharded.close()
        assert "state_dict" not in opt.__dict__


def test_refusals():
    with pytest.raises(ValueError, match="find_unused_parameters"):
        DDPOptions(distributed_optimizer=True, find_unused_parameters=True)
    model = _model()
    engine = DataParallelEngine(model, DDPOptions(distributed_optimizer=True))
    with pytest.raises(ValueError, match="LBFGS is not one of the elementwise"):
        ShardedOptimizer(torch.optim.LBFGS(model.parameters()), engine.shards)
    with pytest.raises(ValueError, match="not trainable parameters of the model"):
        ShardedOptimizer(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))]), engine.shards)


def test_checkpoint_files(tmp_path):
    """Lightning's side of the files: each rank's shard beside the checkpoint file and a descriptor in it; loaded
    back as this rank's shard (same world size), as every saved shard (another one) or joined into a full state
    (without the distributed optimizer); removed with the checkpoint."""
    from cg_lightning.optim.sharded_files import load_shards, remove_shards, save_shards

    model, engine, opt, sharded = _sharded(torch.float32, False)
    _sharded_step(model, engine, sharded, torch.randn(4, 5))
    path = str(tmp_path / "last.ckpt")
    main = {}
    for rank in range(2):  # as two ranks would write them (the same shard twice)
        main = save_shards({"optimizer_states": [opt.state_dict()], "epoch": 3}, path, rank, 2, torch.save)
    torch.save(main, path)
    assert main["epoch"] == 3 and main["optimizer_states"] == [
        {"sharded_optimizer_files": {"world_size": 2, "folder": "last.ckpt.optim"}}]
    load = lambda p: torch.load(p, weights_only=True)  # noqa: E731
    own = load_shards(load(path), path, 1, 2, True, load)["optimizer_states"][0]
    every = load_shards(load(path), path, 0, 4, True, load)["optimizer_states"][0]
    full = load_shards(load(path), path, 0, 2, False, load)["optimizer_states"][0]
    assert own["sharded_optimizer"]["rank"] == 0 and len(every) == 2 and set(full) == {"state", "param_groups"}
    for rank in range(2):
        remove_shards(path, rank, 2, __import__("os").remove)
    assert not (tmp_path / "last.ckpt.optim").exists()


# ----------------------------------------------------------------- several processes over gloo
@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory):
    """``fresh`` with 2 processes, then ``reshard`` with 4 (at most 240 s together); the results folder."""
    from tests.launchers import run_ranks

    out = tmp_path_factory.mktemp("distopt")
    script = "tests/scripts/distopt_dist.py"
    run_ranks(script, [(["--out", str(out), "--phase", "fresh"], 2)], str(out), timeout=120)
    run_ranks(script, [(["--out", str(out), "--phase", "reshard"], 4)], str(out), timeout=120)
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


def _assert_close_runs(ref, cand, what):
    assert len(ref["losses"]) == len(cand["losses"]) > 0, what
    assert max(_rel(a, b) for a, b in zip(ref["losses"], cand["losses"])) < TOL, what
    for name, w in ref["weights"].items():
        diff = (w - cand["weights"][name]).abs().max() / w.abs().max()
        assert diff < TOL, f"{what}: {name} differs by {diff:.2e} (relative)"


def _assert_shards(results, world):
    """Each rank's optimizer state holds the elements of its shard only: together the parameters' elements once,
    each at most its shard of the padded buckets (padding: fewer than ``world`` elements a bucket)."""
    states = [r["cg"]["state_numel"] for r in results]
    param_numel, shard = results[0]["cg"]["param_numel"], results[0]["cg"]["shard_numel"]
    assert sum(states) == param_numel, states
    assert all(s <= shard for s in states) and shard * world < param_numel + world * param_numel // 16, (states, shard)
    assert max(states) <= -(-param_numel // world) + 10 * world, states  # 1/N plus padding (10 buckets at most)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_processes_equal_ddp_and_resume(dist_runs):
    results = [torch.load(dist_runs / f"fresh.rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, res in enumerate(results):
        _assert_close_runs(res["ddp"], res["cg"], f"rank {rank}")
        assert res["collectives_agree"]
        uninterrupted = res["cg"]
        resumed = res["resumed"]
        assert resumed["losses"] == uninterrupted["losses"][len(uninterrupted["losses"]) - len(resumed["losses"]):]
        assert all(torch.equal(w, resumed["weights"][k]) for k, w in uninterrupted["weights"].items())
    _assert_shards(results, 2)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_four_processes_resume_the_two_process_checkpoint(dist_runs):
    """Both strategies resume their epoch-0 checkpoints of the 2-process run with 4 processes: the 2 saved shards
    are cut into 4, and the runs stay within 1e-6 of each other."""
    results = [torch.load(dist_runs / f"reshard.rank{r}.pt", weights_only=False) for r in range(4)]
    for rank, res in enumerate(results):
        _assert_close_runs(res["ddp"], res["cg"], f"rank {rank}")
    _assert_shards(results, 4)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_consolidated_checkpoint_equals_ddp(dist_runs):
    """The shards of the 2-process checkpoint joined into a full optimizer state (``consolidate``): the state of
    Lightning ``"ddp"``'s checkpoint at the same step, within 1e-6, in its format."""
    from cg_lightning.trainer.distributed_optimizer import consolidate

    ref = torch.load(dist_runs / "ckpt_ddp" / "epoch=0-step=4.ckpt", weights_only=False)["optimizer_states"][0]
    full = consolidate(str(dist_runs / "ckpt_cg" / "epoch=0-step=4.ckpt"))["optimizer_states"][0]
    assert full["param_groups"] == ref["param_groups"]
    assert full["state"].keys() == ref["state"].keys()
    for i, state in ref["state"].items():
        for key, value in state.items():
            got = full["state"][i][key]
            assert got.shape == value.shape and (got - value).abs().max() <= TOL * value.abs().max(), (i, key)
