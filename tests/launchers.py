"""Run launcher commands (torchrun, several "nodes") from tests: clean environment, timeouts, no orphans; and
Lightning jobs of ``tests/scripts/faults_job.py`` forked from one process (:class:`Jobs`).

Every command is started in its own session, and its descendants are recorded while it runs (torchrun
starts each worker in a session of its own, so killing the launcher's group would not reach them, and a
worker outlives a launcher that died). On a timeout or a failure the launchers are asked to stop
(SIGTERM, so torchrun shuts its workers down), then every recorded process still alive is killed by its
pid; when one "node" fails, the others are killed too instead of being left waiting in the rendezvous.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from tests.helpers import ROOT, free_port, subprocess_env


def clean_env(**extra: str) -> dict:
    """This environment without distributed or Accelerate variables (a test may itself run under a launcher)."""
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("ACCELERATE_")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def torchrun(script: str, *args: str, nproc: int = 2, nnodes: int = 1, node_rank: int = 0,
             port: Optional[int] = None) -> List[str]:
    """``python -m torch.distributed.run`` (torchrun with this interpreter) on localhost."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes), "--node_rank", str(node_rank), "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(port or free_port()),
        script, *args,
    ]


def _start_time(pid: int) -> Optional[str]:
    """The process's start time (clock ticks since boot), to tell it from a later process with its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _children(pid: int) -> List[int]:
    out: List[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
    except OSError:
        pass
    return out


def _record_descendants(roots: Sequence[int], seen: Dict[int, Optional[str]]) -> None:
    stack = list(roots)
    while stack:
        for child in _children(stack.pop()):
            if child not in seen:
                seen[child] = _start_time(child)
                stack.append(child)


def _kill(procs: Sequence[subprocess.Popen], seen: Dict[int, Optional[str]]) -> None:
    running = [p for p in procs if p.poll() is None]
    _record_descendants([p.pid for p in running], seen)
    for p in running:
        try:
            os.kill(p.pid, signal.SIGTERM)  # torchrun forwards it to its workers and waits for them
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 15
    for p in running:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for pid, started in seen.items():
        if started is not None and _start_time(pid) == started:  # still the process recorded
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _tail(path: str, n: int = 4000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def run_all(commands: Sequence[Sequence[str]], log_dir: str, timeout: float) -> List[str]:
    """Start every command at once, wait for all; return their logs (stdout and stderr together).

    Raises:
        AssertionError: if a command exits non-zero or they are not all done within ``timeout`` seconds;
            every process it started is killed first, and the message holds the logs' tails.
    """
    logs = [os.path.join(log_dir, f"proc{i}.log") for i in range(len(commands))]
    files = [open(path, "w") for path in logs]
    procs: List[subprocess.Popen] = []
    seen: Dict[int, Optional[str]] = {}  # descendants of the launchers: pid -> start time
    failure: Optional[str] = None
    try:
        for cmd, f in zip(commands, files):
            procs.append(subprocess.Popen(list(cmd), cwd=ROOT, env=clean_env(), stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        while failure is None and any(p.poll() is None for p in procs):
            _record_descendants([p.pid for p in procs if p.poll() is None], seen)
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                failure = f"command {failed[0]} exited with {procs[failed[0]].returncode}"
            elif time.monotonic() > deadline:
                failure = f"not done within {timeout:.0f} s"
            else:
                time.sleep(0.2)
        if failure is None and any(p.returncode != 0 for p in procs):
            failure = "exit codes " + str([p.returncode for p in procs])
    finally:
        _kill(procs, seen)
        for f in files:
            f.close()
    if failure is not None:
        details = "\n".join(f"--- {' '.join(map(str, cmd))}\n{_tail(path)}" for cmd, path in zip(commands, logs))
        raise AssertionError(f"{failure}\n{details}")
    return [_tail(path, 200_000) for path in logs]


class StartedTogether:
    """Commands of one test module that need fresh interpreters, all started at once by the first :meth:`result`
    (each imports torch and Lightning, about 17 s of CPU: one after the other, a core would sit idle)."""

    def __init__(self) -> None:
        self.commands: Dict[str, Tuple[List[str], dict]] = {}
        self.procs: Dict[str, subprocess.Popen] = {}

    def add(self, name: str, cmd: Sequence[str], env: Optional[dict] = None) -> None:
        self.commands[name] = (list(cmd), dict(env if env is not None else os.environ))

    def result(self, name: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """``name``'s exit status, stdout and stderr (text); killed after ``timeout`` seconds of waiting."""
        if not self.procs:
            self.procs = {key: subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE)
                          for key, (cmd, env) in self.commands.items()}
        proc = self.procs[name]
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


RANK_SERVER = os.path.join(ROOT, "tests", "scripts", "rank_server.py")


class _RankServer:
    """The session's ``tests/scripts/rank_server.py``: started on first use, ended at exit (or after a request it
    did not answer in time, to be started again by the next)."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None

    def _start(self) -> subprocess.Popen:
        self.proc = subprocess.Popen([sys.executable, RANK_SERVER], cwd=ROOT, env=clean_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)
        atexit.register(self.close)
        self._read(120, "start")
        return self.proc

    def _read(self, timeout: float, what: str) -> dict:
        proc = self.proc
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if sel.select(timeout):
                line = proc.stdout.readline()
                if line:
                    return json.loads(line)
        self.close()
        raise AssertionError(f"the rank server did not answer ({what}) within {timeout:.0f} s")

    def run(self, script: str, jobs: List[dict], timeout: float, grace: Optional[float] = None) -> dict:
        proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
        proc.stdin.write(json.dumps({"script": script, "jobs": jobs, "timeout": timeout, "grace": grace}) + "\n")
        proc.stdin.flush()
        return self._read(timeout + 60, os.path.basename(script))

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)


_SERVER = _RankServer()


def run_ranks(script: str, jobs: Sequence[Tuple[Sequence[str], int]], log_dir: str, timeout: float,
              env: Optional[Dict[str, str]] = None, check: bool = True) -> List[str]:
    """Run ``script`` as each job of ``jobs`` (``(argv, nproc)``) at once, every rank forked from the session's rank
    server (one import of torch and Lightning for the whole session) with the environment torchrun gives its
    workers (``MASTER_ADDR``/``MASTER_PORT`` of a free port per job, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` ...
    when ``nproc > 1``) plus ``env``. Returns each job's log (its ranks' stdout and stderr together). A rank that
    fails ends the other ranks of its job 10 s later, unless ``check`` is False (a test of failing ranks): then they
    run until ``timeout`` and nothing is raised for exit statuses.

    Raises:
        AssertionError: (``check``) a rank exited non-zero, or the jobs were not done within ``timeout`` seconds
            (every rank still running is killed first); the message holds the logs' tails.
    """
    specs, logs = [], []
    for i, (argv, nproc) in enumerate(jobs):
        log = os.path.join(log_dir, f"ranks{i}.log")
        open(log, "w").close()
        logs.append(log)
        specs.append(dict(argv=[str(a) for a in argv], nproc=int(nproc), log=log,
                          env=dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **(env or {}))))
    answer = _SERVER.run(os.path.join(ROOT, script), specs, timeout, grace=None if check else timeout)
    codes = answer["codes"]
    if check and (answer["timed_out"] or any(c != 0 for job in codes for c in job)):
        why = f"not done within {timeout:.0f} s" if answer["timed_out"] else f"exit codes {codes}"
        details = "\n".join(f"--- {script} {' '.join(spec['argv'])}\n{_tail(log)}" for spec, log in zip(specs, logs))
        raise AssertionError(f"{why}\n{details}")
    return [_tail(log, 200_000) for log in logs]


FAULTS_JOB = os.path.join(ROOT, "tests", "scripts", "faults_job.py")


class Jobs:
    """Jobs of ``faults_job.py`` (two processes each; ``--devices N`` in a job's arguments: N, ``--devices 1`` one
    process, Lightning's own rank 0), all ranks forked from one process that imported torch and Lightning once
    (``--fork``). ``jobs``: name -> (output folder, arguments); rank ``r`` of a job logs to ``out/rank{r}.log``;
    every job gets ``--timeout-s timeout_s``."""

    def __init__(self, spec_dir, timeout_s: float, jobs: Dict[str, Tuple[object, List[str]]]) -> None:
        ranks = []
        for name, (out, args) in jobs.items():
            port = str(free_port())
            nproc = int(args[args.index("--devices") + 1]) if "--devices" in args else 2
            for r in range(nproc):
                env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                if nproc > 1:
                    env.update(WORLD_SIZE=str(nproc), NODE_RANK="0", LOCAL_RANK=str(r))
                argv = ["--out", str(out), "--timeout-s", str(timeout_s), *args]
                ranks.append(dict(env=env, argv=argv, log=os.path.join(out, f"rank{r}.log"), job=name, rank=r))
        self.ranks = ranks
        self.spec = os.path.join(spec_dir, f"fork{free_port()}.json")
        with open(self.spec, "w") as f:
            json.dump(ranks, f)
        self.launcher = subprocess.Popen([sys.executable, FAULTS_JOB, "--fork", self.spec], cwd=ROOT, env=clean_env())
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


def job_log(out, rank: int) -> str:
    """Rank ``rank``'s log of a :class:`Jobs` job writing to ``out``."""
    with open(os.path.join(out, f"rank{rank}.log"), errors="replace") as f:
        return f.read()
