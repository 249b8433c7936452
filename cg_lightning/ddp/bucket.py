"""A bucket: a contiguous slice of a gradient buffer, all-reduced once all its parameters are ready."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist


class Bucket:
    """Parameters whose ``main_grad`` views share one contiguous slice ``data`` (1-D).

    Grad-ready counts live in plain lists indexed by a parameter's *slot* (its position in ``params``),
    so the hook of every gradient does one list update and no hashing (``Tensor.__hash__`` is a Python
    call). ``counts``, ``golden`` and ``last_counts`` give the same numbers by parameter, built on access.
    Once the golden counts (those of the first iteration) are known, the bucket is ready when every
    parameter's count equals its golden count.

    With ``absent_ok`` (``DDPOptions.find_unused_parameters``) a parameter may get no gradient in an iteration:
    a golden count of 0 means "not seen yet" and is learned from the first iteration that reports it; a bucket
    with an absent parameter completes only in :meth:`settle_absent`, after the backward, where the absent
    parameters count as ready with a zero contribution (torch DDP's ``find_unused_parameters=True``).
    ``slot_used`` records which parameters reported since the last :meth:`clear_used`, with or without sync.
    """

    def __init__(self, index: int, params: List[torch.nn.Parameter], data: torch.Tensor) -> None:
        self.index = index
        self.absent_ok = False
        self.slot_used: Optional[List[bool]] = None
        self.params = params
        self.data = data
        self.slot_of: Dict[torch.nn.Parameter, int] = {p: i for i, p in enumerate(params)}  # setup-time lookups
        self.slot_counts: List[int] = [0] * len(params)
        self.slot_golden: Optional[List[int]] = None
        self.slot_last: List[int] = [0] * len(params)
        self.pending = len(params)  # parameters whose count is still below golden
        self.overshoot = False  # some parameter reported more often than its golden count
        self.handle = None
        self.dispatched = False
        #: ``ddp.distributed_optimizer``: called as ``reduce(data, group)`` in place of the all-reduce (a
        #: reduce-scatter into this rank's shard of ``data``); returns the collective's handle (:mod:`.shards`)
        self.reduce: Optional[Callable] = None

    # by parameter (reports and tests; built on access)
    @property
    def counts(self) -> Dict[torch.nn.Parameter, int]:
        """This iteration's grad-ready count per parameter."""
        return dict(zip(self.params, self.slot_counts))

    @property
    def golden(self) -> Optional[Dict[torch.nn.Parameter, int]]:
        """The first iteration's counts per parameter, ``None`` before they are known."""
        return None if self.slot_golden is None else dict(zip(self.params, self.slot_golden))

    @property
    def last_counts(self) -> Dict[torch.nn.Parameter, int]:
        """The counts of the last finished iteration, per parameter."""
        return dict(zip(self.params, self.slot_last))

    def register_ready(self, slot: int) -> bool:
        """Count one grad-ready occurrence of ``params[slot]``; True when the bucket just became complete."""
        counts = self.slot_counts
        count = counts[slot] + 1
        counts[slot] = count
        golden = self.slot_golden
        if golden is not None:
            expected = golden[slot]
            if count == expected:
                self.pending -= 1
                return self.pending == 0
            if count > expected and (expected or not self.absent_ok):  # absent_ok: 0 is "not seen yet"
                self.overshoot = True
        return False

    def register_many(self, slots: Sequence[int]) -> bool:
        """:meth:`register_ready` for each of ``slots`` in turn (a graph replay's reports, counted in one call);
        True when the bucket became complete during them."""
        counts = self.slot_counts
        golden = self.slot_golden
        if golden is None:
            for slot in slots:
                counts[slot] += 1
            return False
        became = False
        for slot in slots:
            count = counts[slot] + 1
            counts[slot] = count
            expected = golden[slot]
            if count == expected:
                self.pending -= 1
                became = self.pending == 0
            elif count > expected and (expected or not self.absent_ok):
                self.overshoot = True
        return became

    @property
    def complete(self) -> bool:
        """Every parameter reached its golden count (never true before the golden counts are known)."""
        return self.slot_golden is not None and self.pending == 0

    def set_golden(self) -> None:
        """Take this iteration's counts as the golden counts (end of the first iteration)."""
        self.slot_golden = list(self.slot_counts)
        self.pending = 0

    def allow_absent(self) -> None:
        """Switch on ``absent_ok`` (before the first iteration)."""
        self.absent_ok = True
        self.slot_used = [False] * len(self.params)

    def settle_absent(self) -> None:
        """``absent_ok``, after the backward: learn the golden count of parameters reporting for the first time;
        parameters with no report count as ready (their ``main_grad`` gets nothing from this iteration). The
        bucket is then complete unless a parameter reported a number of times other than its golden count."""
        golden, counts = self.slot_golden, self.slot_counts
        pending, overshoot = 0, False
        for slot, count in enumerate(counts):
            if count == 0:
                continue
            if golden[slot] == 0:
                golden[slot] = count
            elif count < golden[slot]:
                pending += 1
            elif count > golden[slot]:
                overshoot = True
        self.pending, self.overshoot = pending, overshoot

    def clear_used(self) -> None:
        """Start a new window of :attr:`slot_used` (after a synchronized backward)."""
        if self.slot_used is not None:
            self.slot_used = [False] * len(self.params)

    def missing(self) -> List[torch.nn.Parameter]:
        """Parameters whose count differs from the golden count (all zero-count ones before golden). With
        ``absent_ok``, after :meth:`settle_absent`: those with a count that is neither 0 nor the golden one."""
        if self.absent_ok:
            if self.slot_golden is None or (self.pending == 0 and not self.overshoot):
                return []
            return [p for p, c, g in zip(self.params, self.slot_counts, self.slot_golden) if c and c != g]
        if self.slot_golden is None:
            return [p for p, c in zip(self.params, self.slot_counts) if c == 0]
        if self.pending == 0 and not self.overshoot:  # the usual case: no per-parameter scan
            return []
        return [p for p, c, g in zip(self.params, self.slot_counts, self.slot_golden) if c != g]

    def dispatch(self, group, world_size: int, average: bool) -> None:
        """Start the (asynchronous) all-reduce of ``data`` (or :attr:`reduce`); pre-divides by ``world_size`` when
        averaging."""
        self.dispatched = True
        if world_size == 1:
            return
        if average:
            self.data.div_(world_size)
        if self.reduce is not None:
            self.handle = self.reduce(self.data, group)
            return
        self.handle = dist.all_reduce(self.data, group=group, async_op=True)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def reset(self) -> None:
        """Start a new iteration; this iteration's counts stay readable as ``last_counts``."""
        self.slot_last = self.slot_counts
        self.slot_counts = [0] * len(self.params)
        self.overshoot = False
        self.pending = len(self.params)
        self.dispatched = False
