"""The Hugging Face ``transformers.Trainer`` front end: :class:`CUDAGraphTrainer`, a ``Trainer`` whose Accelerate
accelerator is :class:`~cg_lightning.accelerate.CUDAGraphAccelerator` (:mod:`.trainer`)."""

from .trainer import CUDAGraphTrainer

__all__ = ["CUDAGraphTrainer"]
