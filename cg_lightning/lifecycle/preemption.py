"""A stop asked for by a signal (a scheduler's preemption), agreed by every rank at a step boundary.

A signal handler must not communicate: it runs between two bytecodes of whatever the main thread was doing,
maybe in the middle of a collective the other ranks are waiting in. So :meth:`StopRequest.note` only records the
signal; :meth:`StopRequest.agree`, called by every rank at the same point of every step, combines the ranks'
records in one ``MAX`` all-reduce on a gloo group (bounded by ``ddp.timeout_s``), so that all ranks stop after
the same step however the signal reached them. A process that stopped this way exits with
:func:`exit_status`: ``128 + signal number`` (143 for SIGTERM, 138 for SIGUSR1 on Linux), what a shell reports
for a process the signal ended, so schedulers and wrappers see "interrupted", never success.

:class:`SignalStop` installs handlers that only note the signals, for front-ends whose framework has none of its
own (the Accelerate integration); Lightning's signal connector keeps installing its own.

Imports only torch (and the engine's peer errors).
"""

from __future__ import annotations

import datetime
import os
import signal
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

from ..ddp.peers import peer_errors


def exit_status(signum: int) -> int:
    """The exit status of a run that ``signum`` stopped: ``128 + signum``."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopRequest:
    """The signals this process received and the stop the ranks agreed on.

    Args:
        group: a gloo group over every rank (:func:`control_group`), or ``None`` for one process.
        timeout_s: seconds the agreement waits for the other ranks (``ddp.timeout_s``) before it raises
            :class:`~cg_lightning.ddp.peers.PeerLostError`.

    Attributes:
        pending: the first signal number this process received, ``0`` if none (set by :meth:`note`).
        agreed: the signal number every rank agreed to stop on, ``0`` until then.
    """

    def __init__(self, group=None, timeout_s: float = 300.0) -> None:
        self.group = group
        self.timeout_s = timeout_s
        self.pending = 0
        self.agreed = 0

    def note(self, signum: int, frame=None) -> None:
        """A signal handler: records ``signum`` and nothing else (no I/O, no collective)."""
        if not self.pending:
            self.pending = int(signum)

    def agree(self, during: str) -> int:
        """Every rank at the same point: the largest signal number any rank noted (``0``: none), kept in
        :attr:`agreed` once non-zero. One ``MAX`` all-reduce of one integer on :attr:`group`.

        Raises:
            PeerLostError: another rank did not take part within ``timeout_s`` (``during`` names the point).
        """
        if self.agreed:
            return self.agreed
        if self.group is None:
            self.agreed = self.pending
            return self.agreed
        flag = torch.tensor([self.pending], dtype=torch.int64)
        with peer_errors(during, self.timeout_s):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.agreed = int(flag.item())
        return self.agreed

    def close(self) -> None:
        """Destroy the group, if any."""
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None


def control_group(timeout_s: float) -> Optional[object]:
    """A gloo group over every rank with collectives bounded by ``timeout_s`` (a collective: every rank calls it at
    the same point), or ``None`` with one process or without ``torch.distributed``."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def default_signals() -> Sequence[int]:
    """SIGTERM, which schedulers send before they kill a job, and under SLURM (``SLURM_JOB_ID`` set) also SIGUSR1,
    its usual early warning (``#SBATCH --signal=SIGUSR1@90``; Lightning's default requeue signal)."""
    return (signal.SIGTERM, signal.SIGUSR1) if "SLURM_JOB_ID" in os.environ else (signal.SIGTERM,)


class SignalStop:
    """Handlers for ``signals`` that only note them in :attr:`request`, installed until :meth:`close`.

    Args:
        signals: signal numbers (:func:`default_signals`).
        timeout_s: bounds the agreement (``ddp.timeout_s``).

    Creating one is a collective when there are several processes (the agreement's gloo group).

    Raises:
        RuntimeError: not in the main thread (Python installs signal handlers there only).
    """

    def __init__(self, signals: Sequence[int], timeout_s: float) -> None:
        self._previous: Dict[int, object] = {}
        self.request = StopRequest(None, timeout_s)
        try:
            for signum in signals:
                self._previous[int(signum)] = signal.signal(signum, self.request.note)
        except ValueError as exc:  # "signal only works in main thread of the main interpreter"
            self.close()
            raise RuntimeError(f"cg_lightning: signal handlers for preemption are installed from the main thread "
                               f"only ({exc})") from exc
        self.request.group = control_group(timeout_s)

    def close(self) -> None:
        """Give the signals their previous handlers back and destroy the agreement's group."""
        for signum, handler in self._previous.items():
            try:
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: installed from C
            except ValueError:  # not the main thread
                pass
        self._previous = {}
        self.request.close()
