"""Faults under the Lightning strategy: bounded collectives with named errors, and preemption that loses nothing.

:class:`FaultsMixin` is part of the strategy body (:class:`~.strategy.CUDAGraphDDPMixin` derives from
it); it works with both Lightning packages.

**Every collective bounded by** ``ddp.timeout_s``. Lightning creates the world group with its ``timeout``
(30 minutes unless given to the strategy), which then bounds the set-up: rendezvous, ``prepare_data``, the setup
hooks. When training starts the world group's timeout becomes ``ddp.timeout_s``; the engine's and the preemption
check's gloo groups have it from the start. A collective that fails in the strategy's hands (forward, backward,
``barrier``, ``broadcast``, ``reduce``, ``all_gather``: validation's ``sync_dist``, checkpoint saving) raises
:class:`~cg_lightning.ddp.peers.PeerLostError`, cause and rank first. A pending collective then ends within its
timeout, so no rank waits longer than that in the process group's destructor. The rank at fault is named among any
number of ranks through the progress board (:mod:`cg_lightning.ddp.progress`), opened at setup and written at the
start of every batch, its forward, backward and optimizer step, validation and checkpoint saves; a rank that stops
on an error of its own writes it there (:meth:`FaultsMixin.on_exception`), so the others quote it.

**Preemption** (:class:`LightningPreemption`). Lightning's signal connector stays in charge of installing the
handlers for SIGTERM and, under SLURM with ``auto_requeue``, the requeue signal (SIGUSR1 unless configured); what
its handlers did inside the signal (a broadcast on SIGTERM, a checkpoint and a requeue on SIGUSR1) is replaced by
recording the signal (:class:`~cg_lightning.lifecycle.preemption.StopRequest`). The check Lightning runs at the
start of every training batch (a broadcast of rank 0's flag) becomes one agreement of every rank's flag; once
agreed, at the next optimizer-step boundary (gradient accumulation: the first batch of a window), every rank raises
Lightning's ``SIGTERMException`` before taking that batch. Lightning's exception handling then calls
:meth:`FaultsMixin.on_exception`, which saves the checkpoint of the last completed step as Lightning's
``hpc_ckpt_N.ckpt`` in ``default_root_dir`` (``fit(ckpt_path="hpc")`` resumes it, SLURM does so by itself;
under SLURM's requeue signal Lightning's own save-and-requeue runs there), and sets the exit status to
``128 + signal`` (:func:`~cg_lightning.lifecycle.preemption.exit_status`). One process: the check runs after each
optimizer step, where Lightning's end-of-batch test raises.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from typing_extensions import override

from .. import torch_compat
from ..ddp import peers, progress
from ..lifecycle.preemption import StopRequest, control_group, exit_status, signal_name


def _exceptions_module(trainer: Any):
    """``lightning.pytorch.utilities.exceptions`` or ``pytorch_lightning.utilities.exceptions``, as the Trainer's."""
    package = type(trainer).__module__.split(".trainer")[0]
    return importlib.import_module(f"{package}.utilities.exceptions")


class LightningPreemption:
    """Preemption for one fit: attached to the Trainer at setup, detached at teardown.

    Args:
        timeout_s: ``ddp.timeout_s``, bounding the agreement.
        announce: prints a line on rank 0.
    """

    def __init__(self, timeout_s: float, announce) -> None:
        self.timeout_s = timeout_s
        self.announce = announce
        self.trainer: Any = None
        self.request = StopRequest(None, timeout_s)
        self.checkpoint_path: Optional[str] = None

    def attach(self, trainer: Any) -> None:
        """Before Lightning registers its signal handlers (``Trainer._run`` does after the strategy's setup); a
        collective when there are several processes (the agreement's gloo group)."""
        connector = trainer._signal_connector
        epoch_loop = trainer.fit_loop.epoch_loop
        if not (hasattr(connector, "_sigterm_notifier_fn") and hasattr(epoch_loop, "_broadcast_sigterm_tensor")):
            warnings.warn("cg_lightning: this Lightning's signal handling differs from 2.6's; SIGTERM is left to "
                          "Lightning (no agreed stop, no checkpoint, exit status 0)", UserWarning, stacklevel=2)
            return
        self.trainer = trainer
        self.request = StopRequest(control_group(self.timeout_s), self.timeout_s)
        connector._sigterm_notifier_fn = self.request.note  # over Lightning's method, on this instance only
        connector._slurm_sigusr_handler_fn = self.request.note
        epoch_loop._broadcast_sigterm_tensor = self.check_at_batch_start

    def detach(self) -> None:
        trainer, self.trainer = self.trainer, None
        if trainer is not None:
            for owner, name in ((trainer._signal_connector, "_sigterm_notifier_fn"),
                                (trainer._signal_connector, "_slurm_sigusr_handler_fn"),
                                (trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor")):
                owner.__dict__.pop(name, None)
        self.request.close()

    def _at_window_boundary(self) -> bool:
        trainer = self.trainer
        return trainer.fit_loop.epoch_loop.batch_progress.current.ready % trainer.accumulate_grad_batches == 0

    def check_at_batch_start(self) -> None:
        """Every rank, at the start of every training batch (several processes): agree; stop at a boundary."""
        step = self.trainer.global_step
        progress.report(step, "step start")
        if self.request.agree(f"the preemption check before step {step}") and self._at_window_boundary():
            self._stop()

    def after_optimizer_step(self) -> None:
        """One process: a noted signal stops the run at the end of this batch (Lightning's own test raises)."""
        if self.trainer is not None and self.request.group is None and self.request.agree("an optimizer step"):
            self.trainer._signal_connector.received_sigterm = True

    def _stop(self) -> None:
        self.trainer._signal_connector.received_sigterm = True
        raise _exceptions_module(self.trainer).SIGTERMException(exit_status(self.request.agreed))

    def on_exception(self, exception: BaseException) -> None:
        """After an agreed stop (Lightning's ``SIGTERMException``): save the checkpoint of the last completed step
        on every rank and make the exception's exit status ``128 + signal``."""
        trainer, signum = self.trainer, self.request.agreed
        if trainer is None or not signum or not isinstance(exception, SystemExit):
            return
        connector = trainer._signal_connector
        environment = trainer._accelerator_connector.cluster_environment
        if getattr(environment, "auto_requeue", False) and getattr(environment, "requeue_signal", None) == signum:
            type(connector)._slurm_sigusr_handler_fn(connector, signum, None)  # Lightning's save and requeue
            self.checkpoint_path = "hpc"
        else:
            self.checkpoint_path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
            trainer.save_checkpoint(self.checkpoint_path)
        exception.code = exit_status(signum)
        self.announce(f"cg_lightning: stopped by {signal_name(signum)} after step {trainer.global_step}; "
                      f"checkpoint {self.checkpoint_path} (resume with fit(ckpt_path=\"hpc\") or its path); "
                      f"exit status {exception.code}")


class FaultsMixin:
    """The strategy's part in faults: bounded, named collectives, the progress board, preemption (see the module
    docstring). Expects ``ddp_options`` and ``_announce`` from the strategy body."""

    _preemption: Optional[LightningPreemption] = None

    def _step(self) -> int:
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return trainer.global_step if trainer is not None else -1

    def _bounded(self, phase: str, during: Optional[str] = None):
        """Report ``phase`` of this step to the progress board; inside, a failed collective is a named
        ``PeerLostError`` (``during``: the phase in words, default "the PHASE of step N")."""
        step = self._step()
        progress.report(step, phase)
        return peers.peer_errors(during or f"the {phase} of {f'step {step}' if step >= 0 else 'a step'}",
                                 self.ddp_options.timeout_s)

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn != self._lightning_ns.fitting:
            return
        # Progress reports from the main thread only: a heartbeat thread's store writes aborted the process at exit
        # ("terminate called without an active exception") under PYTORCH_NVML_BASED_CUDA_CHECK=1, which Lightning sets.
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            progress.open_board(dist.get_rank(), dist.get_world_size(), self.ddp_options.timeout_s)
        self._preemption = LightningPreemption(self.ddp_options.timeout_s, self._announce)
        self._preemption.attach(trainer)

    @override
    def on_train_start(self) -> None:
        """From here on every collective of the world group is bounded by ``ddp.timeout_s``."""
        super().on_train_start()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            torch_compat.set_group_timeout(self.ddp_options.timeout_s)

    @override
    def training_step(self, *args: Any, **kwargs: Any):
        with self._bounded("forward"):
            return super().training_step(*args, **kwargs)

    @override
    def backward(self, *args: Any, **kwargs: Any):
        with self._bounded("backward"):
            return super().backward(*args, **kwargs)

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any):
        with self._bounded("optimizer step"):  # its closure: forward and backward
            out = super().optimizer_step(*args, **kwargs)
        if self._preemption is not None:
            self._preemption.after_optimizer_step()
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any):
        progress.report(self._step(), "validation")
        return super().validation_step(*args, **kwargs)

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        progress.report(self._step(), "checkpoint save")
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        with self._bounded(f"barrier {name!r}" if name else "barrier",
                           f"the barrier {name!r}" if name else "a barrier"):
            super().barrier(name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self._bounded("broadcast", f"a broadcast from rank {src} (a checkpoint's path, a decision)"):
            return super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        with self._bounded("reduce", "the reduction of logged values (sync_dist) or a decision"):
            return super().reduce(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        with self._bounded("all_gather", "an all_gather"):
            return super().all_gather(tensor, group, sync_grads)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Lightning's handling of an exception in a run; the other ranks learn from the progress board that this
        rank stopped on an error of its own (not for ``PeerLostError`` and the preemption stop)."""
        board = progress.board()
        if board is not None and not isinstance(exception, (peers.PeerLostError, SystemExit)):
            board.announce("error", f"{type(exception).__name__}: {str(exception)[:200]}")
        super().on_exception(exception)
        if self._preemption is not None:
            self._preemption.on_exception(exception)

    @override
    def teardown(self) -> None:
        preemption, self._preemption = self._preemption, None
        if preemption is not None:
            preemption.detach()
        progress.close_board()
        super().teardown()
