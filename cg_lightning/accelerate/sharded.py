"""``ddp.distributed_optimizer`` under ``CUDAGraphAccelerator``: clipping by the norm over every rank's shard, the
parameters' all-gather waited for on request, and ``save_state`` refused (each rank holds its own shard of the
optimizer state, where Accelerate saves rank 0's)."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from ..optim.sharded_optimizer import clip_grad_norm_


class ShardedOptimizerMixin:
    """The accelerator's part in ``ddp.distributed_optimizer`` (see the module docstring). Expects the
    accelerator's ``_graph_engines`` and ``_optimizers``."""

    @override
    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Accelerate's ``clip_grad_norm_``; under ``ddp.distributed_optimizer`` the norm is taken over every rank's
        shard of the gradients (:func:`cg_lightning.optim.sharded_optimizer.clip_grad_norm_`), for parameters that
        make up whole prepared optimizers of one engine.

        Raises:
            ValueError: the parameters cover part of a sharded optimizer's parameters, or several engines.
        """
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        sharded = self._sharded_optimizers(parameters)
        if not sharded:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        return clip_grad_norm_(sharded, max_norm, norm_type)

    def _sharded_optimizers(self, parameters) -> list:
        ids = {id(p) for p in parameters}
        engines = [e for e in self._graph_engines if e.shards is not None and any(id(p) in ids for p in e.params)]
        if not engines:
            return []
        sharded = [s for s in (engines[0].driver.sharded_optimizer(o.optimizer) for o in self._optimizers) if s]
        wanted = {id(p) for e in engines for p in e.params if id(p) in ids}
        if len(engines) > 1 or wanted != {id(p) for s in sharded for p in s.params}:
            raise ValueError("cg_lightning: under ddp.distributed_optimizer, clip_grad_norm_ takes the parameters of "
                             "whole prepared optimizers of one model (model.parameters()): the norm is summed over "
                             "the ranks' shards of those optimizers' gradients.")
        return sharded

    def wait_for_params(self) -> None:
        """Wait for the parameters' all-gathers still running after a sharded step (``ddp.distributed_optimizer``
        with ``ddp.overlap_param_gather``): call it before reading parameter values between ``optimizer.step()``
        and the next forward other than through ``state_dict()`` (an EMA update). Nothing to do otherwise."""
        for engine in self._graph_engines:
            engine.wait_for_params()

    @override
    def save_state(self, *args: Any, **kwargs: Any):
        """Accelerate's ``save_state``; refused under ``ddp.distributed_optimizer``.

        Raises:
            ValueError: with ``ddp.distributed_optimizer`` (Accelerate saves rank 0's optimizer state only, where each
                rank holds its own shard: save ``optimizer.state_dict()`` on every rank instead).
        """
        if any(e.shards is not None for e in self._graph_engines):
            raise ValueError("cg_lightning: accelerator.save_state does not save ddp.distributed_optimizer's state "
                             "(Accelerate writes rank 0's optimizer state only; each rank holds its own shard). Save "
                             "optimizer.state_dict() on every rank (torch.save to a file per rank) and load the list "
                             "of every rank's shards with optimizer.load_state_dict([...]) at any world size.")
        return super().save_state(*args, **kwargs)
