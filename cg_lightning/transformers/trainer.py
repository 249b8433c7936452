"""``CUDAGraphTrainer``: ``transformers.Trainer`` on cg-lightning's graphs and data-parallel engine.

A fine-tuning script changes the class it builds, and may pass graph and DDP options::

    from cg_lightning.transformers import CUDAGraphTrainer
    trainer = CUDAGraphTrainer(model=model, args=training_args, train_dataset=ds, graphs={"warmup_steps": 2})

``Trainer`` runs its loop on Accelerate: it prepares the model and optimizer with its accelerator, calls
``accelerator.backward``, ``accelerator.no_sync`` for accumulation and ``accelerator.clip_grad_norm_``, and sets
the accelerator's ``sync_gradients`` itself. This class makes that accelerator a
:class:`~cg_lightning.accelerate.CUDAGraphAccelerator`, so the same loop trains through the engine; nothing else in
the Trainer changes (evaluation, logging, checkpoints, ``resume_from_checkpoint``).

``TrainingArguments``' DDP settings become the engine's: ``ddp_find_unused_parameters`` (``None``: as ``Trainer``
decides it) is ``ddp.find_unused_parameters``, ``ddp_bucket_cap_mb`` is ``ddp.bucket_size_mb``,
``ddp_broadcast_buffers`` is ``ddp.broadcast_buffers``, unless ``ddp=`` sets them; ``ddp_static_graph`` has no
counterpart and is refused. ``transformers`` builds its ``Accelerator`` in ``create_accelerator_and_postprocess``
without a hook for the class, so that method is run with the name ``Accelerator`` of ``transformers.trainer``
pointing at a factory of this accelerator, for the call only.

Refused, with the setting named: DeepSpeed and FSDP (their own engines), ``torch.compile`` (``torch_compile``),
several GPUs in one process (``nn.DataParallel``: launch one process per GPU with ``torchrun`` or ``accelerate
launch``), ``ddp.distributed_optimizer`` (the Trainer saves the main process's optimizer state only), and what
``CUDAGraphAccelerator`` refuses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Dict, Iterator, Union

import transformers
import transformers.trainer as _hf_trainer
from accelerate.utils import DistributedDataParallelKwargs
from typing_extensions import override

from ..accelerate import CUDAGraphAccelerator
from ..ddp import DDPOptions
from ..graphs import GraphOptions
from ..options import as_options

_patch_lock = threading.Lock()


@contextlib.contextmanager
def _accelerator_class(factory) -> Iterator[None]:
    """``transformers.trainer.Accelerator`` is ``factory`` inside (one thread at a time)."""
    with _patch_lock:
        original = _hf_trainer.Accelerator
        _hf_trainer.Accelerator = factory
        try:
            yield
        finally:
            _hf_trainer.Accelerator = original


class CUDAGraphTrainer(transformers.Trainer):
    """``transformers.Trainer`` with per-layer CUDA graphs and the exact ``main_grad`` engine.

    Args:
        *args, **kwargs: ``transformers.Trainer`` arguments (``model``, ``args``, ``train_dataset``, ...).
        graphs: :class:`~cg_lightning.graphs.GraphOptions` or a dict of its fields (``layers`` relative to the
            model, ``warmup_steps`` in optimizer steps, ``backend``, ...).
        ddp: :class:`~cg_lightning.ddp.DDPOptions` or a dict (``bucket_size_mb`` in MiB, ``timeout_s`` in seconds,
            ...); fields it leaves at their defaults take ``TrainingArguments``' DDP settings (module docstring).

    Raises:
        TypeError, ValueError: an option of the wrong type or out of range (named); a set-up the engine does not
            serve (DeepSpeed, FSDP, ``torch_compile``, ``ddp_static_graph``, several GPUs in one process,
            ``ddp.distributed_optimizer``).
    """

    def __init__(self, *args: Any, graphs: Union[GraphOptions, Dict[str, Any], None] = None,
                 ddp: Union[DDPOptions, Dict[str, Any], None] = None, **kwargs: Any) -> None:
        self.graph_options = as_options(GraphOptions, graphs, "graphs")
        self.ddp_options = as_options(DDPOptions, ddp, "ddp")
        self._ddp_given = set() if ddp is None else (set(ddp) if isinstance(ddp, dict) else {
            f.name for f in dataclasses.fields(DDPOptions) if getattr(ddp, f.name) != f.default})
        super().__init__(*args, **kwargs)

    def _refusals(self) -> list:
        a = self.args
        problems = []
        if getattr(a, "deepspeed", None):
            problems.append("deepspeed (DeepSpeed brings its own engine)")
        if getattr(a, "fsdp", None):
            problems.append("fsdp (FSDP brings its own engine)")
        if getattr(a, "torch_compile", False):
            problems.append("torch_compile (compile the model yourself before the Trainer instead)")
        if getattr(a, "ddp_static_graph", None):
            problems.append("ddp_static_graph (a torch DDP setting without a counterpart in this engine)")
        if self.ddp_options.distributed_optimizer:
            problems.append("with ddp.distributed_optimizer (the Trainer saves the optimizer state of the main "
                            "process only, where each rank holds its own shard: use it with the Lightning Trainer, "
                            "Fabric or CUDAGraphAccelerator)")
        if a.n_gpu > 1:
            problems.append(f"{a.n_gpu} GPUs in one process (nn.DataParallel: launch one process per GPU with "
                            "torchrun or accelerate launch)")
        return problems

    @override
    def create_accelerator_and_postprocess(self) -> None:
        """``Trainer``'s, building a :class:`~cg_lightning.accelerate.CUDAGraphAccelerator`.

        Raises:
            ValueError: see the class docstring.
        """
        problems = self._refusals()
        if problems:
            raise ValueError("cg_lightning: CUDAGraphTrainer does not support TrainingArguments "
                             + "; ".join(problems) + ". Use transformers.Trainer for such a run.")

        def factory(*args: Any, **kwargs: Any) -> CUDAGraphAccelerator:
            return CUDAGraphAccelerator(*args, graphs=self.graph_options, ddp=self._engine_ddp_options(kwargs),
                                        **kwargs)

        with _accelerator_class(factory):
            super().create_accelerator_and_postprocess()

    def _engine_ddp_options(self, kwargs: Dict[str, Any]) -> DDPOptions:
        """The ``ddp`` options with ``TrainingArguments``' torch DDP settings (taken out of ``kwargs``) where
        ``ddp=`` left a field unset."""
        handlers = kwargs.pop("kwargs_handlers", None) or []
        torch_ddp: Dict[str, Any] = {}
        for handler in handlers:
            if isinstance(handler, DistributedDataParallelKwargs):
                torch_ddp.update(handler.to_kwargs())
            else:
                kwargs.setdefault("kwargs_handlers", []).append(handler)
        mapped = {"find_unused_parameters": torch_ddp.get("find_unused_parameters"),
                  "bucket_size_mb": torch_ddp.get("bucket_cap_mb"),
                  "broadcast_buffers": torch_ddp.get("broadcast_buffers")}
        changes = {k: v for k, v in mapped.items() if v is not None and k not in self._ddp_given}
        return dataclasses.replace(self.ddp_options, **changes) if changes else self.ddp_options
