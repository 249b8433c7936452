"""``ddp.distributed_optimizer`` under Lightning: sharded checkpoint files and clipping by the global norm.

Checkpoints. ``trainer.save_checkpoint(path)`` writes the checkpoint file as usual (rank 0: weights, loops,
schedulers) with a small descriptor in place of each optimizer's state, and every rank writes its shard beside it
(:mod:`cg_lightning.optim.sharded_files`, which also joins them for a run without the distributed optimizer;
:func:`consolidate` does that offline, for Lightning's ``"ddp"`` or any other strategy).

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
from typing import Any, Callable, Dict, Optional

from typing_extensions import override

from ..optim.sharded_files import consolidate, load_shards, remove_shards, save_shards
from ..optim.sharded_optimizer import clip_grad_norm_

__all__ = ["DistributedOptimizerMixin", "GlobalNormClipping", "consolidate"]

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
