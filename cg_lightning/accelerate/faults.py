"""Faults under ``CUDAGraphAccelerator``: bounded collectives that name the rank at fault, and an agreed stop on
preemption.

**Bounded, named collectives.** From the first ``prepare(model)`` with several processes on, every collective of
the world group waits at most ``ddp.timeout_s`` (Accelerate's own timeout, 30 minutes by default, keeps bounding
what came before: the rendezvous, data preparation). ``accelerator.backward``, the prepared optimizer's ``step``,
``wait_for_everyone``, ``gather``, ``reduce`` and ``save_state`` raise
:class:`~cg_lightning.ddp.peers.PeerLostError` when another rank is gone or silent, naming it (the progress board
of :mod:`cg_lightning.ddp.progress`, written at the forward, backward and optimizer step of every step).

**Preemption**, in Accelerate's ``set_trigger``/``check_trigger`` idiom: :meth:`check_preemption`, called by every
process at the same point of the loop (after an optimizer step), is true on every process once any of them got
SIGTERM (under SLURM also SIGUSR1), agreed in one tiny all-reduce; the loop then saves (``save_state``) and calls
:meth:`exit_preempted`, which ends training and exits with ``128 + signal`` (143 for SIGTERM). The first call
installs the handlers: until then a signal ends the process as usual.
"""

from __future__ import annotations

from typing import Any, NoReturn, Optional, Sequence

from typing_extensions import override

from ..ddp import peers, progress
from ..lifecycle.preemption import SignalStop, default_signals, exit_status, signal_name


class AccelerateFaultsMixin:
    """The accelerator's part in faults (see the module docstring). Expects ``ddp_options`` and ``_graph_engines``
    from the accelerator, and ``preemption_signals`` (``None``: :func:`~cg_lightning.lifecycle.preemption.
    default_signals`)."""

    preemption_signals: Optional[Sequence[int]] = None
    _preemption: Optional[SignalStop] = None
    _faults_started = False

    # ----------------------------------------------------------------- bounded collectives
    def _start_faults(self) -> None:
        """At the first prepared engine: the world group's timeout becomes ``ddp.timeout_s``; the board opens."""
        if not self._faults_started:
            self._faults_started = peers.bound_world(self.ddp_options.timeout_s)

    def _stop_faults(self) -> None:
        preemption, self._preemption = self._preemption, None
        if preemption is not None:
            preemption.close()
        if self._faults_started:
            progress.close_board()
        self._faults_started = False

    def _step(self) -> int:
        """Optimizer steps completed (the first engine's count), ``-1`` before any engine."""
        return self._graph_engines[0].steps if self._graph_engines else -1

    def _bounded(self, phase: str, during: Optional[str] = None):
        return peers.bounded_phase(self._step(), phase, self.ddp_options.timeout_s, during)

    @override
    def wait_for_everyone(self) -> None:
        """Accelerate's ``wait_for_everyone``, bounded and named (``PeerLostError``)."""
        with self._bounded("wait_for_everyone", "accelerator.wait_for_everyone()"):
            super().wait_for_everyone()

    @override
    def gather(self, tensor: Any) -> Any:
        """Accelerate's ``gather``, bounded and named (``PeerLostError``)."""
        with self._bounded("gather", "accelerator.gather()"):
            return super().gather(tensor)

    @override
    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Accelerate's ``reduce``, bounded and named (``PeerLostError``)."""
        with self._bounded("reduce", "accelerator.reduce()"):
            return super().reduce(tensor, reduction, scale)

    @override
    def save_state(self, *args: Any, **kwargs: Any):
        """Accelerate's ``save_state`` (refused under ``ddp.distributed_optimizer``), bounded and named."""
        with self._bounded("save_state", "accelerator.save_state()"):
            return super().save_state(*args, **kwargs)

    # ----------------------------------------------------------------- preemption
    def check_preemption(self) -> bool:
        """Whether the job was asked to stop: ``True`` on every process once any process received SIGTERM (under
        SLURM also SIGUSR1; ``preemption_signals`` of the constructor), from then on. Call it on every process at
        the same point of the loop, after an optimizer step (``if accelerator.sync_gradients and
        accelerator.check_preemption():``), then ``save_state`` and :meth:`exit_preempted`.

        The first call installs the signal handlers (from the main thread; with several processes a collective:
        it creates a gloo group); each call is one all-reduce of one integer, bounded by ``ddp.timeout_s``.

        Raises:
            PeerLostError: another process did not take part within ``ddp.timeout_s`` (named).
            RuntimeError: the first call is not in the main thread.
        """
        if self._preemption is None:
            signals = self.preemption_signals if self.preemption_signals is not None else default_signals()
            self._preemption = SignalStop(signals, self.ddp_options.timeout_s)
        step = self._step()
        progress.report(step, "preemption check")
        request = self._preemption.request
        known = request.agreed
        signum = request.agree(f"the preemption check after step {step}")
        if signum and not known:
            self.print(f"cg_lightning: {signal_name(signum)} received; every process stops after step {step} "
                       f"(save the state, then accelerator.exit_preempted(): exit status {exit_status(signum)})")
        return bool(signum)

    @property
    def preemption_signal(self) -> int:
        """The signal number every process agreed to stop on (:meth:`check_preemption`), ``0`` until then."""
        return self._preemption.request.agreed if self._preemption is not None else 0

    def exit_preempted(self) -> NoReturn:
        """End training (``end_training``: engines released, handlers restored, process group destroyed) and exit
        with ``128 + signal`` (143 for SIGTERM), what a shell reports for a process the signal ended.

        Raises:
            SystemExit: always, with that status.
            RuntimeError: :meth:`check_preemption` has not returned ``True``.
        """
        signum = self.preemption_signal
        if not signum:
            raise RuntimeError("cg_lightning: exit_preempted() without an agreed stop; call it once "
                               "accelerator.check_preemption() returned True")
        self.end_training()
        raise SystemExit(exit_status(signum))
