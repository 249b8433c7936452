"""Options of the data-parallel engine (one dataclass, also used as the YAML schema node)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..option_checks import above, at_most, check_options, one_of

GRAD_DTYPES = (None, "float32", "bfloat16", "float16")


@dataclass
class DDPOptions:
    """How gradients are bucketed and reduced.

    One line per field below; ``docs/options.md`` is generated from those lines.

    Raises:
        TypeError: a value of the wrong type.
        ValueError: a bucket size or timeout that is not positive and finite (or above 1 TiB / 10^7 s), an unknown
            grad dtype, ``distributed_optimizer`` with ``find_unused_parameters``. Both name the option
            (``ddp.bucket_size_mb``), the value given and what is accepted.
    """

    bucket_size_mb: float = field(default=25.0, metadata={**above(0), **at_most(2**20)})
    """Bucket capacity in MiB of gradient memory; a parameter never spans two buckets."""

    average: bool = True
    """Divide the all-reduced gradient by the world size, as torch DDP does; ``False`` sums."""

    grad_dtype: Optional[str] = field(default=None, metadata=one_of(GRAD_DTYPES))
    """dtype of ``main_grad``: ``"float32"``, ``"bfloat16"``, ``"float16"``; ``None`` keeps each parameter's."""

    timeout_s: float = field(default=300.0, metadata={**above(0), **at_most(10**7)})
    """Seconds any collective waits for the other ranks from the first training step on, before ``PeerLostError``."""

    check_grad_ready: bool = True
    """Agree across ranks that every parameter reported ready, so a missing gradient is an error, not a hang."""

    broadcast_buffers: bool = True
    """Copy module buffers (BatchNorm statistics) from rank 0 before a training forward, as torch DDP does."""

    find_unused_parameters: bool = False
    """Allow parameters without a gradient in a backward (ready with zero contribution), as torch DDP's option."""

    distributed_optimizer: bool = False
    """Reduce-scatter buckets; each rank keeps optimizer state (and fp32 master weights) of its shard only."""

    overlap_param_gather: bool = True
    """With ``distributed_optimizer``: all-gather the updated parameters during the next forward, not at the step."""

    def __post_init__(self) -> None:
        check_options(self, "ddp")
        if self.distributed_optimizer and self.find_unused_parameters:
            raise ValueError(
                "ddp.distributed_optimizer and ddp.find_unused_parameters cannot be combined: the sharded step updates "
                "every element of its shard, while find_unused_parameters leaves parameters without a gradient "
                "untouched. Turn one of them off."
            )
