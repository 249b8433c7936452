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
(:class:`Jobs`), so that several jobs start in the time of one import on CI's two cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import pytest
import torch

from tests.helpers import ROOT, free_port
from tests.launchers import clean_env

JOB = os.path.join(ROOT, "tests", "scripts", "faults_job.py")
TIMEOUT_S = 3.0


class Jobs:
    """Two-process jobs of ``faults_job.py``, all ranks forked from one process that imported torch and Lightning
    once (``--fork``). ``jobs``: name -> (output folder, arguments); rank ``r`` of a job logs to ``out/rank{r}.log``."""

    def __init__(self, spec_dir, jobs: Dict[str, Tuple[object, List[str]]]) -> None:
        ranks = []
        for name, (out, args) in jobs.items():
            port = str(free_port())
            nproc = 1 if "--devices" in args else 2  # "--devices 1": one process, Lightning's own rank 0
            for r in range(nproc):
                env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                if nproc > 1:
                    env.update(WORLD_SIZE=str(nproc), NODE_RANK="0", LOCAL_RANK=str(r))
                argv = ["--out", str(out), "--timeout-s", str(TIMEOUT_S), *args]
                ranks.append(dict(env=env, argv=argv, log=os.path.join(out, f"rank{r}.log"), job=name, rank=r))
        self.ranks = ranks
        self.spec = os.path.join(spec_dir, f"fork{free_port()}.json")
        with open(self.spec, "w") as f:
            json.dump(ranks, f)
        self.launcher = subprocess.Popen([sys.executable, JOB, "--fork", self.spec], cwd=ROOT, env=clean_env())
        self.pids: Dict[Tuple[str, int], int] = {}
        deadline = time.monotonic() + 60
        while len(self.pids) < len(ranks):
            assert time.monotonic() < deadline and self.launcher.poll() is None, "the launcher did not fork"
            time.sleep(0.05)
            if os.path.exists(self.spec + ".pids"):
                with open(self.spec + ".pids") as f:
                    pids = [int(line) for line in f.read().split()]
                self.pids = {(r["job"], r["rank"]): pid for r, pid in zip(ranks, pids)}

    def exits(self) -> Dict[Tuple[str, int], Tuple[int, float]]:
        """(job, rank) -> (exit status, time.time() of the exit), for the ranks that ended."""
        by_pid = {pid: key for key, pid in self.pids.items()}
        out = {}
        if os.path.exists(self.spec + ".exits"):
            with open(self.spec + ".exits") as f:
                for line in f.read().splitlines():
                    pid, status, when = line.split()
                    out[by_pid[int(pid)]] = (int(status), float(when))
        return out

    def wait(self, keys, seconds: float) -> Dict[Tuple[str, int], Tuple[int, float]]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not set(keys) <= set(self.exits()):
            time.sleep(0.1)
        return self.exits()

    def signal(self, job: str, signum: int) -> None:
        for (name, _), pid in self.pids.items():
            if name == job:
                os.kill(pid, signum)

    def kill(self) -> None:
        ended = self.exits()
        for key, pid in self.pids.items():
            if key not in ended:
                try:
                    os.kill(pid, signal.SIGKILL)  # ends a stopped process too
                except ProcessLookupError:
                    pass
        try:
            self.launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.launcher.kill()
            self.launcher.wait(timeout=10)


def _log(out, rank: int) -> str:
    with open(os.path.join(out, f"rank{rank}.log"), errors="replace") as f:
        return f.read()


PHASES = ["warmup", "replay", "validation", "checkpoint"]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_stopped_rank_ends_the_other_with_a_named_error_in_every_phase(tmp_path):
    dirs = {phase: tmp_path / phase for phase in PHASES}
    for d in dirs.values():
        d.mkdir()
    jobs = Jobs(tmp_path, {phase: (dirs[phase], ["--stop", phase]) for phase in PHASES})
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
    jobs = Jobs(tmp_path, {"reference": (ref_dir, ["--steps", str(total)]), "run": (run_dir, interrupted_args),
                           "one": (one_dir, [*interrupted_args, "--devices", "1"])})
    try:
        deadline = time.monotonic() + 120
        sent = {}
        while len(sent) < 2:
            early = {key: v for key, v in jobs.exits().items() if key[0] != "reference"}  # the reference may finish
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

    jobs = Jobs(tmp_path, {"resumed": (res_dir, ["--steps", str(total), "--ckpt-path", str(ckpt)])})
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
