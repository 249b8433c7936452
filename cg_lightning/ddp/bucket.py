"""A bucket: a contiguous slice of a gradient buffer, all-reduced once all its parameters are ready."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist


class Bucket:
    """Parameters whose ``main_grad`` views share one contiguous slice ``data`` (1-D).

    ``counts`` holds this iteration's grad-ready count per parameter; ``golden`` the counts of the first
    iteration. Once ``golden`` is known, the bucket is ready when ``counts == golden``.
    """

    def __init__(self, index: int, params: List[torch.nn.Parameter], data: torch.Tensor) -> None:
        self.index = index
        self.params = params
        self.data = data
        self.counts: Dict[torch.nn.Parameter, int] = {p: 0 for p in params}
        self.golden: Optional[Dict[torch.nn.Parameter, int]] = None
        self.last_counts: Dict[torch.nn.Parameter, int] = dict(self.counts)
        self.pending = len(params)  # parameters whose count is still below golden
        self.overshoot = False  # some parameter reported more often than its golden count
        self.handle = None
        self.dispatched = False

    def register_ready(self, param: torch.nn.Parameter) -> bool:
        """Count one grad-ready occurrence; True when the bucket just became complete."""
        count = self.counts[param] + 1
        self.counts[param] = count
        if self.golden is not None:
            golden = self.golden[param]
            if count == golden:
                self.pending -= 1
                return self.pending == 0
            if count > golden:
                self.overshoot = True
        return False

    @property
    def complete(self) -> bool:
        """Every parameter reached its golden count (never true before the golden counts are known)."""
        return self.golden is not None and self.pending == 0

    def set_golden(self) -> None:
        """Take this iteration's counts as the golden counts (end of the first iteration)."""
        self.golden = dict(self.counts)
        self.pending = 0

    def missing(self) -> List[torch.nn.Parameter]:
        """Parameters whose count differs from the golden count (all zero-count ones before golden)."""
        if self.golden is None:
            return [p for p, c in self.counts.items() if c == 0]
        if self.pending == 0 and not self.overshoot:  # the usual case: no per-parameter scan
            return []
        return [p for p, c in self.counts.items() if c != self.golden[p]]

    def dispatch(self, group, world_size: int, average: bool) -> None:
        """Start the (asynchronous) all-reduce of ``data``; pre-divides by ``world_size`` when averaging."""
        self.dispatched = True
        if world_size == 1:
            return
        if average:
            self.data.div_(world_size)
        self.handle = dist.all_reduce(self.data, group=group, async_op=True)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def reset(self) -> None:
        """Start a new iteration; this iteration's counts stay readable as ``last_counts``."""
        self.last_counts = self.counts
        self.counts = dict.fromkeys(self.params, 0)
        self.overshoot = False
        self.pending = len(self.params)
        self.dispatched = False
