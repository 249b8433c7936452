"""``ddp.find_unused_parameters`` (``cg_lightning/ddp/unused.py``, ``Bucket.settle_absent``) against torch DDP.

The two-process cases compare with ``DistributedDataParallel(find_unused_parameters=True)`` over gloo, the
one-process cases with plain PyTorch: a block used every third step, one used on rank 0 only, one never used;
AdamW with weight decay, so a zero gradient where the reference has ``None`` would change the weights. Every
window's ``param.grad`` (values and which are ``None``) and the final weights must be equal bit for bit.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn

from cg_lightning.ddp import DataParallelEngine, DDPOptions, GradSyncError
from tests.helpers import ROOT
from tests.launchers import run_ranks

SCRIPT = os.path.join(ROOT, "tests", "scripts", "unused_dist.py")


def _check(results, graphs):
    for res in results:
        assert "error" not in res, res["error"]
        for step, window in enumerate(res["windows"]):
            assert window["none_got"] == window["none_ref"], (res["rank"], step, window)
            assert window["grads_equal"], (res["rank"], step)
        assert res["weights_equal"], res["rank"]
        assert (res["replays"] > 0) == graphs, res["replays"]
    # the block that never runs keeps grad None on every rank; rank 1 gets rank 0's block's gradient
    assert "never.lin.weight" in results[0]["windows"][0]["none_got"]


@pytest.mark.parametrize("graphs", [False, True])
def test_one_process_matches_plain_pytorch(graphs, tmp_path):
    run_ranks(SCRIPT, [(["--out", str(tmp_path)] + (["--graphs"] if graphs else []), 1)], str(tmp_path), timeout=120)
    _check([json.loads((tmp_path / "rank0.json").read_text())], graphs)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("graphs", [False, True])
def test_two_processes_match_torch_ddp_find_unused(graphs, tmp_path):
    (log,) = run_ranks(SCRIPT, [(["--out", str(tmp_path)] + (["--graphs"] if graphs else []), 2)], str(tmp_path),
                       timeout=200, check=False)
    paths = [tmp_path / f"rank{r}.json" for r in range(2)]
    assert all(p.exists() for p in paths), log[-3000:]
    results = [json.loads(p.read_text()) for p in paths]
    _check(results, graphs)
    assert "rank0.lin.weight" not in results[1]["windows"][0]["none_got"]


def _bucket(absent_ok):
    from cg_lightning.ddp.bucket import Bucket

    params = [nn.Parameter(torch.zeros(2)) for _ in range(2)]
    bucket = Bucket(0, params, torch.zeros(4))
    if absent_ok:
        bucket.allow_absent()
    return bucket


@pytest.mark.parametrize("absent_ok", [False, True])
def test_a_partial_count_is_missing_with_or_without_find_unused(absent_ok):
    """Golden counts 2 and 1 (a parameter finalized in two backward passes); then 1 and 1: the first parameter
    is missing either way: only a parameter with no report at all may be absent."""
    bucket = _bucket(absent_ok)
    for slot in (0, 0, 1):
        bucket.register_ready(slot)
    bucket.set_golden()
    bucket.reset()
    for slot in (0, 1):
        assert not bucket.register_ready(slot)
    if absent_ok:
        bucket.settle_absent()
    assert bucket.missing() == [bucket.params[0]]


def test_absent_parameters_complete_a_bucket_after_the_backward():
    bucket = _bucket(True)
    bucket.register_ready(0)
    bucket.set_golden()  # golden [1, 0]: the second not seen yet
    bucket.reset()
    assert not bucket.register_ready(0)  # the unseen one keeps the bucket open during the backward
    bucket.settle_absent()
    assert bucket.complete and bucket.missing() == []
    bucket.reset()
    bucket.register_ready(1)
    bucket.settle_absent()  # first report of the second: learned; the first absent
    assert bucket.slot_golden == [1, 1] and bucket.complete
    bucket.reset()
    assert not bucket.register_ready(0)
    assert bucket.register_ready(1)  # both known now: complete during the backward


def test_engine_learns_a_parameter_first_seen_later():
    """Absent in the first iteration, used in later ones: its golden count is learned (1), its ``param.grad`` is
    ``None`` in the windows where it is absent (after ``zero_grad``) and equals plain PyTorch's otherwise."""
    torch.manual_seed(0)
    late, head = nn.Linear(4, 4), nn.Linear(4, 1)
    ref = nn.ModuleDict({"late": late, "head": head})
    model = nn.ModuleDict({"late": nn.Linear(4, 4), "head": nn.Linear(4, 1)})
    model.load_state_dict(ref.state_dict())
    engine = DataParallelEngine(model, DDPOptions(find_unused_parameters=True))
    for uses in (0, 1, 0, 1):
        x = torch.randn(2, 4)
        for m in (ref, model):
            y = m["late"](x) if uses else x
            if m is model:
                engine.take_back_grads()
            m["head"](y).sum().backward()
        engine.finish_grad_sync()
        engine.expose_grads()
        for p, q in zip(ref.parameters(), model.parameters()):
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad))
        assert (model["late"].weight.grad is None) == (uses == 0)
        ref.zero_grad()
        engine.zero_grad_buffer()
    assert [g for b in engine.buckets for g in b.slot_golden] == [1, 1, 1, 1]
