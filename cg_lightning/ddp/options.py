"""Options of the data-parallel engine (one dataclass, also used as the YAML schema node)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GRAD_DTYPES = (None, "float32", "bfloat16", "float16")


@dataclass
class DDPOptions:
    """How gradients are bucketed and reduced.

    One line per field below; ``docs/options.md`` is generated from those lines.

    Raises:
        ValueError: on a non-positive bucket size or timeout, or an unknown grad dtype.
    """

    bucket_size_mb: float = 25.0
    """Bucket capacity in MiB of gradient memory; a parameter never spans two buckets."""

    average: bool = True
    """Divide the all-reduced gradient by the world size, as torch DDP does; ``False`` sums."""

    grad_dtype: Optional[str] = None
    """dtype of ``main_grad``: ``"float32"``, ``"bfloat16"``, ``"float16"``; ``None`` keeps each parameter's."""

    timeout_s: float = 300.0
    """Seconds a rank waits for the others in the grad-ready agreement before it raises."""

    check_grad_ready: bool = True
    """Agree across ranks that every parameter reported ready, so a missing gradient is an error, not a hang."""

    broadcast_buffers: bool = True
    """Copy module buffers (BatchNorm statistics) from rank 0 before a training forward, as torch DDP does."""

    find_unused_parameters: bool = False
    """Allow parameters without a gradient in a backward (ready with zero contribution), as torch DDP's option."""

    def __post_init__(self) -> None:
        if self.bucket_size_mb <= 0:
            raise ValueError(f"ddp.bucket_size_mb must be > 0, got {self.bucket_size_mb}")
        if self.timeout_s <= 0:
            raise ValueError(f"ddp.timeout_s must be > 0, got {self.timeout_s}")
        if self.grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"ddp.grad_dtype must be one of {GRAD_DTYPES}, got {self.grad_dtype!r}")
