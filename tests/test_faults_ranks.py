"""The rank at fault named among more than two ranks, under Lightning and Accelerate; preemption under Accelerate.

* The progress board and the verdict (``cg_lightning/ddp/progress.py``, ``peers.py``) on an in-memory store, with
  ranks written as if on another host (no process to look at): a rank that did not answer is named with its last
  step and phase, a rank that stopped on its own error with its error, a closed connection seen after another rank
  timed out keeps the first cause, an unreachable store names its host (rank 0), a store-holding rank 0 waits at
  exit until the others have read the board; writes are throttled.
* Lightning, three processes of ``tests/scripts/faults_job.py`` per job, ``ddp.timeout_s = 10``, six jobs at once:
  a rank stopped (SIGSTOP) in the eager warmup steps and one in a replayed step, a rank killed (SIGKILL), rank 0
  (the store host) killed and stopped (its store then never answers: every read gives up after its timeout), a
  rank that raises an error of its own. The other ranks end within ``timeout_s + 10`` s with a
  ``PeerLostError`` naming the rank (rank 0: as the store host; the raising rank with its error) and, for the
  replayed step, the last step it reported.
* Accelerate, ``tests/scripts/accelerate_faults.py``: three processes under torchrun, rank 1 stopped in a replayed
  step: ranks 0 and 2 name it. Two processes, SIGTERM to rank 1 only: both stop after the same step with status
  143 and the state saved; the run resumed from it ends with the weights of an uninterrupted run, bit for bit.
  One process: ``check_preemption`` and ``exit_preempted`` in-process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List

import pytest
import torch

from cg_lightning.ddp import peers, progress
from tests.helpers import ROOT, free_port
from tests.launchers import Jobs, clean_env, job_log, torchrun

TIMEOUT_S = 10.0
SCRIPT = os.path.join(ROOT, "tests", "scripts", "accelerate_faults.py")


# ------------------------------------------------------------------------------------------------ board and verdict
class DictStore:
    """The store calls the board makes, on a dict; ``down`` makes every read fail as a dead store's does."""

    def __init__(self) -> None:
        self.data: Dict[str, bytes] = {}
        self.sets = 0
        self.down = False

    def set(self, key: str, value: str) -> None:
        self.sets += 1
        self.data[key] = value.encode()

    def check(self, keys: List[str]) -> bool:
        if self.down:
            raise RuntimeError("Broken pipe")
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def multi_get(self, keys: List[str]) -> List[bytes]:
        return [self.data[k] for k in keys]


@pytest.fixture
def world(monkeypatch):
    """Rank 0's board over a :class:`DictStore` in a world of 4, and a writer of the other ranks' entries as if
    they ran on another host."""
    monkeypatch.setattr(peers, "grace_s", lambda timeout_s: 0.5)
    store = DictStore()
    board = progress.open_board(0, 4, TIMEOUT_S, store=store)
    generation = int(board._keys[0].split("/")[-2])

    def other(rank: int, step: int, phase: str, kind: str = "", note: str = ""):
        with monkeypatch.context() as m:
            m.setattr(progress, "_NAMESPACE", "another-host/1")
            peer = progress.ProgressBoard(store, rank, 4, 0.0, "rank 0", "", generation)
            peer.report(step, phase)
            if kind:
                peer.announce(kind, note)

    yield board, store, other
    progress.close_board()


TIMED_OUT = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation")
CLOSED = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.7]:5035")


def test_a_rank_that_does_not_answer_is_named_with_its_last_step(world):
    board, _, other = world
    other(1, 15, "backward", "lost", "timeout|the backward of step 15")
    other(2, 14, "forward")
    other(3, 15, "backward", "lost", "timeout|the backward of step 15")
    board.report(15, "backward")
    start = time.monotonic()
    text = str(peers.peer_error(TIMED_OUT, "the backward of step 15", TIMEOUT_S))
    assert text.startswith("rank 0: rank 2 has been silent for 10 s (ddp.timeout_s) during the backward of "
                           "step 15"), text
    assert "rank 2 last reported" in text and "at step 14 (forward)" in text, text
    assert "ranks 0, 1, 3 reached step 15 (backward)" in text and text.endswith(str(TIMED_OUT)), text
    assert time.monotonic() - start < 2  # the grace (0.5 s here) and a few reads
    assert json.loads(board.store.data[board._keys[0]])["kind"] == "lost"  # the others learn this rank is alive


def test_a_rank_that_stopped_on_its_own_error_is_named_with_it(world):
    board, _, other = world
    other(1, 3, "forward", "error", "ValueError: a bad batch")
    other(2, 3, "backward", "lost", "gone|the backward of step 3")
    other(3, 3, "backward", "lost", "gone|the backward of step 3")
    board.report(3, "backward")
    text = str(peers.peer_error(CLOSED, "the backward of step 3", TIMEOUT_S))
    assert text.startswith("rank 0: rank 1 stopped on its own error at step 3 (forward) while this rank waited in "
                           "the backward of step 3: ValueError: a bad batch; its log holds the traceback"), text


def test_a_closed_connection_after_a_timeout_keeps_the_first_cause(world):
    """Rank 1 timed out first, named the silent rank and exited: rank 0 then sees rank 1's connection close."""
    board, _, other = world
    other(1, 5, "backward", "lost", "timeout|the backward of step 5")
    other(2, 4, "optimizer step")
    other(3, 5, "backward", "lost", "timeout|the backward of step 5")
    text = str(peers.peer_error(CLOSED, "the backward of step 5", TIMEOUT_S))
    assert text.startswith("rank 0: rank 2 has been silent for 10 s"), text


def test_every_rank_answering_means_different_collectives(world):
    board, _, other = world
    for r in (1, 2, 3):
        other(r, 5, "backward", "lost", "timeout|a barrier")
    text = str(peers.peer_error(TIMED_OUT, "the backward of step 5", TIMEOUT_S))
    assert "every other rank is alive and its collective failed too" in text, text


def test_an_unreachable_store_names_its_host(world):
    board, store, _ = world
    board.store_host, board.rank = "rank 0", 2  # as rank 2 sees a store that rank 0 holds
    store.down = True
    start = time.monotonic()
    text = str(peers.peer_error(CLOSED, "the backward of step 5", TIMEOUT_S))
    assert text.startswith("rank 2: rank 0 (the store host, DictStore) is unreachable: it is gone"), text
    assert time.monotonic() - start < 1


def test_two_ranks_name_the_other_at_once(monkeypatch):
    store = DictStore()
    board = progress.open_board(0, 2, 3.0, store=store)
    try:
        start = time.monotonic()
        text = str(peers.peer_error(TIMED_OUT, "a barrier", 3.0))
        assert text.startswith("rank 0: rank 1 has been silent for 3 s (ddp.timeout_s) during a barrier: no "
                               "reply"), text
        assert "rank 1 never reported" in text and time.monotonic() - start < 0.5
        assert board.world_size == 2
    finally:
        progress.close_board()


def test_a_store_holding_rank_0_waits_at_exit_until_the_others_are_done(world):
    """Rank 0's process holds the store: after a failure it leaves only once every other rank has read the board
    for the last time (or ``linger_s`` passed), so that a rank that noticed later can still read it."""
    board, _, other = world
    board.held, board.linger_s = object(), 0.6
    board.announce("lost", "timeout|a barrier")
    other(1, 5, "backward", "lost", "timeout|a barrier")
    other(2, 4, "forward")  # at fault: never answers
    other(3, 5, "backward", "lost", "timeout|a barrier")
    progress.close_board()
    assert progress.board() is None and progress._lingering is board
    start = time.monotonic()
    progress._at_exit()
    assert 0.6 <= time.monotonic() - start < 1.5  # rank 2 never says it is done, ranks 1 and 3 did not either
    for r in (1, 3):
        entry = json.loads(board.store.data[board._keys[r]])
        board.store.data[board._keys[r]] = json.dumps({**entry, "done": True}).encode()
    board.store.data[board._keys[2]] = json.dumps({**entry, "kind": "error"}).encode()
    progress.close_board()
    progress._lingering = board
    start = time.monotonic()
    progress._at_exit()
    assert time.monotonic() - start < 0.3 and progress._lingering is None


def test_reports_are_throttled(world):
    board, store, _ = world
    before = store.sets
    for step in range(1000):
        board.report(step, "forward")
    assert store.sets - before <= 1  # the first write after opening waits interval_s (1 s at timeout_s = 10)
    board._next = 0.0
    board.report(1000, "backward")
    assert store.sets - before <= 2 and json.loads(store.data[board._keys[0]])["step"] == 1000


# ------------------------------------------------------------------------------------------------ Lightning, 3 ranks
# job -> (arguments, the rank it stops or kills, what the other ranks' error says after "rank R: ", and later on)
LIGHTNING_JOBS = {
    "stop_warmup": (["--stop", "warmup", "--victim", "2"], 2, "rank 2 has been silent for 10 s (ddp.timeout_s)"),
    "stop_replay": (["--stop", "replay", "--victim", "1", "--step-sleep", "0.4"], 1,
                    "rank 1 has been silent for 10 s (ddp.timeout_s)"),
    "kill": (["--stop", "replay", "--victim", "1", "--kill"], 1, "rank 1 is gone (its process exited)"),
    "kill_rank0": (["--stop", "replay", "--victim", "0", "--kill"], 0, "rank 0 (the store host, 127.0.0.1:",
                   "is unreachable: it is gone"),
    "stop_rank0": (["--stop", "replay", "--victim", "0"], 0, "rank 0 (the store host, 127.0.0.1:",
                   "is unreachable: it is silent for 10 s", "does not answer (Socket Timeout)"),
    "error": (["--stop", "replay", "--victim", "2", "--error"], 2,
              "rank 2 stopped on its own error at step 4 (step start) while this rank waited in ",
              ": ValueError: a bad batch (on purpose); its log holds the traceback"),
}


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_three_ranks_name_the_stopped_killed_or_failed_one(tmp_path):
    dirs = {name: tmp_path / name for name in LIGHTNING_JOBS}
    for d in dirs.values():
        d.mkdir()
    jobs = Jobs(tmp_path, TIMEOUT_S, {name: (dirs[name], ["--devices", "3", "--steps", "40", *spec[0]])
                                      for name, spec in LIGHTNING_JOBS.items()})
    survivors = [(name, r) for name, spec in LIGHTNING_JOBS.items() for r in range(3) if r != spec[1]]
    try:
        ended = jobs.wait(survivors, 150)
    finally:
        jobs.kill()
    for name, r in survivors:
        log = job_log(dirs[name], r)
        assert (name, r) in ended, f"{name}: rank {r} did not end\n{log[-3000:]}"
        status, when = ended[(name, r)]
        after = when - float((dirs[name] / "stopped").read_text())
        lead, *rest = LIGHTNING_JOBS[name][2:]
        line = next((x for x in log.splitlines() if f"PeerLostError: rank {r}: {lead}" in x), None)
        errors = [x[:1500] for x in log.splitlines() if "Error: " in x]
        assert status == 1 and line is not None and all(x in line for x in rest), (name, r, status, errors)
        if name == "stop_replay":  # slow enough steps for the board to hold one (written at most once a second)
            assert "rank 1 last reported" in log and "s ago at step " in log, log[-3000:]
        assert after < TIMEOUT_S + 10, (name, r, after)
        print(f"{name}: rank {r} ended {after:.1f} s after the fault")


# ------------------------------------------------------------------------------------------------ Accelerate
def _wait_for(paths, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(os.path.exists(p) for p in paths):
            return True
        time.sleep(0.2)
    return False


def _kill_pids(out, nproc: int) -> None:
    for r in range(nproc):
        try:
            with open(os.path.join(out, f"pid{r}")) as f:
                os.kill(int(f.read()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_accelerate_three_ranks_under_torchrun_name_the_stopped_one(tmp_path):
    args = ["--out", str(tmp_path), "--steps", "60", "--timeout-s", str(TIMEOUT_S), "--stop-rank", "1",
            "--stop-step", "4"]
    with open(tmp_path / "torchrun.log", "w") as log:
        launcher = subprocess.Popen(torchrun(SCRIPT, *args, nproc=3), cwd=ROOT, env=clean_env(), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    try:
        errors = [tmp_path / f"error{r}.txt" for r in (0, 2)]
        done = _wait_for(errors[:1], 150) and _wait_for(errors, 5)  # torchrun may end rank 2 once rank 0 exits
        texts = [p.read_text() for p in errors if p.exists()]
        assert done or texts, (tmp_path / "torchrun.log").read_text()[-3000:]
        stopped = float((tmp_path / "stopped").read_text())
        for r, text in zip((0, 2), texts):
            when, message = text.split("\n")[:2]
            assert message.startswith(f"PeerLostError: rank {r}: rank 1 has been silent for 10 s (ddp.timeout_s)"), text
            assert float(when) - stopped < TIMEOUT_S + 10
            assert "rank 1 last reported" in message and "its process on this host is stopped" in message
            print(f"rank {r} ended {float(when) - stopped:.1f} s after rank 1 stopped")
    finally:
        _kill_pids(tmp_path, 3)  # the stopped rank; torchrun then ends
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=10)


def _start(out, nproc: int, *args: str) -> List[subprocess.Popen]:
    """``nproc`` processes of the script started as a cluster launcher starts tasks (no torchrun)."""
    port = str(free_port())
    procs = []
    for r in range(nproc):
        env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r), LOCAL_RANK=str(r),
                        WORLD_SIZE=str(nproc))
        with open(os.path.join(out, f"log{r}"), "w") as log:
            procs.append(subprocess.Popen([sys.executable, SCRIPT, "--out", str(out), *args], cwd=ROOT, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    return procs


def _finish(procs: List[subprocess.Popen], seconds: float) -> List[int]:
    deadline = time.monotonic() + seconds
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
    return [p.returncode for p in procs]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_accelerate_sigterm_to_one_rank_stops_all_saves_and_resumes_exactly(tmp_path):
    total = 12
    ref, run, res = (tmp_path / n for n in ("reference", "run", "resumed"))
    for d in (ref, run, res):
        d.mkdir()
    ckpt = str(tmp_path / "ckpt")
    reference = _start(ref, 2, "--steps", str(total))
    interrupted = _start(run, 2, "--steps", "200", "--step-sleep", "0.1", "--ckpt", ckpt)
    try:
        deadline = time.monotonic() + 120
        while not ((run / "step1").exists() and (run / "step1").read_text() not in ("", "0", "1", "2")):
            alive = all(p.poll() is None for p in interrupted)
            assert time.monotonic() < deadline and alive, (run / "log0").read_text()
            time.sleep(0.05)
        sent = time.monotonic()
        interrupted[1].send_signal(signal.SIGTERM)  # one rank only: the agreement stops both
        statuses = _finish(interrupted, 60)
        took = time.monotonic() - sent
    finally:
        statuses_ref = _finish(reference, 120)
        _finish(interrupted, 1)
    logs = [(run / f"log{r}").read_text() for r in (0, 1)]
    assert statuses == [128 + signal.SIGTERM] * 2, (statuses, logs[0][-3000:], logs[1][-3000:])
    assert took < 30 and "SIGTERM received; every process stops after step" in logs[0]
    assert statuses_ref == [0, 0], (ref / "log0").read_text()[-3000:]
    steps = [int((run / f"step{r}").read_text()) for r in (0, 1)]
    assert steps[0] == steps[1] and 3 <= steps[0] < total, steps

    resumed = _start(res, 2, "--steps", str(total), "--ckpt", ckpt, "--resume")
    assert _finish(resumed, 120) == [0, 0], (res / "log0").read_text()[-3000:]
    a, b = torch.load(ref / "result.pt"), torch.load(res / "result.pt")
    assert b["start"] == steps[0] and b["losses"] == a["losses"][steps[0]:]
    assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])
    print(f"SIGTERM to rank 1 after step {steps[0]}: both ranks exited 143 {took:.1f} s later; the resume is exact")


def test_accelerate_one_process_check_preemption_and_exit(fresh_accelerate_state):
    """One process: a SIGTERM is noted, not fatal; ``check_preemption`` is then true, ``exit_preempted`` exits with
    143 and gives SIGTERM its handler back."""
    from cg_lightning.accelerate import CUDAGraphAccelerator
    from tests.scripts.accelerate_cases import Net

    before = signal.getsignal(signal.SIGTERM)
    acc = CUDAGraphAccelerator(cpu=True, graphs={"warmup_steps": 1, "backend": "eager"})
    acc.prepare(Net())  # the engine: one process, nothing to agree with
    assert not acc.check_preemption() and acc.preemption_signal == 0
    with pytest.raises(RuntimeError, match="without an agreed stop"):
        acc.exit_preempted()
    os.kill(os.getpid(), signal.SIGTERM)
    assert acc.check_preemption() and acc.preemption_signal == signal.SIGTERM
    with pytest.raises(SystemExit) as exit_info:
        acc.exit_preempted()
    assert exit_info.value.code == 143 and signal.getsignal(signal.SIGTERM) is before


def test_bound_world_destroys_the_group_at_exit_after_the_boards_wait(monkeypatch):
    """The loop front ends' ``bound_world`` (Fabric, Accelerate) registers the default group's destruction at exit,
    whatever its backend: a gloo group alive at interpreter exit aborted a two-process Fabric run now and then
    ("terminate called without an active exception"). Registered before the board's exit wait, so it runs after
    it (``atexit`` runs last-registered first); once per process; the handler destroys a live group."""
    import torch.distributed as dist

    registered = []
    monkeypatch.setattr(peers.atexit, "register", registered.append)
    monkeypatch.setattr(progress.atexit, "register", registered.append)
    monkeypatch.setattr(peers, "_EXIT_REGISTERED", False)
    monkeypatch.setattr(progress, "open_board", lambda *a, **k: registered.append(progress._at_exit))
    monkeypatch.setattr(peers.torch_compat, "set_group_timeout", lambda *a, **k: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)
    assert peers.bound_world(30.0) and peers.bound_world(30.0)
    assert registered == [peers._destroy_world, progress._at_exit, progress._at_exit]
    monkeypatch.undo()

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        peers._destroy_world()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
