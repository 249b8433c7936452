"""Train a LightningModule under a strategy, record what the hooks see, and compare two runs bit for bit.

:func:`train` seeds, builds a CPU Trainer (deterministic; no logger, progress bar, summary, checkpointing or
validation unless asked) with a :class:`Recorder`, and runs a sequence of Trainer calls. :meth:`Run.facts` is
what a run is judged by: the events recorded in call order (loop positions, losses, gradients at the optimizer
step, weights and learning rates after each batch, evaluation outputs, and whatever probes were added), the
final weights, optimizer and scheduler states, loop state and callback metrics. :func:`assert_same` compares two
runs' facts with ``torch.equal`` (dtype and shape included) and names the first difference in time.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything

import cg_lightning  # noqa: F401  (registers "cudagraph_ddp")

SEED = 1234

#: the strategy each reference strategy's run is compared against
CANDIDATE = {
    "ddp": "cudagraph_ddp",
    "ddp_find_unused_parameters_true": "cudagraph_ddp_find_unused_parameters_true",
}


def candidate(reference: str) -> str:
    return CANDIDATE[reference]


def grads(module: torch.nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """Every parameter's ``.grad`` by name, cloned (``None`` where it is ``None``)."""
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in module.named_parameters()}


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clone(v) for v in value]
    return value


class OutcomeRecorder(Callback):
    """Appends to ``pl_module.events``: where each training batch starts (epoch, global step, batch index), and
    after each batch the ``training_step`` outputs, the weights and every learning rate; the outputs of every
    evaluation batch and the metrics after each validation run. No hook between the backward and the optimizer
    step (:class:`Recorder` adds one)."""

    def on_train_start(self, trainer, pl_module):
        pl_module.events.append({"hook": "train_start", "step": trainer.global_step, "epoch": trainer.current_epoch})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.events.append({"hook": "train_batch_start", "epoch": trainer.current_epoch,
                                 "step": trainer.global_step, "batch_idx": batch_idx})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.events.append({
            "hook": "train_batch_end", "step": trainer.global_step, "outputs": _clone(outputs),
            "weights": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "lrs": [g["lr"] for opt in trainer.optimizers for g in opt.param_groups],
        })

    def _eval_batch(self, name, trainer, pl_module, outputs, batch_idx):
        pl_module.events.append({"hook": name, "step": trainer.global_step, "batch_idx": batch_idx,
                                 "outputs": _clone(outputs)})

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._eval_batch("validation_batch_end", trainer, pl_module, outputs, batch_idx)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._eval_batch("test_batch_end", trainer, pl_module, outputs, batch_idx)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._eval_batch("predict_batch_end", trainer, pl_module, outputs, batch_idx)

    def on_validation_end(self, trainer, pl_module):
        pl_module.events.append({"hook": "validation_end", "step": trainer.global_step,
                                 "metrics": _clone(dict(trainer.callback_metrics))})


GRAD_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad",
              "on_train_batch_end")


class GradProbe(Callback):
    """Appends every parameter's ``.grad`` (cloned, or ``None``) to ``pl_module.events`` in the chosen hooks of
    :data:`GRAD_HOOKS`; ``on_before_backward`` also records the loss."""

    def __init__(self, hooks: Sequence[str] = GRAD_HOOKS) -> None:
        self.hooks = tuple(hooks)

    def _see(self, name, trainer, pl_module, **extra):
        if name in self.hooks:
            pl_module.events.append({"hook": name, "step": trainer.global_step, **extra, "grads": grads(pl_module)})

    def on_before_backward(self, trainer, pl_module, loss):
        self._see("on_before_backward", trainer, pl_module, loss=loss.detach().clone())

    def on_after_backward(self, trainer, pl_module):
        self._see("on_after_backward", trainer, pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._see("on_before_optimizer_step", trainer, pl_module)

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        self._see("on_before_zero_grad", trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._see("on_train_batch_end", trainer, pl_module)


CALL_HOOKS = ("on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start",
              "on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
              "on_train_batch_end", "on_train_epoch_end", "on_validation_start", "on_validation_end",
              "on_train_end", "on_fit_end", "on_save_checkpoint", "on_load_checkpoint")


class CallLog(Callback):
    """Appends ``{"hook": name}`` to ``pl_module.events`` for each Callback hook of :data:`CALL_HOOKS`."""


def _logging_hook(name: str) -> Callable:
    def hook(self, trainer, pl_module, *args, **kwargs):
        pl_module.events.append({"hook": name})

    hook.__name__ = name
    return hook


for _name in CALL_HOOKS:
    setattr(CallLog, _name, _logging_hook(_name))


@dataclass
class Run:
    """One run: the module, its Trainer, and what each Trainer call returned."""

    model: LightningModule
    trainer: Trainer
    outputs: List[Any] = field(default_factory=list)

    def facts(self) -> Dict[str, Any]:
        t = self.trainer
        return {
            "events": self.model.events,
            "outputs": _clone(self.outputs),
            "weights": _clone(dict(self.model.state_dict())),
            "optimizers": [copy.deepcopy(opt.state_dict()) for opt in t.optimizers],
            "schedulers": [copy.deepcopy(cfg.scheduler.state_dict()) for cfg in t.lr_scheduler_configs],
            "loops": {"global_step": t.global_step, "epoch": t.current_epoch,
                      "fit_loop": copy.deepcopy(t.fit_loop.state_dict())},
            "metrics": _clone(dict(t.callback_metrics)),
        }


class Recorder(OutcomeRecorder):
    """:class:`OutcomeRecorder`, and the gradients seen in ``on_before_optimizer_step``."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pl_module.events.append({"hook": "on_before_optimizer_step", "step": trainer.global_step,
                                 "grads": grads(pl_module)})


def make_trainer(strategy: Any, callbacks: Iterable[Callback] = (), recorder: type = Recorder,
                 **kwargs: Any) -> Trainer:
    options = dict(accelerator="cpu", devices=1, max_epochs=1, deterministic=True, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                   num_sanity_val_steps=0, limit_val_batches=0)
    options.update(kwargs)
    return Trainer(strategy=strategy, callbacks=[recorder(), *callbacks], **options)


Call = Union[str, tuple]


def train(strategy: Any, model: Union[LightningModule, Callable[[], LightningModule]],
          calls: Sequence[Call] = ("fit",), seed: Optional[int] = SEED, callbacks: Iterable[Callback] = (),
          recorder: type = Recorder, **trainer_kwargs: Any) -> Run:
    """Seed (unless ``seed`` is None), build the model (if given a factory) and a Trainer with a ``recorder``,
    then run ``calls``: each a Trainer method name (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``) or
    ``(name, kwargs)``, called with the model. ``callbacks`` are copied, so one list can serve several runs.
    Returns the :class:`Run`."""
    if seed is not None:
        seed_everything(seed, verbose=False)
    module = model if isinstance(model, LightningModule) else model()
    trainer = make_trainer(strategy, [copy.deepcopy(c) for c in callbacks], recorder, **trainer_kwargs)
    run = Run(module, trainer)
    for call in calls:
        name, kwargs = (call, {}) if isinstance(call, str) else call
        run.outputs.append(getattr(trainer, name)(module, **kwargs))
    return run


def check(reference: str, model: Callable[[], LightningModule], **kwargs: Any) -> Run:
    """Train under ``reference`` and under its candidate strategy with the same arguments; assert their facts
    are equal. Returns the candidate's run."""
    ref = train(reference, model, **kwargs)
    cand = train(candidate(reference), model, **kwargs)
    assert_same(ref.facts(), cand.facts())
    return cand


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {value.dtype} {tuple(value.shape)}"
    if isinstance(value, dict) and "hook" in value:
        return f"event {value['hook']}"
    return type(value).__name__ if isinstance(value, (dict, list, tuple)) else repr(value)


def first_difference(ref: Any, cand: Any, path: str = "") -> Optional[str]:
    """``None`` if equal, else ``"path: what differs"`` for the first difference (lists in order)."""
    if isinstance(ref, torch.Tensor) and isinstance(cand, torch.Tensor):
        if ref.dtype != cand.dtype or ref.shape != cand.shape:
            return f"{path}: reference {_describe(ref)}, candidate {_describe(cand)}"
        if torch.equal(ref, cand):
            return None
        if ref.is_floating_point() and torch.equal(ref.isnan(), cand.isnan()) and torch.equal(
                ref[~ref.isnan()], cand[~cand.isnan()]):
            return None
        diff = float((ref.double() - cand.double()).abs().max())
        return f"{path}: values differ (max |difference| {diff:.3g}, max |reference| {float(ref.abs().max()):.3g})"
    if isinstance(ref, dict) and isinstance(cand, dict):
        if set(ref) != set(cand):
            return (f"{path}: keys only in reference {sorted(map(str, set(ref) - set(cand)))}, "
                    f"only in candidate {sorted(map(str, set(cand) - set(ref)))}")
        for key in ref:
            found = first_difference(ref[key], cand[key], f"{path}[{key!r}]" if path else str(key))
            if found:
                return found
        return None
    if isinstance(ref, (list, tuple)) and isinstance(cand, (list, tuple)):
        for i, (r, c) in enumerate(zip(ref, cand)):
            label = f"{path}[{i}]"
            if isinstance(r, dict) and "hook" in r:
                label += f"<{r['hook']}" + (f" step {r['step']}" if "step" in r else "") + ">"
            found = first_difference(r, c, label)
            if found:
                return found
        if len(ref) != len(cand):
            n = min(len(ref), len(cand))
            longer, which = (ref, "reference") if len(ref) > len(cand) else (cand, "candidate")
            return (f"{path}: reference has {len(ref)} entries, candidate {len(cand)}; next in {which}: "
                    f"{_describe(longer[n])}")
        return None
    if isinstance(ref, float) and isinstance(cand, float) and math.isnan(ref) and math.isnan(cand):
        return None
    if type(ref) is not type(cand) or ref != cand:
        return f"{path}: reference {_describe(ref)}, candidate {_describe(cand)}"
    return None


def assert_same(ref: Any, cand: Any) -> None:
    """Raises AssertionError naming the first difference between a reference and a candidate run's facts."""
    found = first_difference(ref, cand)
    assert found is None, found
