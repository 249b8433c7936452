"""``ddp.distributed_optimizer`` under Lightning Fabric.

* ``fabric.setup(model, optimizer)``: the optimizer gets its sharded step (each rank updates its shard of the
  parameters and all-gathers them: :mod:`cg_lightning.optim.sharded_optimizer`), made before any state is loaded;
  ``optimizer.step()`` runs it.
* ``fabric.clip_gradients(model, optimizer, max_norm=...)``: the norm over every rank's shard of the gradients (a
  rank reduces only its shard); clipping by value is elementwise and unchanged.
* ``fabric.save(path, {"optimizer": optimizer, ...})``: rank 0 writes the file as Fabric does, with a small
  descriptor in place of each sharded optimizer's state, and every rank writes its shard to
  ``<path>.optim/rank<r>-of-<N>.pt`` (:mod:`cg_lightning.optim.sharded_files`). ``fabric.load`` reads this rank's
  shard back at the same world size, or every saved shard at another one (cut to the ranges each rank owns now);
  ``cg_lightning.distributed_optimizer.consolidate(path)`` joins them for Fabric's ``"ddp"``.
* With ``ddp.overlap_param_gather`` the parameters' all-gather after a step runs on into the next forward; the
  strategy waits for it before a save or load, before ``state_dict()`` of a set-up model and at teardown. Code of
  the script that reads parameter values between ``optimizer.step()`` and the next forward (an EMA) calls
  ``fabric.strategy.wait_for_params()`` first.
* A checkpoint with shards loaded by this strategy without the distributed optimizer gets them joined into a full
  optimizer state.

Refused: ``16-mixed`` precision (its ``GradScaler`` checks every element of every gradient, of which a rank reduces
only its shard), a ``filter`` on a sharded optimizer's key in ``fabric.save``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from ..lifecycle import GraphedDataParallel
from ..optim.sharded_files import load_shards, save_shards
from ..optim.sharded_optimizer import clip_grad_norm_
from ..optim.step_graph import step_replaced


class ShardedOptimizerMixin:
    """The Fabric strategy's part of ``ddp.distributed_optimizer`` (see the module docstring); a base before Fabric's
    ``DDPStrategy`` in the method order. Reads the strategy's ``_engines`` and ``precision``."""

    _engines: List[GraphedDataParallel]

    def _sharded_of(self, optimizer: Any):
        """The sharded step of ``optimizer`` (a torch optimizer or Fabric's wrapper of one), or ``None``."""
        if not isinstance(optimizer, Optimizer):
            return None
        raw = getattr(optimizer, "optimizer", optimizer)  # Fabric's _FabricOptimizer holds the user's optimizer
        for engine in self._engines:
            if engine.shards is not None:
                sharded = engine.driver.sharded_optimizer(raw)
                if sharded is not None:
                    return sharded
        return None

    def wait_for_params(self) -> None:
        """Wait for the parameters' all-gathers still running after a sharded step (``ddp.overlap_param_gather``):
        call it before reading parameter values between ``optimizer.step()`` and the next forward. Nothing to do
        otherwise."""
        for engine in self._engines:
            engine.wait_for_params()

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Fabric's; under ``ddp.distributed_optimizer`` the optimizer of a set-up model gets its sharded step.

        Raises:
            ValueError: under ``16-mixed`` precision, or for an optimizer that cannot be sharded (not elementwise,
                or over parameters of no set-up model).
        """
        optimizer = super().setup_optimizer(optimizer)
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for engine in self._engines:
            if engine.shards is None or not any(id(p) in ids for p in engine.params):
                continue
            if getattr(self.precision, "scaler", None) is not None:
                raise ValueError("cg_lightning: ddp.distributed_optimizer does not support 16-mixed precision (its "
                                 "GradScaler checks every element of every gradient, of which a rank reduces only "
                                 "its shard); use bf16-mixed or bf16-true.")
            engine.driver.shard_optimizer(optimizer)
        return optimizer

    def _sharded_step(self, optimizer: Any):
        """A block within which ``optimizer.step()`` is its sharded step (a no-op block without one)."""
        sharded = self._sharded_of(optimizer)
        return step_replaced(optimizer, sharded.step) if sharded is not None else contextlib.nullcontext()

    @override
    def clip_gradients_norm(self, module: Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        """Fabric's; for a sharded optimizer the norm over every rank's shard of its gradients (a collective)."""
        sharded = self._sharded_of(optimizer)
        if sharded is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        return clip_grad_norm_([sharded], max_norm, norm_type, error_if_nonfinite)

    @override
    def get_module_state_dict(self, module: Module) -> Dict[str, Any]:
        self.wait_for_params()
        return super().get_module_state_dict(module)

    @override
    def save_checkpoint(self, path: Any, state: Dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """Fabric's save; first every rank writes the shards of its sharded optimizers beside the file.

        Raises:
            ValueError: ``filter`` names a sharded optimizer's key (a shard is saved whole).
        """
        self.wait_for_params()
        sharded = [k for k, obj in state.items() if self._sharded_of(obj) is not None]
        refused = sorted(set(sharded) & set(filter or {}))
        if refused:
            raise ValueError(f"cg_lightning: fabric.save(filter=...) on {', '.join(refused)}: under "
                             "ddp.distributed_optimizer each rank saves its optimizer shard whole; drop the filter "
                             "for the optimizer.")
        if sharded:
            shards = save_shards({k: state[k].state_dict() for k in sharded}, path, self.global_rank,
                                 self.world_size, lambda obj, p: self.checkpoint_io.save_checkpoint(obj, p))
            state = {**state, **shards}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Fabric's load; the optimizers in ``state`` get their state read as :func:`load_shards` resolves it: a
        sharded one its shard (or every saved shard, at another world size), any other the saved shards joined.

        Raises:
            KeyError: ``strict`` and an optimizer's key is not in the checkpoint.
            FileNotFoundError: a shard file is missing (copy the ``.optim`` folder with the checkpoint file).
        """
        self.wait_for_params()
        optimizers = [k for k, obj in state.items() if isinstance(obj, Optimizer)] if isinstance(state, dict) else []
        if not optimizers:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        rest = {k: v for k, v in state.items() if k not in optimizers}
        remainder = super().load_checkpoint(path, rest or None, strict=strict, weights_only=weights_only)
        state.update(rest)  # the plain values Fabric restored into the copy
        missing = [k for k in optimizers if k not in remainder]
        if missing and strict:
            raise KeyError(f"cg_lightning: the checkpoint {path} has no {', '.join(missing)} to load the optimizer "
                           f"state from (its keys: {sorted(remainder)}); pass strict=False to skip it.")
        read = lambda p: self.checkpoint_io.load_checkpoint(p, weights_only=weights_only)  # noqa: E731
        for sharded in (True, False):
            found = {k: remainder.pop(k) for k in optimizers
                     if k in remainder and (self._sharded_of(state[k]) is not None) == sharded}
            for k, value in load_shards(found, path, self.global_rank, self.world_size, sharded, read).items():
                state[k].load_state_dict(value)
        return remainder
