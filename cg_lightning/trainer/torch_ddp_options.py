"""torch ``DistributedDataParallel`` keyword arguments given to the strategy, mapped onto the engine's options.

``Trainer(strategy=CUDAGraphDDPStrategy(find_unused_parameters=True))`` and the other arguments a ``"ddp"``
user passes keep their meaning: each is either honoured through a :class:`~cg_lightning.ddp.DDPOptions` field,
accepted because the engine always behaves that way, or refused with the reason.

========================  ==========================================================================
argument                  here
========================  ==========================================================================
find_unused_parameters    ``ddp.find_unused_parameters``
bucket_cap_mb             ``ddp.bucket_size_mb``
broadcast_buffers         ``ddp.broadcast_buffers``
static_graph              accepted: the engine learns each parameter's ready count in the first step
gradient_as_bucket_view   accepted: ``main_grad`` is always a view into the bucket
init_sync=True            accepted: parameters and buffers are broadcast from rank 0 at setup
others                    refused, naming the argument and why (communication hooks, post-local SGD, ...)
========================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Tuple

from ..ddp import DDPOptions

#: torch DDP argument -> DDPOptions field
_MAPPED = {"find_unused_parameters": "find_unused_parameters", "bucket_cap_mb": "bucket_size_mb",
           "broadcast_buffers": "broadcast_buffers"}
#: accepted with any bool: the engine behaves so regardless
_NO_EFFECT = ("static_graph", "gradient_as_bucket_view")
_REFUSED = {
    "ddp_comm_hook": "the engine all-reduces its own main_grad buckets, so torch DDP communication hooks "
                     "(compression, PowerSGD) have nothing to run on; for lower-precision gradients set "
                     "ddp={'grad_dtype': 'bfloat16'}",
    "ddp_comm_state": "it belongs to ddp_comm_hook, which this engine does not run",
    "ddp_comm_wrapper": "it belongs to ddp_comm_hook, which this engine does not run",
    "model_averaging_period": "post-local SGD averages models through a torch DDP communication hook, which "
                              "this engine does not run",
    "init_sync": "the engine always broadcasts parameters and buffers from rank 0 at setup (init_sync=True)",
}
#: the strategy's own arguments, passed on to Lightning's DDPStrategy
LIGHTNING_ARGS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
                  "process_group_backend", "timeout", "start_method")


def split_torch_ddp_kwargs(kwargs: Dict[str, Any], ddp: DDPOptions) -> Tuple[Dict[str, Any], DDPOptions]:
    """Split ``kwargs`` given to the strategy into Lightning's own and the torch-DDP ones, the latter applied to
    ``ddp``.

    Returns:
        ``(lightning_kwargs, ddp_options)``: the arguments for Lightning's ``DDPStrategy``, and ``ddp`` with
        the mapped fields replaced (a new object when any was given).

    Raises:
        ValueError: a torch-DDP argument the engine cannot honour (the message says why), ``init_sync=False``,
            a mapped argument that contradicts the same field set in ``ddp=`` to another value, or an argument
            that is neither Lightning's nor torch DDP's.
    """
    lightning: Dict[str, Any] = {}
    changes: Dict[str, Any] = {}
    problems = []
    defaults = DDPOptions()
    for key, value in kwargs.items():
        if key in LIGHTNING_ARGS:
            lightning[key] = value
        elif key in _MAPPED:
            field = _MAPPED[key]
            current = getattr(ddp, field)
            if current != getattr(defaults, field) and current != value:
                problems.append(f"{key}={value!r} contradicts ddp.{field}={current!r}; give one of them")
            changes[field] = value
        elif key in _NO_EFFECT or (key == "init_sync" and value is True) or (key in _REFUSED and value is None):
            continue
        elif key in _REFUSED:
            problems.append(f"{key}={value!r} cannot be honoured: {_REFUSED[key]}")
        else:
            problems.append(f"{key}={value!r} is not an argument of Lightning's DDPStrategy or one of the torch "
                            f"DistributedDataParallel options this engine maps ({', '.join(sorted(_MAPPED))}, "
                            f"{', '.join(_NO_EFFECT)})")
    if problems:
        raise ValueError("CUDAGraphDDPStrategy: " + "; ".join(problems))
    return lightning, (dataclasses.replace(ddp, **changes) if changes else ddp)
