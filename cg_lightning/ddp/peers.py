"""When another rank fails: which rank, and an error that leads with the cause instead of the transport's words.

A collective that fails says what the transport saw ("Timed out waiting 3000ms for recv operation to complete",
"Connection closed by peer [10.0.0.7]:5793"), not which rank is at fault or why. :func:`peer_errors` turns such a
failure into a :class:`PeerLostError` whose message starts with the rank(s) at fault and the cause, then where
every rank was, then the transport's words.

The ranks are told apart through the progress board (:mod:`.progress`). The rank that notices a failure writes
that it is *lost* (alive, its collective failed), then reads every rank's entry, for up to
``min(10, max(2, timeout_s / 4))`` s while some have not said so: every live rank of a data-parallel job fails in
the same collective within about that time, since each waits ``ddp.timeout_s`` or sees a connection close. Then:

* a rank that stopped on an error of its own (written by the front-end) is at fault, with its error;
* a rank that did not answer is at fault: **gone** (its process on this host exited, or a connection closed),
  **silent** (stopped, hung, its host unreachable); its process on this host is looked at directly, which also
  ends the wait early;
* a rank whose process on this host runs but that did not answer is **late** (busy elsewhere), named when no rank
  is gone or silent;
* when every rank answered, the ranks are in different collectives.

Then it writes that it is *done* with the board (a store-holding rank 0 waits for that at exit).

With two ranks nothing is waited for: the other one is at fault. A store that does not answer (its host is rank 0,
or the launcher) names its host. Without a board (the front-end opened none), two ranks name the other one and more
say "another rank". Imports only torch.
"""

from __future__ import annotations

import atexit
import contextlib
import time
from typing import Dict, Iterator, List, Optional

import torch.distributed as dist

from .. import torch_compat
from . import progress
from .errors import GradSyncError
from .progress import Entry, StoreUnreachable, process_state

_GONE = ("connection closed", "connection reset", "broken pipe", "connection refused", "end of file",
         "socket closed", "no route to host")
_TIMEOUT = ("timed out", "timeout")
# what gloo and NCCL say (a RuntimeError with one of these comes from the transport, not from user code)
_TRANSPORT = ("connection closed by peer", "connection reset by peer", "timed out waiting", "pair closure",
              "operation timed out", "nccl", "gloo", "broken pipe")


class PeerLostError(GradSyncError):
    """Another rank is gone, silent, or late past ``ddp.timeout_s`` in a collective; raised on every live rank
    instead of a hang. The message names this rank, the rank(s) at fault where known, the cause and the phase,
    then every rank's last reported step and phase; the transport's own message comes last."""


def classify(exc: BaseException) -> str:
    """``"gone"``, ``"timeout"`` or ``"other"`` from a failed collective's exception text."""
    text = str(exc).lower()
    if any(s in text for s in _GONE):
        return "gone"
    if any(s in text for s in _TIMEOUT):
        return "timeout"
    return "other"


def is_transport_error(exc: BaseException) -> bool:
    """A failure of the communication itself (not a user error raised inside a collective's caller)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc).lower() for s in _TRANSPORT)


def grace_s(timeout_s: float) -> float:
    """Seconds the rank that notices a failure waits for the other live ranks to say they noticed it too."""
    return min(10.0, max(2.0, timeout_s / 4))


def _ranks(ranks: List[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _cause(how: str, who: List[int], during: str, timeout_s: float) -> str:
    """The lead for ranks ``who`` that are ``"exited"``/``"gone"`` (a connection closed) or ``"silent"``."""
    one = len(who) == 1
    name, it = _ranks(who), ("it" if one else "they")
    if how in ("exited", "gone"):
        closed = "its process exited" if how == "exited" else "a connection closed"
        return (f"{name} {'is' if one else 'are'} gone ({closed}) during {during}: {it} crashed, "
                f"{'was' if one else 'were'} killed or lost {'its' if one else 'their'} network; "
                f"{'its own log holds' if one else 'their own logs hold'} the cause")
    return (f"{name} {'has' if one else 'have'} been silent for {timeout_s:g} s (ddp.timeout_s) during {during}: no "
            f"reply; {it} {'is' if one else 'are'} stopped, hung, or {'its host is' if one else 'their hosts are'} "
            "unreachable")


def _where(entry: Optional[Entry]) -> str:
    if entry is None:
        return "nothing (it never reported)"
    return entry.phase if entry.step < 0 else f"step {entry.step} ({entry.phase})"


def _first_kind(entries: List[Optional[Entry]], kind: str) -> str:
    """The failure's kind as the rank that noticed it first saw it (a closed connection seen later is usually a
    live rank that raised and exited)."""
    lost = [e for e in entries if e is not None and e.kind == "lost"]
    return min(lost, key=lambda e: e.wall).note.split("|")[0] if lost else kind


def _wait(board: progress.ProgressBoard, others: List[int], grace: float) -> List[Optional[Entry]]:
    """Every rank's entry, read again until each other rank answered (lost or error), or its process on this host
    is seen exited or stopped, or ``grace`` s passed."""
    deadline = time.monotonic() + grace
    while True:
        entries = board.read()
        pending = [entries[r] for r in others if entries[r] is None or not entries[r].kind]
        if not pending or time.monotonic() >= deadline:
            return entries
        if all(e is not None and process_state(e) in ("exited", "stopped") for e in pending):
            return entries
        time.sleep(0.2)


def _verdict(entries: List[Optional[Entry]], others: List[int], kind: str, during: str, timeout_s: float) -> str:
    errors = [r for r in others if entries[r] is not None and entries[r].kind == "error"]
    answered = [r for r in others if entries[r] is not None and entries[r].kind == "lost"]
    pending = [r for r in others if r not in errors and r not in answered]
    state: Dict[int, Optional[str]] = {r: process_state(entries[r]) for r in others}
    late = [r for r in pending if state[r] == "running"]
    down = [r for r in pending if r not in late]
    if len(others) == 1 and not errors and not down and not late:
        late = others  # two ranks: the other one is at fault even if it noticed a failure too
    first = _first_kind(entries, kind)
    if len(errors) == 1:
        e = entries[errors[0]]
        head = (f"rank {errors[0]} stopped on its own error at {_where(e)} while this rank waited in {during}: "
                f"{e.note}; its log holds the traceback")
    elif errors:
        notes = "; ".join(f"rank {r} at {_where(entries[r])}: {entries[r].note}" for r in errors)
        head = (f"{_ranks(errors)} stopped on their own errors while this rank waited in {during}: {notes}; their "
                "logs hold the tracebacks")
    elif down:
        groups: Dict[str, List[int]] = {}
        for r in down:
            how = {"exited": "exited", "stopped": "silent"}.get(state[r] or "", "gone" if first == "gone" else "silent")
            groups.setdefault(how, []).append(r)
        head = "; ".join(_cause(how, who, during, timeout_s) for how, who in groups.items())
    elif late:
        head = (f"{_ranks(late)} {'is' if len(late) == 1 else 'are'} alive but did not reach {during} within "
                f"{timeout_s:g} s (ddp.timeout_s): busy elsewhere (a longer step, a hang in Python code, ranks "
                "running different code)")
    else:
        head = (f"every other rank is alive and its collective failed too, so the ranks are in different collectives "
                f"(ranks running different code; this rank: {during})")
    at_fault = errors or down or late
    lines = []
    for r in at_fault:
        e = entries[r]
        seen = {"exited": ", its process on this host exited", "stopped": ", its process on this host is stopped",
                "running": ", its process on this host runs"}.get(state[r] or "", "")
        lines.append(f"rank {r} last reported {e.age_s():.1f} s ago at {_where(e)}{seen}" if e is not None
                     else f"rank {r} never reported")
    reached: Dict[str, List[int]] = {}
    for r in [q for q in range(len(entries)) if q not in at_fault]:
        reached.setdefault(_where(entries[r]), []).append(r)
    lines += [f"{_ranks(rs)} reached {where}" for where, rs in reached.items()]
    return f"{head}. Progress: {'; '.join(lines)}"


def _unreachable(board: progress.ProgressBoard, kind: str, during: str, others: List[int], timeout_s: float,
                 why: StoreUnreachable) -> str:
    if board.store_host == "rank 0" and board.rank != 0:
        how = "gone (its connection closed)" if kind == "gone" else f"silent for {timeout_s:g} s (ddp.timeout_s)"
        return (f"rank 0 (the store host, {board.address}) is unreachable: it is {how} during {during} and the "
                f"rendezvous store it holds does not answer ({why}); it crashed, was killed, is stopped, or its host "
                "is unreachable; the other ranks' progress cannot be read")
    head = _cause("gone" if kind == "gone" else "silent", others, during, timeout_s) if len(others) == 1 else (
        f"another rank is {'gone' if kind == 'gone' else 'silent'} during {during}")
    return (f"{head}; the rendezvous store ({board.store_host}, {board.address}) is unreachable too ({why}), so no "
            "rank's progress can be read")


def peer_error(exc: BaseException, during: str, timeout_s: float) -> PeerLostError:
    """A :class:`PeerLostError` for ``exc``, a collective's failure ``during`` a phase ("the backward of
    step 3"), leading with the cause and naming the ranks at fault where this can be known. With a progress
    board this rank first says it is lost and waits up to :func:`grace_s` for the others (bounded: every store
    call gives up after the board's read timeout)."""
    board = progress.board()
    initialized = dist.is_available() and dist.is_initialized()
    if board is not None:
        rank, world = board.rank, board.world_size
    else:
        rank, world = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
    kind = classify(exc)
    others = [r for r in range(world) if r != rank]
    if board is None:
        who = _ranks(others) if world == 2 else "another rank"
        head = (_cause("gone" if kind == "gone" else "silent", others, during, timeout_s) if world == 2
                else f"a collective with {who} failed during {during}")
        return PeerLostError(f"rank {rank}: {head}. The transport said: {exc}")
    first = not board.kind
    if first:
        board.announce("lost", f"{kind}|{during}")
    try:
        entries = _wait(board, others, grace_s(timeout_s) if first and world > 2 else 0.0)
        text = _verdict(entries, others, kind, during, timeout_s)
    except StoreUnreachable as why:
        text = _unreachable(board, kind, during, others, timeout_s, why)
    except Exception as why:  # never hide the failure behind one of the diagnosis
        text = f"a collective failed during {during}; the ranks' progress could not be read ({why!r})"
    if first:
        board.finish()  # this rank reads the board no more (a store-holding rank 0 waits for that before it exits)
    return PeerLostError(f"rank {rank}: {text}. The transport said: {exc}")


@contextlib.contextmanager
def peer_errors(during: str, timeout_s: float) -> Iterator[None]:
    """Inside, a failed collective (see :func:`is_transport_error`) is raised as :func:`peer_error`; other
    exceptions, and :class:`PeerLostError` itself, pass unchanged."""
    try:
        yield
    except PeerLostError:
        raise
    except Exception as exc:
        if not is_transport_error(exc):
            raise
        raise peer_error(exc, during, timeout_s) from exc


def destroy_world_at_exit() -> None:
    """Destroy the default process group at interpreter exit, whatever its backend (once per process). A gloo
    group still alive then can abort the process on recent torch ("terminate called without an active
    exception"); Lightning and Fabric register their own destruction for NCCL only."""
    global _EXIT_REGISTERED
    if not _EXIT_REGISTERED:
        atexit.register(_destroy_world)
        _EXIT_REGISTERED = True


_EXIT_REGISTERED = False


def _destroy_world() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def bound_world(timeout_s: float) -> bool:
    """With several processes in the world group: its collectives wait at most ``timeout_s`` from now on, the group
    is destroyed at interpreter exit (:func:`destroy_world_at_exit`, after the progress board's own exit wait) and
    this process's progress board opens (the loop front ends do this at their first set-up model). Returns whether
    it did; with one process there is nothing to bound."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False
    torch_compat.set_group_timeout(timeout_s)
    destroy_world_at_exit()  # registered before the board's exit wait, so it runs after it
    progress.open_board(dist.get_rank(), dist.get_world_size(), timeout_s)
    return True


def bounded_phase(step: int, phase: str, timeout_s: float, during: Optional[str] = None):
    """``phase`` of ``step`` reported on the board, and a context in which a failed collective is a
    :class:`PeerLostError` saying it happened during it (``during``, default ``the <phase> of step <step>``; a
    negative ``step``: before the first)."""
    progress.report(step, phase)
    return peer_errors(during or f"the {phase} of {f'step {step}' if step >= 0 else 'a step'}", timeout_s)
