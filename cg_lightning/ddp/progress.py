"""Every rank's progress in the rendezvous store, so that a rank whose collective fails can name the rank at fault.

**Writing**, from the main thread only (a second thread still inside a store call when the interpreter exits aborts
the process): the front-ends call :func:`report` at step and phase boundaries (the forward, the backward, the
optimizer step of step N, validation, a checkpoint's save). :meth:`ProgressBoard.report` keeps the position and
writes it at most once per ``interval_s``; a TCPStore ``set`` is sent without waiting for a reply, so a write costs
microseconds. An :class:`Entry` holds the step, the phase, the wall and monotonic time, where the process runs (its
pid, and the kernel and pid namespace it runs in) and what became of the rank: ``"lost"`` once a collective of its
failed (it is alive and waiting for the others), ``"error"`` once it stopped on an error of its own.

**Reading**, after a failure only (:meth:`ProgressBoard.read`): every rank's last entry through a store client of
the board's own, whose calls give up after ``read_timeout_s`` (the rendezvous store's own client waits as long as
the process group's timeout); a store that does not answer raises :class:`StoreUnreachable`. A rank's process on
this host can also be looked at directly (:func:`process_state`).

**Keeping the store up.** When rank 0 holds the store (a launcher without an agent store: Lightning's, SLURM's),
its process's exit takes the board away from the other ranks. Once a rank has said it is lost or stopped on its
own error and then *done* (:meth:`ProgressBoard.finish`, after naming the rank at fault), a store-holding rank 0
leaves the process only after every other rank said it is done too, or was seen exited or stopped, or
``min(10, max(2, timeout_s / 4)) + 2`` s passed (``atexit``), so that a rank that noticed the failure later (it
waited in another collective, or its CPU was busy) still reads the board.

Imports only torch.
"""

from __future__ import annotations

import atexit
import json
import os
import time
import warnings
from dataclasses import asdict, dataclass
from typing import List, Optional

import torch.distributed as dist

from .. import torch_compat

_PREFIX = "cg_lightning/progress"


class StoreUnreachable(RuntimeError):
    """The rendezvous store did not answer within the board's read timeout (its host is gone or unreachable)."""


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat_fields(pid: int) -> Optional[List[str]]:
    """``/proc/PID/stat`` after the command name (field 3, the state, first), or ``None`` (no such process)."""
    text = _read(f"/proc/{pid}/stat")
    return text.rsplit(")", 1)[1].split() if text else None


def _namespace() -> str:
    """This kernel's boot id and this pid namespace: processes with the same value see each other's pids."""
    try:
        return f"{_read('/proc/sys/kernel/random/boot_id')}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


_NAMESPACE = _namespace()


@dataclass
class Entry:
    """One rank's last report. ``step`` ``-1``: before the first step. ``kind``: ``""`` while it trains, ``"lost"``
    (a collective failed, ``note`` holds the failure's kind and phase) or ``"error"`` (``note``: the exception);
    ``done``: it has read the board for the last time."""

    step: int
    phase: str
    wall: float
    mono: float
    pid: int
    started: str
    namespace: str
    kind: str = ""
    note: str = ""
    done: bool = False

    def age_s(self) -> float:
        """Seconds since it was written: by the monotonic clock on this host, by the wall clock elsewhere."""
        local = self.namespace.split("/")[0] == _NAMESPACE.split("/")[0] and bool(_NAMESPACE)
        return max(0.0, time.monotonic() - self.mono if local else time.time() - self.wall)


def process_state(entry: Optional[Entry]) -> Optional[str]:
    """``"exited"``, ``"stopped"`` (SIGSTOP, a debugger) or ``"running"`` for the process that wrote ``entry`` if
    it runs in this pid namespace on this host; ``None`` where that cannot be seen."""
    if entry is None or not _NAMESPACE or entry.namespace != _NAMESPACE:
        return None
    fields = _stat_fields(entry.pid)
    if fields is None or fields[19] != entry.started or fields[0] in ("Z", "X", "x"):
        return "exited"
    return "stopped" if fields[0] in ("T", "t") else "running"


class ProgressBoard:
    """This rank's reports and every rank's last one, in ``store`` under keys of one ``generation``.

    Args:
        store: a store client for the board alone (its timeout bounds every read).
        rank, world_size: this process in the world group.
        interval_s: the least time between two writes of :meth:`report`.
        store_host: who holds the store: ``"rank 0"``, or a description of the launcher that does.
        address: ``host:port`` of the store, for messages.
        generation: a number every rank counts alike (boards opened so far), so that a later training in the
            same job does not read an earlier one's entries.
        held: the store's server object when this process holds it (kept alive here), else ``None``.
    """

    def __init__(self, store, rank: int, world_size: int, interval_s: float, store_host: str, address: str,
                 generation: int = 0, held=None) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self.store_host = store_host
        self.address = address
        self.step, self.phase = -1, "set-up"
        self.kind, self.note, self.done = "", "", False
        self.held = held
        self.linger_s = 4.0
        self.broken: Optional[str] = None  # why writing stopped (the store failed once: no further stalls)
        self._keys = [f"{_PREFIX}/{generation}/{r}" for r in range(world_size)]
        self._next = 0.0
        fields = _stat_fields(os.getpid())
        self._started = fields[19] if fields else ""

    def report(self, step: int, phase: str) -> None:
        """This rank is at ``phase`` of ``step`` (an optimizer-step count); written if ``interval_s`` passed since the
        last write. Never raises: a store that fails stops the writing."""
        self.step, self.phase = step, phase
        now = time.monotonic()
        if now >= self._next and self.broken is None and not self.kind:
            self._next = now + self.interval_s
            self._write()

    def announce(self, kind: str, note: str) -> None:
        """Write now that this rank is ``"lost"`` (a collective failed: ``note`` says which and how) or stopped on an
        ``"error"`` (``note``: the exception). Never raises."""
        self.kind, self.note = kind, note
        self._write()

    def finish(self) -> None:
        """Write that this rank has read the board for the last time (after :meth:`announce`). Never raises."""
        self.done = True
        self._write()

    def _write(self) -> None:
        entry = Entry(self.step, self.phase, time.time(), time.monotonic(), os.getpid(), self._started, _NAMESPACE,
                      self.kind, self.note, self.done)
        try:
            self.store.set(self._keys[self.rank], json.dumps(asdict(entry)))
        except Exception as exc:  # the store is gone: say so at the next failure, not at every step
            self.broken = str(exc)

    def read(self) -> List[Optional[Entry]]:
        """Every rank's last entry (``None``: it never reported), in at most a few store round trips.

        Raises:
            StoreUnreachable: the store did not answer within the client's timeout, or its connection is closed.
        """
        try:
            if self.store.check(self._keys):
                values = list(self.store.multi_get(self._keys)) if hasattr(self.store, "multi_get") else [
                    self.store.get(k) for k in self._keys]
            else:
                values = [self.store.get(k) if self.store.check([k]) else None for k in self._keys]
        except Exception as exc:
            text = str(exc).strip()
            raise StoreUnreachable(text.splitlines()[0] if text else type(exc).__name__) from exc
        return [_entry(v) for v in values]


def _entry(value) -> Optional[Entry]:
    try:
        return Entry(**json.loads(bytes(value).decode()))
    except (TypeError, ValueError):  # None, or written by another version
        return None


_board: Optional[ProgressBoard] = None
_lingering: Optional[ProgressBoard] = None
_generation = 0


def _board_store(read_timeout_s: float):
    """A client of the rendezvous store of its own with ``read_timeout_s``, who holds the store, its address, and
    the store itself (its server, on rank 0 when it holds it)."""
    store = torch_compat.default_store()
    while hasattr(store, "underlying_store"):  # PrefixStore
        store = store.underlying_store
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        holder = "the launcher (torchrun's agent on the first node)"
    else:
        holder = "rank 0"
    if isinstance(store, dist.TCPStore):
        client = torch_compat.bounded_store_client(store.host, store.port, read_timeout_s)
        return client, holder, f"{store.host}:{store.port}", store
    return store, "this job's store", type(store).__name__, store  # a FileStore or HashStore: local, never hangs


def open_board(rank: int, world_size: int, timeout_s: float, store=None) -> Optional[ProgressBoard]:
    """Start this process's board (replacing any) and write a first entry; ``None`` with one process or without a
    rendezvous store. Writes every ``min(1, max(0.25, timeout_s / 10))`` s at most; reads give up after
    ``min(5, max(1, timeout_s / 4))`` s. Not a collective, but every rank opens one at the same point.

    Args:
        store: a store to use instead of a client of the rendezvous store (its calls must give up by themselves).
    """
    global _board, _generation
    close_board()
    if world_size < 2 or (store is None and not (dist.is_available() and dist.is_initialized())):
        return None
    server = None
    if store is not None:
        holder, address = "this job's store", type(store).__name__
    else:
        try:
            store, holder, address, server = _board_store(min(5.0, max(1.0, timeout_s / 4)))
        except Exception as exc:  # the rank at fault is then named for two ranks only
            warnings.warn(f"cg_lightning: no progress board (the rendezvous store refused a client: {exc})",
                          RuntimeWarning, stacklevel=2)
            return None
    if _generation == 0:
        atexit.register(_at_exit)  # the store client goes before the interpreter's teardown
    _board = ProgressBoard(store, rank, world_size, min(1.0, max(0.25, timeout_s / 10)), holder, address,
                           _generation, server if holder == "rank 0" and rank == 0 else None)
    _board.linger_s = min(10.0, max(2.0, timeout_s / 4)) + 2.0
    _generation += 1
    _board.report(-1, "set-up")
    return _board


def close_board() -> None:
    """Drop this process's board and its store client; a board of a store-holding rank 0 that saw a failure is
    kept until the interpreter exits (see the module docstring)."""
    global _board, _lingering
    if _board is not None and _board.held is not None and _board.kind:
        _lingering = _board
    _board = None


def _at_exit() -> None:
    global _lingering
    close_board()
    board, _lingering = _lingering, None
    if board is None:
        return
    deadline = time.monotonic() + board.linger_s
    while time.monotonic() < deadline:
        try:
            entries = board.read()
        except StoreUnreachable:
            return
        if all(e is not None and (e.done or e.kind == "error" or process_state(e) in ("exited", "stopped"))
               for r, e in enumerate(entries) if r != board.rank):
            return
        time.sleep(0.2)


def board() -> Optional[ProgressBoard]:
    """This process's board, or ``None``."""
    return _board


def report(step: int, phase: str) -> None:
    """:meth:`ProgressBoard.report` on this process's board, if one is open (from the main thread)."""
    if _board is not None:
        _board.report(step, phase)
