"""Options of the data-parallel engine (one dataclass, also used as the YAML schema node)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GRAD_DTYPES = (None, "float32", "bfloat16", "float16")


@dataclass
class DDPOptions:
    """How gradients are bucketed and reduced.

    Attributes:
        bucket_size_mb: bucket capacity in MiB of gradient memory; a parameter never spans two buckets.
        average: divide the all-reduced gradient by the world size (torch DDP's behaviour); ``False`` sums.
        grad_dtype: dtype of ``main_grad`` (``"float32"``, ``"bfloat16"``, ``"float16"``); ``None`` keeps
            each parameter's dtype.
        timeout_s: seconds a rank waits for the others in the grad-ready agreement before it raises.
        check_grad_ready: before waiting on the buckets, agree across ranks (a tiny all-reduce on a CPU
            group) that every parameter reported ready, so a missing gradient is an error on every rank
            instead of a hang. One small collective per step; only used when world size > 1.
        broadcast_buffers: copy the module's buffers (BatchNorm running statistics, ...) from rank 0 to
            every rank, in place, at the start of a forward, on the schedule of torch DDP's option of the
            same name: before the first forward and before every forward that follows a forward run with
            grad enabled and gradient sync on (so once per optimizer step under gradient accumulation,
            and not right after a validation forward). Only used when world size > 1.

    Raises:
        ValueError: on a non-positive bucket size or timeout, or an unknown grad dtype.
    """

    bucket_size_mb: float = 25.0
    average: bool = True
    grad_dtype: Optional[str] = None
    timeout_s: float = 300.0
    check_grad_ready: bool = True
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        if self.bucket_size_mb <= 0:
            raise ValueError(f"ddp.bucket_size_mb must be > 0, got {self.bucket_size_mb}")
        if self.timeout_s <= 0:
            raise ValueError(f"ddp.timeout_s must be > 0, got {self.timeout_s}")
        if self.grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"ddp.grad_dtype must be one of {GRAD_DTYPES}, got {self.grad_dtype!r}")
