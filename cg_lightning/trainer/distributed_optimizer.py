"""``ddp.distributed_optimizer`` under Lightning: sharded checkpoint files and clipping by the global norm.

Checkpoints. Every rank's ``optimizer.state_dict()`` is its own shard (:mod:`cg_lightning.optim.sharded_state`), so
``trainer.save_checkpoint(path)`` writes the checkpoint file as usual (rank 0: weights, loops, schedulers) with a
small descriptor in place of each optimizer's state, and every rank writes its shard to
``<path>.optim/rank<r>-of-<N>.pt``. Loading reads the shard of this rank when the world size is the one saved, and
every rank's shard otherwise: the state is then cut to the ranges each rank owns now (any world size). A run
without the distributed optimizer gets the shards joined into an ordinary full state
(:func:`~cg_lightning.optim.sharded_state.full_state_dict`); :func:`consolidate` does that offline, for Lightning's
``"ddp"`` or any other strategy.

Parameters. With ``ddp.overlap_param_gather`` (the default) the parameters' all-gather after a step runs on into the
next forward, each bucket waited for before its first use (:mod:`cg_lightning.ddp.param_gather`). The strategy
waits for all of them where Lightning reads parameters outside a training forward and the strategy is told:
validation, test and predict starts, checkpoint saves, the end of training; a hook or callback of the user's that
reads parameter values between the optimizer step and the next forward calls :meth:`~DistributedOptimizerMixin.
wait_for_params` first.

Clipping. Lightning clips through its precision plugin's ``clip_grad_by_norm`` over the optimizer's parameters;
under the distributed optimizer only this rank's shard of each gradient is reduced, so the plugin's method is
replaced (while the strategy is set up) by one that takes the norm over every rank's shard
(:func:`~cg_lightning.optim.sharded_optimizer.clip_grad_norm_`). Clipping by value is elementwise and unchanged.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional

import torch
from typing_extensions import override

from ..optim.sharded_optimizer import clip_grad_norm_
from ..optim.sharded_state import full_state_dict, is_shard

#: the descriptor key that stands for an optimizer's state in the checkpoint file
FILES_KEY = "sharded_optimizer_files"


def shard_dir(filepath: str) -> str:
    """The folder beside the checkpoint file ``filepath`` that holds the ranks' optimizer shards."""
    return f"{filepath}.optim"


def shard_file(filepath: str, rank: int, world_size: int) -> str:
    return os.path.join(shard_dir(filepath), f"rank{rank}-of-{world_size}.pt")


def save_shards(checkpoint: Dict[str, Any], filepath: str, rank: int, world_size: int,
                save: Callable[[Dict[str, Any], str], None]) -> Dict[str, Any]:
    """Write this rank's optimizer shards with ``save(obj, path)``; return ``checkpoint`` with descriptors in their
    place (unchanged when it holds no shard)."""
    states = checkpoint.get("optimizer_states")
    if not states or not any(is_shard(s) for s in states):
        return checkpoint
    if "://" not in str(filepath):  # a local path (a remote one is left to the saver)
        os.makedirs(shard_dir(str(filepath)), exist_ok=True)
    save({"optimizer_states": states}, shard_file(str(filepath), rank, world_size))
    descriptor = {FILES_KEY: {"world_size": world_size, "folder": os.path.basename(shard_dir(str(filepath)))}}
    return {**checkpoint, "optimizer_states": [descriptor if is_shard(s) else s for s in states]}


def load_shards(checkpoint: Dict[str, Any], filepath: str, rank: int, world_size: int, sharded: bool,
                load: Callable[[str], Dict[str, Any]]) -> Dict[str, Any]:
    """``checkpoint`` (read from ``filepath``) with each descriptor replaced by optimizer state read with
    ``load(path)``: the saved shard of this rank (``sharded`` and the same world size), the list of every saved
    rank's shard (``sharded``, another world size), or their join into a full state (not ``sharded``).

    Raises:
        FileNotFoundError: a shard file is missing (copy the ``.optim`` folder with the checkpoint file).
    """
    states = checkpoint.get("optimizer_states") or []
    descriptors = [s[FILES_KEY] for s in states if isinstance(s, dict) and FILES_KEY in s]
    if not descriptors:
        return checkpoint
    saved = descriptors[0]["world_size"]
    folder = os.path.join(os.path.dirname(str(filepath)), descriptors[0]["folder"])
    ranks = [rank] if sharded and saved == world_size else range(saved)
    files: List[List[Any]] = []
    for r in ranks:
        path = os.path.join(folder, f"rank{r}-of-{saved}.pt")
        if not os.path.exists(path):
            raise FileNotFoundError(f"cg_lightning: the optimizer shard {path} of checkpoint {filepath} is missing: a "
                                    "checkpoint saved with ddp.distributed_optimizer keeps every rank's optimizer "
                                    "state in the '.optim' folder beside it")
        files.append(load(path)["optimizer_states"])
    out = []
    for i, state in enumerate(states):
        if not (isinstance(state, dict) and FILES_KEY in state):
            out.append(state)
        elif not sharded:
            out.append(full_state_dict([f[i] for f in files]))
        else:
            out.append(files[0][i] if len(files) == 1 and saved == world_size else [f[i] for f in files])
    return {**checkpoint, "optimizer_states": out}


def consolidate(filepath: str) -> Dict[str, Any]:
    """The checkpoint at ``filepath`` with every rank's optimizer shards joined into ordinary full optimizer states:
    save it with ``torch.save`` to resume under a strategy without ``ddp.distributed_optimizer`` (CPU, offline)."""
    checkpoint = torch.load(filepath, map_location="cpu", weights_only=False)
    return load_shards(checkpoint, filepath, 0, 1, False,
                       lambda path: torch.load(path, map_location="cpu", weights_only=False))


def remove_shards(filepath: str, rank: int, world_size: int, remove: Callable[[str], None]) -> None:
    """Remove this rank's shard of the checkpoint ``filepath`` (and the folder, once empty) if there is one."""
    path = shard_file(str(filepath), rank, world_size)
    if os.path.exists(path):
        remove(path)
    try:
        os.rmdir(shard_dir(str(filepath)))
    except OSError:  # other ranks' shards still there, or no folder
        pass


class GlobalNormClipping:
    """Replaces ``precision_plugin.clip_grad_by_norm`` (an instance attribute) with clipping by the norm over every
    rank's shard for optimizers that ``sharded_of(optimizer)`` shards; :meth:`remove` puts the plugin's own back."""

    def __init__(self, precision_plugin: Any, sharded_of: Callable[[Any], Optional[Any]]) -> None:
        self.plugin = precision_plugin
        self._had = "clip_grad_by_norm" in precision_plugin.__dict__
        self._saved = precision_plugin.__dict__.get("clip_grad_by_norm")
        own = precision_plugin.clip_grad_by_norm

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            sharded = sharded_of(getattr(optimizer, "_optimizer", optimizer))
            if sharded is None:
                return own(optimizer, clip_val)
            clip_grad_norm_([sharded], clip_val)
            return None

        precision_plugin.clip_grad_by_norm = clip_grad_by_norm

    def remove(self) -> None:
        if self._had:
            self.plugin.clip_grad_by_norm = self._saved
        else:
            self.plugin.__dict__.pop("clip_grad_by_norm", None)


class DistributedOptimizerMixin:
    """The Lightning strategy's part of ``ddp.distributed_optimizer`` (a base of ``CUDAGraphDDPMixin``, before
    Lightning's ``DDPStrategy`` in the method order): after Lightning's ``setup`` made the optimizers, each one's
    sharded step (before a checkpoint's optimizer state is loaded) and :class:`GlobalNormClipping`; checkpoint files
    with the ranks' shards beside them; the waits for the parameters' all-gathers (:meth:`wait_for_params`) at
    validation, test and predict starts, checkpoint saves and the end of training. Reads the strategy's ``driver``,
    ``engine`` and ``ddp_options``.

    Raises:
        ValueError: from ``setup``: 16-mixed precision (its GradScaler checks every element of every gradient, of
            which a rank reduces only its shard), or an optimizer that cannot be sharded.
    """

    _clipping: Optional[GlobalNormClipping] = None

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        engine = getattr(self, "engine", None)
        if engine is None or engine.shards is None:
            return
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError("cg_lightning: ddp.distributed_optimizer does not support 16-mixed precision (its "
                             "GradScaler checks every element of every gradient, of which a rank reduces only its "
                             "shard); use bf16-mixed or bf16-true.")
        for optimizer in self.optimizers:
            self.driver.shard_optimizer(getattr(optimizer, "_optimizer", optimizer))
        self._clipping = GlobalNormClipping(self.precision_plugin, self.driver.sharded_optimizer)

    def wait_for_params(self) -> None:
        """Wait for the parameters' all-gathers still running after a sharded step (``ddp.overlap_param_gather``):
        call it in a hook or callback that reads parameter values between ``optimizer.step()`` and the next
        forward (an EMA in ``on_train_batch_end``). Nothing to do otherwise."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.wait_for_params()

    @override
    def on_validation_start(self) -> None:
        self.wait_for_params()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self.wait_for_params()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self.wait_for_params()
        super().on_predict_start()

    @override
    def on_train_end(self) -> None:
        self.wait_for_params()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        self.wait_for_params()
        if self._clipping is not None:
            self._clipping.remove()
            self._clipping = None
        super().teardown()

    @override
    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Lightning's save; first every rank writes its optimizer shard beside the file (:func:`save_shards`)."""
        self.wait_for_params()
        checkpoint = save_shards(checkpoint, filepath, self.global_rank, self.world_size,
                                 lambda obj, path: self.checkpoint_io.save_checkpoint(obj, path))
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """Lightning's load, with the optimizer shards saved beside the file read back (:func:`load_shards`)."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        return load_shards(checkpoint, checkpoint_path, self.global_rank, self.world_size,
                           self.ddp_options.distributed_optimizer,
                           lambda path: self.checkpoint_io.load_checkpoint(path, *args, **kwargs))

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        remove_shards(filepath, self.global_rank, self.world_size, os.remove)
