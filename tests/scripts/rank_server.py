"""Start the processes of multi-process tests by forking one interpreter that imported everything once.

Importing torch, Lightning (whose torchmetrics imports transformers) and the package costs about 17 s of CPU per
process; a test that trains on two processes paid it twice, one after the other (Lightning's launcher starts the
second rank only once the first has imported), and the suite has dozens of them on 2 CPU cores in CI. This server
imports once, then for each request forks one child per rank: the child sets its rank's environment, runs the
script as ``__main__`` and ends with its exit status, as a fresh interpreter would.

Protocol (stdin and stdout, one JSON object per line): a request ``{"script", "jobs": [{"argv", "env", "nproc",
"log"}], "timeout", "grace"}`` forks ``nproc`` ranks of each job at once (rank ``r`` gets the job's ``env`` plus ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``NODE_RANK`` when ``nproc > 1``; every rank
of a job appends to the job's ``log``), waits for them, and answers ``{"codes": [[...], ...], "timed_out": bool}``.
A rank that fails ends its job's other ranks ``grace`` seconds later (default 10) (they would wait in a collective); ranks still running at
``timeout`` seconds are killed with their process groups (exit status -9). End of input ends the server.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import signal
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "cg_lightning", "cg_lightning.trainer.strategy",
           "cg_lightning.examples.gpt", "cg_lightning.examples.data", "accelerate")
GRACE_S = 10.0


def _child(script: str, argv: list, env: dict, log: str) -> int:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.setpgid(0, 0)  # its own group: a kill at the timeout reaches the processes it starts (DataLoader workers)
    os.environ.update(env)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then the exit status
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what the interpreter runs at exit (the script's own handlers)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _rank_env(job: dict, rank: int) -> dict:
    env = dict(job.get("env") or {})
    n = int(job["nproc"])
    if n > 1:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), GROUP_RANK="0",
                   NODE_RANK="0")
    return env


def _kill(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


def serve(request: dict) -> dict:
    script = request["script"]
    jobs = request["jobs"]
    codes = [[None] * int(job["nproc"]) for job in jobs]
    where = {}
    for j, job in enumerate(jobs):
        for r in range(int(job["nproc"])):
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                os._exit(_child(script, job["argv"], _rank_env(job, r), job["log"]))
            where[pid] = (j, r)
    deadline = time.monotonic() + float(request["timeout"])
    grace = float(request.get("grace") or GRACE_S)
    failed_at = {}  # job -> when a rank of it failed
    timed_out = False
    while where:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            j, r = where.pop(pid)
            codes[j][r] = os.waitstatus_to_exitcode(status)
            _kill(pid)  # what the rank left behind in its group
            if codes[j][r] != 0:
                failed_at.setdefault(j, time.monotonic())
            continue
        now = time.monotonic()
        for p, (j, _) in list(where.items()):
            if now > deadline or (j in failed_at and now > failed_at[j] + grace):
                timed_out = timed_out or now > deadline
                _kill(p)
        time.sleep(0.05)
    return {"codes": codes, "timed_out": timed_out}


def main() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.freeze()  # the imported modules' objects stay out of the children's collections (fewer copied pages)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(serve(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
