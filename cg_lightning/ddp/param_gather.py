"""The all-gather of the updated parameters after a sharded step, overlapped with the next forward.

After the step of ``ddp.distributed_optimizer`` a rank holds the new values of its own shard only; one in-place
all-gather per bucket (:meth:`.shards.ShardLayout.start_gather`) brings it the other ranks'. With
``ddp.overlap_param_gather`` :meth:`ParamGather.start` starts every bucket's all-gather, asynchronously, in the
order the next forward needs the buckets (the buffers hold the parameters in reverse, so the forward needs the last
bucket first), and returns; each bucket is waited for just before its parameters are first read:

* by a forward pre-hook on every module outside the graphed layers that holds bucket parameters itself (the
  parameters it holds; registered once by :meth:`ParamGather.install`, first among its pre-hooks, and doing nothing
  when no gather is pending);
* through :meth:`ParamGather.wait_module`, which the graph manager calls before a graphed layer's call reads its
  parameters (every member of a segment at the segment's launch, every layer before a capture): a hook inside a
  graphed layer would run at capture only;
* by :meth:`ParamGather.wait_all` wherever anything else may read or write the parameters: the next step, a
  ``state_dict`` or ``load_state_dict`` of any module that holds parameters (hooks), the backward, and the points
  the front-ends name (validation, checkpoints, clipping, the end of training).

A bucket whose parameters no hook or graphed call covered between the engine's set-up and the first gather (a
weight read by a module other than the one that holds it, which never runs) is waited for at the step instead,
from then on. The order the all-gathers are issued in depends only on the model, the same on every rank; what is
waited for where is each rank's own affair. On CUDA ``wait()`` of an NCCL collective makes the current stream wait
for it, without a host synchronization: the eager kernels and graph replays after it, on that stream, see the
gathered values.

The idea is Megatron-LM's distributed optimizer with ``overlap_param_gather`` (``megatron/core/distributed/
distributed_data_parallel.py``: a forward pre-hook per module finishes its buckets' parameter all-gather).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch.nn as nn

from .shards import ShardLayout


class ParamGather:
    """Starts, tracks and waits for the per-bucket all-gathers of one :class:`~.shards.ShardLayout`.

    Args:
        layout: the engine's shard layout; its buckets are numbered as the engine's.
        params: the parameters in forward order (``module.parameters()``); ``None``: the layout's own order.
        overlap: return from :meth:`start` before the all-gathers complete (``ddp.overlap_param_gather``; only
            once :meth:`install` has put the waits in place). ``False``: :meth:`start` waits for all of them.

    Attributes:
        order: bucket indices in the order :meth:`start` issues them (the first forward use of their parameters).
        synchronous: buckets that :meth:`start` waits for (decided at the first :meth:`start`).
        observer: called as ``observer("start" | "wait", bucket)`` after each start and each wait, or ``None``.
    """

    def __init__(self, layout: ShardLayout, params: Optional[Sequence[nn.Parameter]] = None,
                 overlap: bool = True) -> None:
        self.layout = layout
        buckets = [b for buf in layout.buffers for b in buf.buckets]
        self.bucket_of: Dict[nn.Parameter, int] = {p: i for i, b in enumerate(buckets) for p in b.params}
        if params is None:  # within a buffer the parameters lie in reverse forward order
            params = [p for buf in layout.buffers for p, _ in reversed(buf.offsets)]
        position = {p: i for i, p in enumerate(params)}
        self.order: List[int] = sorted(range(len(buckets)),
                                       key=lambda i: min(position.get(p, len(position)) for p in buckets[i].params))
        self.overlap = overlap and layout.world_size > 1
        self.synchronous: Set[int] = set()
        self.observer: Optional[Callable[[str, int], None]] = None
        self.pending = 0  # gathers started and not waited for
        self._handles: List[Any] = [None] * len(buckets)
        self._seen: Optional[Set[int]] = set()  # buckets covered by a hook or graphed call before the first start
        self._installed = False
        self._hooks: List[Any] = []
        self._of_module: Dict[int, Tuple[int, ...]] = {}  # id(module) -> buckets of its parameters (recursive)

    def _buckets_of(self, params: Iterable[nn.Parameter]) -> Tuple[int, ...]:
        """The buckets holding ``params``, in :attr:`order`."""
        found = {self.bucket_of[p] for p in params if p in self.bucket_of}
        return tuple(i for i in self.order if i in found)

    # ----------------------------------------------------------------- the step
    def start(self) -> None:
        """Start every bucket's all-gather, in :attr:`order`, after waiting for those still pending; return once
        the :attr:`synchronous` buckets (every bucket without overlap or before :meth:`install`) are gathered.
        Nothing to do in one process."""
        if self.layout.world_size == 1:
            return
        self.wait_all()
        overlap = self.overlap and self._installed
        if self._seen is not None and overlap:  # the first gather: buckets no wait covers are waited for here
            self.synchronous = set(range(len(self._handles))) - self._seen
            self._seen = None
        for i in self.order:  # the same order on every rank
            self._handles[i] = self.layout.start_gather(i)
            self.pending += 1
            if self.observer is not None:
                self.observer("start", i)
        if not overlap:
            self.wait_all()
        elif self.synchronous:
            self.wait([i for i in self.order if i in self.synchronous])

    def is_pending(self, bucket: int) -> bool:
        """Whether bucket ``bucket``'s all-gather was started and not waited for."""
        return self._handles[bucket] is not None

    def wait(self, buckets: Iterable[int]) -> None:
        """Wait for the pending all-gathers of ``buckets`` (indices), in turn."""
        handles = self._handles
        for i in buckets:
            handle = handles[i]
            if handle is not None:
                handles[i] = None
                self.pending -= 1
                handle.wait()
                if self.observer is not None:
                    self.observer("wait", i)

    def wait_all(self) -> None:
        """Wait for every pending all-gather (cheap when none is)."""
        if self.pending:
            self.wait(self.order)

    def wait_module(self, module: Optional[nn.Module]) -> None:
        """Before code reads ``module``'s parameters (its submodules' too): wait for their buckets; ``None``: for
        every bucket. The graph manager's callback before a graphed call (``GraphManager.bind_param_reads``)."""
        if module is None:
            self.wait_all()
            return
        buckets = self._of_module.get(id(module))
        if buckets is None:
            buckets = self._of_module[id(module)] = self._buckets_of(module.parameters())
        if self._seen is not None:
            self._seen.update(buckets)
        if self.pending:
            self.wait(buckets)

    # ----------------------------------------------------------------- hooks
    def install(self, root: nn.Module, graphed: Sequence[nn.Module] = ()) -> None:
        """Put the waits in place (once; nothing without overlap): a forward pre-hook on every module of ``root``
        outside the ``graphed`` layers (whose calls go through :meth:`wait_module`) that holds bucket parameters
        itself, and a ``state_dict`` and ``load_state_dict`` pre-hook (:meth:`wait_all`) on ``root`` and on every
        module that holds parameters."""
        if not self.overlap or self._installed:
            return
        inside = {id(m) for layer in graphed for m in layer.modules()}
        for module in root.modules():
            own = self._buckets_of(module.parameters(recurse=False))
            if own and id(module) not in inside:
                self._hooks.append(module.register_forward_pre_hook(self._pre_hook(own), prepend=True))
            if own or module is root:
                self._hooks.append(module.register_state_dict_pre_hook(self._wait_all_hook))
                self._hooks.append(module.register_load_state_dict_pre_hook(self._wait_all_hook))
        self._installed = True

    def _pre_hook(self, buckets: Tuple[int, ...]):
        def wait_for_own_params(module: nn.Module, args: tuple) -> None:
            if self._seen is not None:
                self._seen.update(buckets)
            if self.pending:
                self.wait(buckets)

        return wait_for_own_params

    def _wait_all_hook(self, *args: Any) -> None:
        self.wait_all()

    def close(self) -> None:
        """Wait for every pending all-gather and remove the hooks; :meth:`start` then waits at the step."""
        self.wait_all()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._installed = False
