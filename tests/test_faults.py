"""Faults in two-process runs under ``cudagraph_ddp`` (gloo, CPU): every rank ends in time, preemption loses nothing.

Each job is two processes of ``tests/scripts/faults_job.py`` started as a cluster launcher starts them, with
``ddp.timeout_s = 3``:

* a rank stopped (SIGSTOP) in the eager warmup steps, in a replayed step, in validation or inside a checkpoint's
  save: the other rank ends with a ``PeerLostError`` that leads with the cause and names the stopped rank, within
  ``timeout_s + 10`` s of the stop (the four jobs run at once);
* SIGTERM to both processes while they train: both exit within 30 s with status 143 (128 + SIGTERM), leaving the
  checkpoint of the last completed step; a run resumed from it equals an uninterrupted run bit for bit. A
  one-process run stops the same way.

The ranks of all jobs of a test are forked from one process that imported torch and Lightning once
(:class:`tests.launchers.Jobs`), so that several jobs start in the time of one import on CI's two cores.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.launchers import Jobs, job_log as _log

TIMEOUT_S = 3.0
PHASES = ["warmup", "replay", "validation", "checkpoint"]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_stopped_rank_ends_the_other_with_a_named_error_in_every_phase(tmp_path):
    dirs = {phase: tmp_path / phase for phase in PHASES}
    for d in dirs.values():
        d.mkdir()
    jobs = Jobs(tmp_path, TIMEOUT_S, {phase: (dirs[phase], ["--stop", phase]) for phase in PHASES})
    try:
        ended = jobs.wait([(phase, 0) for phase in PHASES], 150)
    finally:
        jobs.kill()
    for phase, out in dirs.items():
        log = _log(out, 0)
        assert (phase, 0) in ended, f"{phase}: rank 0 did not end\n{log[-3000:]}\n--- rank 1\n{_log(out, 1)[-2000:]}"
        status, when = ended[(phase, 0)]
        after = when - float((out / "stopped").read_text())
        assert status == 1, (phase, status, log[-3000:])
        assert "PeerLostError: rank 0: rank 1 has been silent for 3 s (ddp.timeout_s)" in log, (phase, log[-3000:])
        assert after < TIMEOUT_S + 10, (phase, after)
        print(f"{phase}: rank 0 ended {after:.1f} s after rank 1 stopped")


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_sigterm_saves_the_last_completed_step_and_the_resume_is_exact(tmp_path):
    total = 10
    ref_dir, run_dir, res_dir, one_dir = (tmp_path / n for n in ("reference", "run", "resumed", "one"))
    for d in (ref_dir, run_dir, res_dir, one_dir):
        d.mkdir()
    interrupted_args = ["--steps", "200", "--step-sleep", "0.1", "--tag", "_interrupted"]
    jobs = Jobs(tmp_path, TIMEOUT_S, {"reference": (ref_dir, ["--steps", str(total)]),
                                      "run": (run_dir, interrupted_args),
                                      "one": (one_dir, [*interrupted_args, "--devices", "1"])})
    try:
        deadline = time.monotonic() + 120
        sent = {}
        while len(sent) < 2:
            # ended before its SIGTERM (the reference may finish; a job already signalled may end while the other
            # one is still waiting for its own)
            early = {key: v for key, v in jobs.exits().items() if key[0] != "reference" and key[0] not in sent}
            assert time.monotonic() < deadline and not early, (early, _log(run_dir, 0)[-3000:])
            for job, out in (("run", run_dir / "step1"), ("one", one_dir / "step0")):
                if job not in sent and out.exists() and out.read_text() not in ("", "0", "1", "2"):
                    sent[job] = time.time()
                    jobs.signal(job, signal.SIGTERM)
            time.sleep(0.05)
        ended = jobs.wait(list(jobs.pids), 120)
    finally:
        jobs.kill()
    log = _log(run_dir, 0)
    statuses = [ended.get(("run", r), (None, 0))[0] for r in (0, 1)]
    assert statuses == [128 + signal.SIGTERM] * 2, (statuses, log[-3000:], _log(run_dir, 1)[-2000:])
    took = max(ended[("run", r)][1] for r in (0, 1)) - sent["run"]
    assert took < 30
    assert [ended[("reference", r)][0] for r in (0, 1)] == [0, 0], _log(ref_dir, 0)[-3000:]
    interrupted = torch.load(run_dir / "result_interrupted.pt")
    k = interrupted["global_step"]
    assert 3 <= k < total, k
    assert len(interrupted["losses"]) == k  # every step it took completed
    ckpt = run_dir / "hpc_ckpt_1.ckpt"
    assert torch.load(ckpt, weights_only=False)["global_step"] == k
    assert "stopped by SIGTERM" in log
    # one process: the same stop, checkpoint and status (Lightning's own end-of-batch test raises)
    one_status, one_end = ended[("one", 0)]
    assert one_status == 128 + signal.SIGTERM and one_end - sent["one"] < 30, (one_status, _log(one_dir, 0)[-3000:])
    one = torch.load(one_dir / "result_interrupted.pt")
    assert torch.load(one_dir / "hpc_ckpt_1.ckpt", weights_only=False)["global_step"] == one["global_step"]
    assert len(one["losses"]) == one["global_step"] >= 3

    jobs = Jobs(tmp_path, TIMEOUT_S, {"resumed": (res_dir, ["--steps", str(total), "--ckpt-path", str(ckpt)])})
    try:
        ended = jobs.wait([("resumed", 0), ("resumed", 1)], 120)
    finally:
        jobs.kill()
    assert [ended.get(("resumed", r), (None,))[0] for r in (0, 1)] == [0, 0], _log(res_dir, 0)[-3000:]
    ref = torch.load(ref_dir / "result.pt")
    res = torch.load(res_dir / "result.pt")
    assert interrupted["losses"] == ref["losses"][:k]
    assert res["losses"] == ref["losses"][k:]
    assert all(torch.equal(res["state"][n], ref["state"][n]) for n in ref["state"])
    print(f"SIGTERM after step {k}: both ranks ended {took:.1f} s later with status 143; the resume is exact")
