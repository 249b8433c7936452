"""The data-parallel engine: ``main_grad`` buffers, per-parameter grad-ready hooks, bucketed all-reduce.

Per parameter a hook on its ``AccumulateGrad`` node (it fires even when a graph replay handed autograd
no gradient, which a ``post_accumulate_grad`` hook would not) moves ``param.grad`` into ``main_grad`` and
reports the parameter ready, following the gradient protocol of :mod:`cg_lightning.protocol`; while graphs
are built it defers (:mod:`cg_lightning.phase`). Each parameter's notifier lives in the engine's grad-ready
reporter (:mod:`.grad_ready`), which graph managers are handed.

The first iteration records each parameter's *golden* ready count (a parameter finalized in several
backward passes reports several times); later iterations dispatch a bucket's asynchronous all-reduce as
soon as every parameter in it reached its golden count. :meth:`DataParallelEngine.finish_grad_sync`
waits for all buckets; a bucket that is not complete there is a :class:`GradSyncError` on every rank,
naming the parameters and their counts (Megatron-LM's DDP, made hang-free).
"""

from __future__ import annotations

import contextlib
import datetime
import operator
from collections import deque
from itertools import repeat
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import protocol, torch_compat
from ..phase import grad_ready_deferred, record_grad_ready
from .buffer import GradBuffer
from .bucket import Bucket
from .errors import GradSyncError
from .grad_ready import GradReady
from .options import DDPOptions
from .unused import UnusedParameters

_DATA_PTR = torch.Tensor.data_ptr
_GRAD = operator.attrgetter("grad")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_CAUSES = (
    "Usual causes: a parameter used only inside activation recomputation that the graph did not "
    "discover, a data-dependent branch that skips a module on this step or this rank, or a parameter "
    "that takes no part in the loss (freeze it with requires_grad=False before training). A count above "
    "the expected one with graphs.direct_grad_ready on: a graphed layer's parameter also used outside its "
    "graph, or a graphed layer called more often than when it was captured, on this step; set "
    "graphs.direct_grad_ready=false for such a model. Every count doubled: a second backward through the "
    "same forward (retain_graph=True, or two losses from one output) in one micro-batch; run one backward "
    "per forward, or add the losses first."
)


class DataParallelEngine(nn.Module):
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
        self._frozen: List[nn.Parameter] = [p for p in module.parameters() if not p.requires_grad]
        self.names: Dict[nn.Parameter, str] = {}
        for name, p in module.named_parameters():
            self.names.setdefault(p, name)
        if self.distributed and self.world_size > 1:
            self._broadcast_states()
        self.buffers_: List[GradBuffer] = []
        self.buckets: List[Bucket] = []
        by_dtype: Dict[torch.dtype, List[nn.Parameter]] = {}
        for p in self.params:
            dtype = _DTYPES[self.options.grad_dtype] if self.options.grad_dtype else p.dtype
            by_dtype.setdefault(dtype, []).append(p)
        bucket_bytes = int(self.options.bucket_size_mb * 1024 * 1024)
        for dtype, params in by_dtype.items():
            buf = GradBuffer(params, dtype, params[0].device, bucket_bytes, len(self.buckets))
            self.buffers_.append(buf)
            self.buckets.extend(buf.buckets)
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
        self._grad_accs = []
        self._hook_handles = []
        stream_ctx = torch.cuda.stream(grad_accumulator_stream) if grad_accumulator_stream is not None else contextlib.nullcontext()
        with stream_ctx:
            for p in self.params:
                protocol.set_grad_added(p, False)
                acc = p.view_as(p).grad_fn.next_functions[0][0]
                bucket = self.bucket_of[p]
                self._hook_handles.append(acc.register_hook(self._make_hook(p, bucket, bucket.slot_of[p])))
                self._grad_accs.append(acc)
        # Gradients reach main_grad on the training stream (graph replays, the optimizer) and on the
        # accumulator stream (the hooks of eagerly computed gradients). A bucket's all-reduce is issued
        # from a hook in the middle of the backward, so it goes out on its own stream after both.
        self._grad_streams: List["torch.cuda.Stream"] = []
        self._comm_stream: Optional["torch.cuda.Stream"] = None
        device = self.params[0].device if self.params else torch.device("cpu")
        if device.type == "cuda" and self.distributed and self.world_size > 1:
            self._grad_streams = [torch.cuda.current_stream(device)]
            if grad_accumulator_stream is not None:
                self._grad_streams.append(grad_accumulator_stream)
            self._comm_stream = torch.cuda.Stream(device=device)
        # dtype and device of each parameter at setup: a later cast resets its AccumulateGrad node (and with
        # it the engine's hook), which a missing-gradient error then names (_cast_since_setup)
        self._setup_types = [(p.dtype, p.device) for p in self.params]
        # expose_grads' fast path: the main_grad views as made here (checked by identity at every use)
        self._main_grads = list(map(protocol.MAIN_GRAD, self.params))
        # the buffer views themselves (detached: they keep pointing into the buffer even if a main_grad's .data is
        # swapped, e.g. by ``param.grad.data = x`` while param.grad aliases it); _reattach_main_grads restores them
        self._buffer_views = [m.detach() for m in self._main_grads]
        self._buffer_ptrs = [v.data_ptr() for v in self._buffer_views]
        self._main_grads_same_dtype = all(g.dtype is p.dtype for p, g in zip(self.params, self._main_grads))
        self.sync_enabled = True
        #: ``param.grad`` points at ``main_grad`` (:meth:`expose_grads`) and nothing has zeroed it since
        self.grads_exposed = False
        #: the hooks move eagerly computed gradients into ``main_grad`` and report them ready; when ``False``
        #: they leave ``param.grad`` to autograd, as if the engine were not there (the Accelerate engine arms
        #: them only inside ``accelerator.backward``; graph capture records occurrences either way)
        self.hooks_armed = True
        #: some parameter reported ready since this was last set to False (with or without gradient sync)
        self.reached = False
        self.golden_known = False
        # called with the parameter at every grad-ready occurrence, before counting (tracing and tests)
        self.ready_observer: Optional[Callable[[nn.Parameter], None]] = None
        self.iteration = 0
        self.dispatch_log: List[int] = []  # bucket indices in dispatch order, this iteration
        self.last_dispatch_order: List[int] = []
        self._next_dispatch = 0
        self._buffer_sync_due = True  # torch DDP's require_forward_param_sync: the first forward syncs
        self._control_group = None
        if self.distributed and self.world_size > 1 and self.options.check_grad_ready:
            timeout = datetime.timedelta(seconds=self.options.timeout_s)
            self._control_group = dist.new_group(backend="gloo", timeout=timeout)

    @property
    def last_ready_counts(self) -> Dict[str, int]:
        """Grad-ready count per parameter name in the last finished iteration (built on access)."""
        return {self.names.get(p, "?"): c for b in self.buckets for p, c in b.last_counts.items()}

    def forward(self, *args, **kwargs):
        """Call ``module``; first broadcast its buffers from rank 0 if they are due (``broadcast_buffers``).

        They are due, as in torch DDP, before the first forward and before every forward that follows one
        run with grad enabled and gradient sync on (not under :meth:`no_sync`). The broadcast writes into
        the existing tensors, so graphs captured on them stay valid.
        """
        if self._buffer_sync_due and self.options.broadcast_buffers and self.distributed and self.world_size > 1:
            self._broadcast_buffers()
        out = self.module(*args, **kwargs)
        self._buffer_sync_due = torch.is_grad_enabled() and self.sync_enabled
        return out

    def _broadcast_buffers(self) -> None:
        buffers = [b for b in self.module.buffers()]  # looked up every time: a module may reassign one
        if not buffers:
            return
        with torch.no_grad():
            if torch_compat.broadcast_coalesced(self.group, buffers, 250 * 1024 * 1024, 0):  # group-local source
                return
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            for b in buffers:
                dist.broadcast(b, src=src, group=self.group)

    # ----------------------------------------------------------------- hooks
    def _make_hook(self, param: nn.Parameter, bucket: Bucket, slot: int):
        notify = self.grad_ready.add(param, bucket, slot)
        grad_added, set_grad_added, main_grad = protocol.grad_added, protocol.set_grad_added, protocol.main_grad

        def hook(*_unused) -> None:
            if grad_ready_deferred():
                record_grad_ready(param, notify)
                return
            if not self.hooks_armed:  # a backward the engine does not own: plain accumulation into param.grad
                return
            if grad_added(param):
                set_grad_added(param, False)
                param.grad = None
            else:
                grad = param.grad
                if grad is not None:  # None after a graph replay: the graph wrote main_grad itself
                    main_grad(param).add_(grad)
                    param.grad = None
            notify()

        return hook

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
        buckets = self.buckets
        while self._next_dispatch < len(buckets) and buckets[self._next_dispatch].complete:
            bucket = buckets[self._next_dispatch]
            self._next_dispatch += 1
            self.dispatch_log.append(bucket.index)
            if self._comm_stream is None:
                bucket.dispatch(self.group, self.world_size, self.options.average)
                continue
            with torch.cuda.stream(self._comm_stream):
                for stream in self._grad_streams:
                    self._comm_stream.wait_stream(stream)
                bucket.dispatch(self.group, self.world_size, self.options.average)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate into ``main_grad`` without counting or communicating (gradient accumulation)."""
        old = self.sync_enabled
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = old

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
        self._refuse_unfrozen()
        if self.unused is not None and self.golden_known:
            for b in self.buckets:
                b.settle_absent()
        missing = [(p, b) for b in self.buckets for p in b.missing()]
        self._agree(missing)
        if not self.golden_known:
            for b in self.buckets:
                b.set_golden()
            self.golden_known = True
            self._check_golden_across_ranks()
        self.dispatch_ready_prefix()  # what the backward did not (first iteration, absent parameters)
        for b in self.buckets:
            b.wait()
            b.reset()
        if self.unused is not None:
            self.unused.window_synchronized(self.group, self.world_size if self.distributed else 1,
                                            self.buffers_[0].data.device if self.buffers_ else torch.device("cpu"))
        self._next_dispatch = 0
        self.iteration += 1
        self.last_dispatch_order = self.dispatch_log
        self.dispatch_log = []

    def _refuse_unfrozen(self) -> None:
        unfrozen = [p for p in self._frozen if p.requires_grad]
        if unfrozen:
            names = ", ".join(n for n, p in self.module.named_parameters() if any(p is q for q in unfrozen))
            raise GradSyncError(
                f"rank {self.rank}: parameters frozen when training started now require grad ({names}). The "
                "engine sized its gradient buffers and hooks at setup, so their gradients would be neither "
                "reduced across ranks nor checked. Unfreeze before Trainer.fit (or start a new fit after "
                "unfreezing)."
            )

    def _describe(self, missing) -> List[str]:
        out = []
        for p, b in missing:
            slot = b.slot_of[p]
            golden = "unknown (first iteration)" if b.slot_golden is None else b.slot_golden[slot]
            out.append(f"{self.names.get(p, '?')} (ready {b.slot_counts[slot]} times, expected {golden})")
        return out

    def _cast_since_setup(self) -> str:
        """A sentence naming parameters whose dtype or device changed after setup ('' if none)."""
        changed = [(p, was) for p, was in zip(self.params, self._setup_types) if (p.dtype, p.device) != was]
        if not changed:
            return ""
        what = ", ".join(f"{self.names.get(p, '?')} ({was[0]} on {was[1]} -> {p.dtype} on {p.device})"
                         for p, was in changed[:3])
        return (
            f"{len(changed)} parameter(s) changed dtype or device after the engine was set up ({what}"
            f"{', ...' if len(changed) > 3 else ''}): that replaces their gradient accumulators and drops the "
            "engine's grad-ready hooks. Cast or move the model before Trainer.fit (or use the Trainer's "
            "precision setting), not in a hook during training. "
        )

    def _none_reached(self, missing) -> str:
        """A sentence for a backward that reached no parameter of this model at all ('' otherwise)."""
        if len(missing) < len(self.params) or any(b.slot_counts[b.slot_of[p]] for p, b in missing):
            return ""
        return (
            f"No parameter of this model ({type(self.module).__name__}) got a gradient although it ran a forward "
            "for this backward: its output did not reach the loss (detached, or used only for another loss, as a "
            "GAN generator's output in the discriminator's step). Run such a forward under torch.no_grad(), or "
            "backward through it. "
        )

    def _agree(self, missing) -> None:
        local = self._describe(missing)
        if self._control_group is None:
            if local:
                raise GradSyncError(
                    f"rank {self.rank}: gradients of these parameters of {type(self.module).__name__} did not "
                    f"report ready as expected in iteration {self.iteration}: {', '.join(local)}. "
                    f"{self._none_reached(missing)}{self._cast_since_setup()}{_CAUSES}"
                )
            return
        flag = torch.tensor([len(local)], dtype=torch.int64)
        try:
            dist.all_reduce(flag, group=self._control_group)
        except Exception as exc:  # another rank died or hangs
            raise GradSyncError(
                f"rank {self.rank}: another rank did not reach the end of the backward within "
                f"{self.options.timeout_s:.0f} s (iteration {self.iteration}); it probably failed earlier. "
                f"Cause: {exc}"
            ) from exc
        if int(flag.item()) == 0:
            return
        reports: List[Optional[List[str]]] = [None] * self.world_size
        dist.all_gather_object(reports, local, group=self._control_group)
        lines = [f"rank {r}: {', '.join(rep)}" for r, rep in enumerate(reports) if rep]
        raise GradSyncError(
            f"gradients of parameters of {type(self.module).__name__} did not report ready as expected in "
            f"iteration {self.iteration} (seen on rank {self.rank}):\n  " + "\n  ".join(lines)
            + f"\n{self._none_reached(missing)}{self._cast_since_setup()}{_CAUSES}"
        )

    def _check_golden_across_ranks(self) -> None:
        if self._control_group is None:
            return
        mine = [g for b in self.buckets for g in b.slot_golden]
        reports: List[Optional[List[int]]] = [None] * self.world_size
        dist.all_gather_object(reports, mine, group=self._control_group)
        # find_unused: a parameter absent on a rank (0) agrees with any count
        seen = [{rep[i] for rep in reports} - ({0} if self.unused is not None else set()) for i in range(len(mine))]
        if any(len(s) > 1 for s in seen):
            names = [self.names.get(p, "?") for b in self.buckets for p in b.params]
            diffs = [
                f"{n}: " + ", ".join(f"rank {r}={rep[i]}" for r, rep in enumerate(reports))
                for i, n in enumerate(names)
                if len(seen[i]) > 1
            ]
            raise GradSyncError(
                "ranks disagree on how many times parameters report ready per iteration (golden counts): "
                + "; ".join(diffs[:10])
                + ". Every rank must run the same layers the same number of times."
            )

    def close(self) -> None:
        """Remove the hooks and grad-ready notifiers; the module trains as if never wrapped."""
        for handle in self._hook_handles:
            handle.remove()
        self.grad_ready.clear()
        self._hook_handles = []
        self._grad_accs = []
        if self._control_group is not None and dist.is_initialized():
            dist.destroy_process_group(self._control_group)
        self._control_group = None

    # ----------------------------------------------------------------- optimizer glue
    def expose_grads(self) -> None:
        """Point ``param.grad`` at ``main_grad`` (a cast copy if dtypes differ) for optimizers and clipping.

        Every step; while every ``main_grad`` is still the view the engine made and has its parameter's dtype
        (the usual case), in C-level ``map`` calls rather than a Python loop over the parameters."""
        self._point_grads_at_main()
        if self.unused is not None:
            self.unused.hide_unused_grads()

    def _point_grads_at_main(self) -> None:
        params, mains = self.params, self._main_grads
        self.grads_exposed = True
        if self._main_grads_same_dtype and all(map(operator.is_, map(protocol.MAIN_GRAD, params), mains)):
            try:
                deque(map(setattr, params, repeat("grad"), mains), maxlen=0)
                return
            except RuntimeError:  # a parameter's dtype changed since setup (module.to(dtype)): cast below
                pass
        for p in params:
            g = protocol.main_grad(p)
            p.grad = g if g.dtype is p.dtype else g.to(p.dtype)

    def expose_after_backward(self, completes_step: bool) -> None:
        """:meth:`expose_grads` after a backward: always on the micro-batch that completes an optimizer step; on
        the others (the sum so far, as plain PyTorch holds it in ``param.grad``) only when ``param.grad`` is the
        ``main_grad`` tensor itself (the gradient dtype is the parameters'), so that what a user does to it
        before the next backward (clip, scale, zero, replace) can be carried back exactly by
        :meth:`take_back_grads`; a cast copy could not be."""
        if completes_step or self._main_grads_same_dtype:
            self.expose_grads()

    def take_back_grads(self) -> None:
        """Before a backward, if gradients are still exposed: make ``main_grad`` what ``param.grad`` says now,
        then drop ``param.grad``, so the backward accumulates onto what eager PyTorch would accumulate onto.

        ``param.grad`` is ``None`` (zeroed with ``set_to_none``): ``main_grad`` is zeroed; another tensor
        (replaced by the user): copied in; ``main_grad`` itself: kept, with whatever was done to it in place
        (clipping, scaling). Dropping ``param.grad`` matters: autograd would otherwise add into ``main_grad``
        in place and the engine's hook would add the same gradient again.
        """
        if not self.grads_exposed:
            return
        if all(map(operator.is_, map(_GRAD, self.params), repeat(None))):  # zero_grad(set_to_none=True)
            self.zero_grad_buffer()  # one fill a buffer instead of one a parameter
            return
        self._reattach_main_grads(keep_values=True)
        if self.unused is not None:
            self.unused.window_starts()
        with torch.no_grad():
            for p in self.params:
                g = p.grad
                main = protocol.main_grad(p)
                if g is None:
                    main.zero_()
                elif g is not main:
                    main.copy_(g)
                p.grad = None
        self.grads_exposed = False

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` and drop ``param.grad`` (after the optimizer step)."""
        for buf in self.buffers_:
            buf.zero_()
        self._reattach_main_grads(keep_values=False)
        for p in self.params:
            p.grad = None
            protocol.set_grad_added(p, False)
        self.grads_exposed = False
        if self.unused is not None:
            self.unused.window_starts(all_none=True)

    def _reattach_main_grads(self, keep_values: bool) -> None:
        """Point every ``main_grad`` back into the gradient buffer if its storage was swapped (``param.grad.data =
        x`` while ``param.grad`` is ``main_grad``), first copying its values there if ``keep_values``. Otherwise
        the buffer that graphs add into, that is all-reduced and zeroed, would no longer be the one the hooks and
        the optimizer see. One C-level pass over the data pointers in the usual case."""
        if list(map(_DATA_PTR, self._main_grads)) == self._buffer_ptrs:
            return
        with torch.no_grad():
            for main, view in zip(self._main_grads, self._buffer_views):
                if main.data_ptr() != view.data_ptr():
                    if keep_values:
                        view.copy_(main)
                    main.data = view

    def _broadcast_states(self) -> None:
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t.data, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group)

