"""``consolidate(path)``: a checkpoint saved under ``ddp.distributed_optimizer`` joined into one full optimizer
state, for Lightning's ``"ddp"`` or any other tool; defined in :mod:`cg_lightning.trainer.distributed_optimizer`,
importable from here as documented."""

from .trainer.distributed_optimizer import consolidate

__all__ = ["consolidate"]
