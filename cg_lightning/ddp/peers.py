"""When another rank fails: which rank, and an error that leads with the cause instead of the transport's words.

A collective that fails says what the transport saw ("Timed out waiting 3000ms for recv operation to complete",
"Connection closed by peer [10.0.0.7]:5793"), not which rank is at fault or why. :func:`peer_errors` turns such a
failure into a :class:`PeerLostError` whose message starts with the cause and the rank:

* **gone**: the peer's connection closed (it crashed, was killed, lost its network);
* **silent**: nothing came back within ``ddp.timeout_s`` and its heartbeat stopped too (a stopped process, a hang
  in native code, an unreachable host);
* **late**: nothing came back within ``ddp.timeout_s`` although its heartbeat goes on (it is busy elsewhere: a
  longer step, a hang in Python code, a rank running other code).

The rank is named from a :class:`PeerWatch`: a daemon thread per process that bumps a counter in the process
group's store every ``interval_s``. On a failure the counters are read twice, ``1.5 * interval_s`` apart; a rank
whose counter did not move is silent or gone. Without a watch, in a world of two the other rank is named.
Imports only torch.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from typing import Dict, Iterator, List, Optional

import torch.distributed as dist

from .. import torch_compat
from .errors import GradSyncError

_GONE = ("connection closed", "connection reset", "broken pipe", "connection refused", "end of file",
         "socket closed", "no route to host")
_TIMEOUT = ("timed out", "timeout")
# what gloo and NCCL say (a RuntimeError with one of these comes from the transport, not from user code)
_TRANSPORT = ("connection closed by peer", "connection reset by peer", "timed out waiting", "pair closure",
              "operation timed out", "nccl", "gloo", "broken pipe")
_PREFIX = "cg_lightning/heartbeat/"


class PeerLostError(GradSyncError):
    """Another rank is gone, silent, or late past ``ddp.timeout_s`` in a collective; raised on every live rank
    instead of a hang. The message names this rank, the rank(s) at fault where known, the phase and the cause;
    the transport's own message comes last."""


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


class PeerWatch:
    """A heartbeat per rank in the default process group's store, read when a collective fails.

    Args:
        rank, world_size: this process in the world group.
        interval_s: seconds between two beats (also the check's scale: it waits ``1.5 * interval_s``).
    """

    def __init__(self, rank: int, world_size: int, interval_s: float = 1.0) -> None:
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self._store = torch_compat.default_store()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="cg_lightning-heartbeat", daemon=True)

    def start(self) -> "PeerWatch":
        self._store.set(f"{_PREFIX}{self.rank}", "0")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and wait (a few intervals at most) for the thread to leave the store: a thread still inside
        a store call while the process exits aborts it (``terminate called without an active exception``)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30.0)  # a store call returns within its own timeout, or fails at once

    def _beat(self) -> None:
        n = 0
        while not self._stop.wait(self.interval_s):
            n += 1
            if self._stop.is_set():
                return
            try:
                self._store.set(f"{_PREFIX}{self.rank}", str(n))
            except Exception:  # the store's host is gone: nothing left to tell
                return

    def _read(self) -> Dict[int, Optional[str]]:
        out: Dict[int, Optional[str]] = {}
        for r in range(self.world_size):
            if r != self.rank:
                key = f"{_PREFIX}{r}"
                out[r] = self._store.get(key).decode() if self._store.check([key]) else None
        return out

    def silent_ranks(self) -> Optional[List[int]]:
        """The other ranks whose heartbeat did not move within ``1.5 * interval_s``; ``None`` if the store
        cannot be read (its host is gone: rank 0, or the launcher that holds it)."""
        try:
            before = self._read()
            time.sleep(1.5 * self.interval_s)
            after = self._read()
        except Exception:
            return None
        return [r for r in after if after[r] is None or after[r] == before[r]]


_watch: Optional[PeerWatch] = None
_exit_hook = False


def start_watch(rank: int, world_size: int, timeout_s: float) -> PeerWatch:
    """Start this process's :class:`PeerWatch` (beating every ``min(1, timeout_s / 4)`` s), replacing any. It is
    stopped at the latest when the interpreter exits (``atexit``), before daemon threads are torn down."""
    global _watch, _exit_hook
    if not _exit_hook:
        atexit.register(stop_watch)
        _exit_hook = True
    stop_watch()
    _watch = PeerWatch(rank, world_size, min(1.0, timeout_s / 4)).start()
    return _watch


def stop_watch() -> None:
    global _watch
    if _watch is not None:
        _watch.stop()
    _watch = None


def _ranks(ranks: List[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def peer_error(exc: BaseException, during: str, timeout_s: float) -> PeerLostError:
    """A :class:`PeerLostError` for ``exc``, a collective's failure ``during`` a phase ("the backward of
    step 3"), leading with the cause and naming the ranks at fault where this can be known."""
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else 0
    world = dist.get_world_size() if initialized else 1
    kind = classify(exc)
    silent = _watch.silent_ranks() if _watch is not None else None
    others = [r for r in range(world) if r != rank]
    culprits = silent if silent else (others if world == 2 else None)
    who = _ranks(culprits) if culprits else "another rank"
    if kind == "gone":
        head = (f"{who} is gone (its connection closed) during {during}: it crashed, was killed or lost its "
                "network; its own log holds the cause")
    elif kind == "timeout" and silent == [] and _watch is not None:
        head = (f"every other rank is alive but {'it' if world == 2 else 'one'} did not reach {during} within "
                f"{timeout_s:g} s (ddp.timeout_s): it is busy elsewhere (a longer step, a hang in Python code, "
                "ranks running different code)")
    elif kind == "timeout":
        beat = " and no heartbeat" if silent else ""
        head = (f"{who} has been silent for {timeout_s:g} s (ddp.timeout_s) during {during}: no reply{beat}; it "
                "is stopped, hung, or its host is unreachable")
    else:
        head = f"a collective with {who} failed during {during}"
    if silent is None and _watch is not None:
        head += " (the rendezvous store is unreachable too: rank 0 or the launcher holding it is gone)"
    return PeerLostError(f"rank {rank}: {head}. The transport said: {exc}")


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
