"""The data-parallel engine: ``main_grad`` buffers, per-parameter grad-ready hooks, bucketed all-reduce.

Per parameter a hook on its ``AccumulateGrad`` node (:mod:`.hooks`) moves ``param.grad`` into ``main_grad`` and
reports the parameter ready, following the gradient protocol of :mod:`cg_lightning.protocol`; while graphs are
built it defers (:mod:`cg_lightning.phase`). Each parameter's notifier lives in the engine's grad-ready reporter
(:mod:`.grad_ready`), which graph managers are handed.

The first iteration records each parameter's *golden* ready count (a parameter finalized in several
backward passes reports several times); later iterations dispatch a bucket's asynchronous all-reduce as
soon as every parameter in it reached its golden count, in bucket order (:mod:`.reducer`).
:meth:`DataParallelEngine.finish_grad_sync` waits for all buckets; a bucket that is not complete there is a
:class:`GradSyncError` on every rank, naming the parameters and their counts (:mod:`.ready_check`;
Megatron-LM's DDP, made hang-free). Between steps the engine points ``param.grad`` at ``main_grad`` for the
optimizer and carries back what was done to it (:mod:`.grad_exposure`: :meth:`~DataParallelEngine.expose_grads`,
:meth:`~DataParallelEngine.take_back_grads`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import protocol
from ..main_grad_adds import MainGradAdds
from .adoption import MainGradAdoption
from .broadcast import broadcast_buffers, broadcast_states
from .buffer import GradBuffer
from .bucket import Bucket
from .grad_exposure import GradExposure
from .grad_ready import GradReady
from .hooks import GradHooks
from .options import DDPOptions
from .param_gather import ParamGather
from .ready_check import ReadyCheck
from .reducer import BucketReducer
from .shards import ShardLayout
from .unused import UnusedParameters


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DataParallelEngine(GradExposure, nn.Module):
    """Wraps ``module`` for data-parallel training with exact ``main_grad`` accumulation.

    Args:
        module: the model (already on its device). Its parameters that require grad get
            ``param.main_grad`` (a view into a contiguous buffer per gradient dtype).
        options: :class:`DDPOptions`.
        process_group: the group to all-reduce over (default: the world, if initialized).
        grad_accumulator_stream: CUDA stream on which the parameters' ``AccumulateGrad`` nodes are created
            (autograd runs each node on the stream it was created on). Pass the graph capture stream: a
            captured backward that feeds a node bound to the default stream fails with "operation would
            make the legacy stream depend on a capturing blocking stream". Lightning builds torch DDP on
            a side stream for the same reason.

    ``forward`` calls ``module``. Parameters and buffers are broadcast from rank 0 at construction;
    with ``options.broadcast_buffers`` the buffers are broadcast again, in place, before forwards (see
    :meth:`forward`).

    Raises:
        GradSyncError: from :meth:`finish_grad_sync` (see the module docstring).
    """

    def __init__(
        self,
        module: nn.Module,
        options: Optional[DDPOptions] = None,
        process_group=None,
        grad_accumulator_stream: Optional["torch.cuda.Stream"] = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.options = options or DDPOptions()
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = process_group if process_group is not None else (dist.group.WORLD if self.distributed else None)
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.params: List[nn.Parameter] = [p for p in module.parameters() if p.requires_grad]
        self.names: Dict[nn.Parameter, str] = {}
        for name, p in module.named_parameters():
            self.names.setdefault(p, name)
        if self.distributed and self.world_size > 1:
            broadcast_states(module, self.group)
        self.buffers_: List[GradBuffer] = []
        self.buckets: List[Bucket] = []
        sharded = self.options.distributed_optimizer
        by_dtype: Dict[tuple, List[nn.Parameter]] = {}
        for p in self.params:
            dtype = _DTYPES[self.options.grad_dtype] if self.options.grad_dtype else p.dtype
            by_dtype.setdefault((dtype, p.dtype) if sharded else (dtype,), []).append(p)
        bucket_bytes = int(self.options.bucket_size_mb * 1024 * 1024)
        for (dtype, *_), params in by_dtype.items():
            buf = GradBuffer(params, dtype, params[0].device, bucket_bytes, len(self.buckets),
                             pad_to=self.world_size if sharded else 1)
            self.buffers_.append(buf)
            self.buckets.extend(buf.buckets)
        #: ``ddp.distributed_optimizer``: this rank's shard of every bucket (reduce-scattered into), the parameters
        #: in buffers of the same layout (:mod:`.shards`); ``None`` otherwise
        self.shards: Optional[ShardLayout] = (ShardLayout(self.buffers_, self.group, self.rank, self.world_size)
                                              if sharded else None)
        #: the all-gather of the updated parameters after each sharded step (:mod:`.param_gather`), or ``None``
        self.param_gather: Optional[ParamGather] = None
        if self.shards is not None:
            self.param_gather = ParamGather(self.shards, self.params, self.options.overlap_param_gather)
        self.bucket_of: Dict[nn.Parameter, Bucket] = {p: b for b in self.buckets for p in b.params}
        #: ``ddp.find_unused_parameters``: a parameter may get no gradient in a backward (:mod:`.unused`)
        self.unused: Optional[UnusedParameters] = None
        if self.options.find_unused_parameters:
            for b in self.buckets:
                b.allow_absent()
            self.unused = UnusedParameters(self.params, [(self.bucket_of[p], self.bucket_of[p].slot_of[p])
                                                         for p in self.params])
        #: the grad-ready reporter (:mod:`cg_lightning.protocol`): hand it to a graph manager with
        #: ``GraphManager.bind_grad_ready`` before capture
        self.grad_ready = GradReady(self)
        self._grad_hooks = GradHooks(self, grad_accumulator_stream)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.reducer = BucketReducer(self.buckets, self.group, self.world_size, self.options, device,
                                     grad_accumulator_stream)
        # expose_grads' fast path: the main_grad views as made here (checked by identity at every use)
        self._main_grads = list(map(protocol.MAIN_GRAD, self.params))
        # the buffer views themselves (detached: they keep pointing into the buffer even if a main_grad's .data is
        # swapped, e.g. by ``param.grad.data = x`` while param.grad aliases it); _reattach_main_grads restores them
        self._buffer_views = [m.detach() for m in self._main_grads]
        self._buffer_ptrs = [v.data_ptr() for v in self._buffer_views]
        self._main_grads_same_dtype = all(g.dtype is p.dtype for p, g in zip(self.params, self._main_grads))
        #: ``main_grad`` storage adopted from autograd's first shares under a graph of the whole step (:mod:`.adoption`)
        self.adoption = MainGradAdoption(self)
        self.sync_enabled = True
        #: ``param.grad`` points at ``main_grad`` (:meth:`expose_grads`) and nothing has zeroed it since
        self.grads_exposed = False
        #: the hooks move eagerly computed gradients into ``main_grad`` and report them ready; when ``False``
        #: they leave ``param.grad`` to autograd, as if the engine were not there (the Accelerate engine arms
        #: them only inside ``accelerator.backward``; graph capture records occurrences either way)
        self.hooks_armed = True
        #: inside :meth:`grad_adds_batched`: the hooks' main_grad additions, queued for multi-tensor kernels
        self.batched_adds: Optional[MainGradAdds] = None
        #: some parameter reported ready since this was last set to False (with or without gradient sync)
        self.reached = False
        self.golden_known = False
        # called with the parameter at every grad-ready occurrence, before counting (tracing and tests)
        self.ready_observer: Optional[Callable[[nn.Parameter], None]] = None
        self.iteration = 0
        self._buffer_sync_due = True  # torch DDP's require_forward_param_sync: the first forward syncs
        self._check = ReadyCheck(module, self.params, self.names, self.options, self.rank, self.world_size,
                                 self.distributed)

    @property
    def last_ready_counts(self) -> Dict[str, int]:
        """Grad-ready count per parameter name in the last finished iteration (built on access)."""
        return {self.names.get(p, "?"): c for b in self.buckets for p, c in b.last_counts.items()}

    @property
    def dispatch_log(self) -> List[int]:
        """Bucket indices in dispatch order, this iteration."""
        return self.reducer.dispatch_log

    @property
    def last_dispatch_order(self) -> List[int]:
        """Bucket indices in dispatch order, in the last finished iteration."""
        return self.reducer.last_dispatch_order

    def forward(self, *args, **kwargs):
        """Call ``module``; first broadcast its buffers from rank 0 if they are due (``broadcast_buffers``).

        They are due, as in torch DDP, before the first forward and before every forward that follows one
        run with grad enabled and gradient sync on (not under :meth:`no_sync`). The broadcast writes into
        the existing tensors, so graphs captured on them stay valid.
        """
        if self._buffer_sync_due and self.options.broadcast_buffers and self.distributed and self.world_size > 1:
            broadcast_buffers(self.module, self.group)
        out = self.module(*args, **kwargs)
        self._buffer_sync_due = torch.is_grad_enabled() and self.sync_enabled
        return out

    # ----------------------------------------------------------------- grad-ready
    def register_grad_ready(self, param: nn.Parameter) -> None:
        """Count one grad-ready occurrence of ``param``; dispatch complete buckets, in bucket order.

        Buckets are all-reduced strictly in index order (a complete bucket waits for the ones before it),
        so every rank issues the same sequence of collectives even when one rank misses a gradient: the
        mismatch is then reported by :meth:`finish_grad_sync` instead of pairing different buckets.
        Under :meth:`no_sync` nothing is counted (gradients only accumulate in ``main_grad``). This calls
        the parameter's own notifier, the one its hook and graph replays call (bound to its bucket and slot,
        so the hot path does no lookups).
        """
        self.grad_ready.notifier(param)()

    def dispatch_ready_prefix(self) -> None:
        """Start the all-reduce of every complete bucket whose predecessors all started (:mod:`.reducer`)."""
        self.reducer.dispatch_ready_prefix()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate into ``main_grad`` without counting or communicating (gradient accumulation)."""
        old = self.sync_enabled
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = old

    @contextlib.contextmanager
    def grad_adds_batched(self, fresh: bool = False, adopt: bool = False) -> Iterator[MainGradAdds]:
        """The hooks queue their ``main_grad += param.grad`` and launch them as few ``torch._foreach_add_`` kernels:
        before a bucket's all-reduce starts, when 64 MB are pending, and at the end. Bit-identical to one addition
        per parameter (:mod:`cg_lightning.main_grad_adds`); inside a graph of the whole step it replaces about one
        kernel per parameter by a few. The queued gradients stay allocated until launched.

        ``fresh``: the buffers were not zeroed (:meth:`zero_grad_buffer` with ``fill=False``): each ``main_grad``'s
        first share is copied in, and those without one are zeroed before their bucket's all-reduce and at the end.
        ``adopt`` (with ``fresh``; where :meth:`MainGradAdoption.possible <.adoption.MainGradAdoption.possible>`): the
        first share becomes the ``main_grad``'s storage instead; ``self.adoption`` keeps or undoes it.

        Raises:
            GradSyncError: with ``fresh``, a ``main_grad`` written by something other than these hooks (a kernel
                that sets ``grad_added_to_main_grad``, a graph replay) before its first share: it added onto values
                that were never zeroed. Zero the buffer and call this without ``fresh``.
        """
        adds = self.batched_adds = MainGradAdds(fresh=self._main_grads if fresh else (),
                                                adopt=fresh and adopt and self.adoption.possible())
        main_of = protocol.main_grad
        self.reducer.before_dispatch = lambda bucket: adds.settle([main_of(p) for p in bucket.params])
        try:
            yield adds
            adds.settle()
        finally:
            adds.flush()
            self.adoption.record(adds.adopted)
            self.batched_adds = None
            self.reducer.before_dispatch = None

    # ----------------------------------------------------------------- step end
    def finish_grad_sync(self) -> None:
        """Wait for every bucket's all-reduce; afterwards ``main_grad`` holds the reduced gradients.

        In the first iteration the golden counts are recorded (and compared across ranks) and every
        bucket is dispatched here, in order.

        Raises:
            GradSyncError: on every rank, if any rank has a parameter whose ready count is not its golden
                count (or, in the first iteration, that never reported ready), or the ranks' golden counts
                differ, or another rank did not reach this point within ``timeout_s``.
        """
        if self.batched_adds is not None:
            self.batched_adds.settle()
            self.adoption.backward_done()
        self._check.refuse_unfrozen()
        if self.unused is not None and self.golden_known:
            for b in self.buckets:
                b.settle_absent()
        self._check.agree([(p, b) for b in self.buckets for p in b.missing()], self.iteration)
        if not self.golden_known:
            for b in self.buckets:
                b.set_golden()
            self.golden_known = True
            self._check.check_golden_across_ranks(self.buckets)
        self.reducer.dispatch_ready_prefix()  # what the backward did not (first iteration, absent parameters)
        self.reducer.finish()
        if self.unused is not None:
            self.unused.window_synchronized(self.group, self.world_size if self.distributed else 1,
                                            self.buffers_[0].data.device if self.buffers_ else torch.device("cpu"))
        self.iteration += 1

    def discard_iteration(self) -> None:
        """Forget the grad-ready reports of a backward that failed before :meth:`finish_grad_sync` (a capture that
        raised part-way), so that the step run again counts from zero."""
        self.reducer.discard()

    def wait_for_params(self) -> None:
        """Wait for the parameters' all-gathers still pending after a sharded step (``ddp.overlap_param_gather``);
        afterwards every parameter holds its updated value. Nothing to do otherwise."""
        if self.param_gather is not None:
            self.param_gather.wait_all()

    def close(self) -> None:
        """Remove the hooks and grad-ready notifiers; the module trains as if never wrapped."""
        if self.param_gather is not None:
            self.param_gather.close()
        self._grad_hooks.remove()
        self.grad_ready.clear()
        self._check.close()
