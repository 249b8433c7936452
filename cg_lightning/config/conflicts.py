"""Settings that are valid one by one but cannot work together, refused before training starts.

Three moments, each as early as the information exists:

* :func:`check_settings`, from the configuration alone (run by ``load_config``):
  ``strategy.graphs.backend: cuda`` with ``trainer.accelerator: cpu``.
* :func:`check_model`, once the model is built and before the trainer runs (the command line calls
  it): graph layer patterns that select nothing; for ``fit``, manual optimization
  (``automatic_optimization = False``) with ``trainer.gradient_clip_val`` or with
  ``trainer.accumulate_grad_batches`` above 1 (Lightning only clips and accumulates for automatic
  optimization).
* :class:`ShapePolicyDataCheck`, a callback ``build_trainer`` adds when graphs run with
  ``shape_policy: error``: at ``on_train_start`` (training loader built, distributed sampler in place,
  no training batch run yet) it refuses a map-style training loader whose ``BatchSampler`` keeps a
  smaller last batch (``drop_last=False`` and a per-process sample count not divisible by the batch
  size) when training reaches that batch. Iterable datasets and custom batch samplers without
  ``batch_size`` / ``drop_last`` attributes cannot be judged without iterating them and are not checked.

Every refusal is a :class:`~cg_lightning.config.errors.ConfigError` naming the keys involved, the file
each came from and what would be accepted instead.
"""

from __future__ import annotations

import inspect
from typing import Any, List, Mapping, Optional, Tuple

from lightning.pytorch.callbacks import Callback

from .errors import ConfigError
from .provenance import from_text


def _graphs_active(cfg: Any) -> bool:
    return cfg.strategy.name == "cudagraph_ddp" and cfg.strategy.graphs.enabled


def check_settings(cfg: Any) -> None:
    """Refuse settings of a loaded :class:`~cg_lightning.config.RunConfig` that contradict each other.

    Raises:
        ConfigError: ``strategy.graphs.backend`` is ``cuda`` while ``trainer.accelerator`` is ``cpu``
            (with ``cudagraph_ddp`` and graphs enabled).
    """
    problems = []
    graphs = cfg.strategy.graphs
    if _graphs_active(cfg) and graphs.backend == "cuda" and cfg.trainer.accelerator == "cpu":
        problems.append(
            "strategy.graphs.backend: 'cuda' needs a CUDA device but trainer.accelerator is 'cpu'; expected "
            "backend 'eager' or 'auto' on CPU, or trainer.accelerator 'gpu'"
            + from_text(cfg, "strategy.graphs.backend", "trainer.accelerator")
        )
    if problems:
        raise ConfigError("\n".join(problems))


def check_model(cfg: Any, model: Any, stage: str = "fit") -> None:
    """Refuse settings that cannot work with ``model`` (built from ``cfg.model``), before training.

    Args:
        cfg: the loaded :class:`~cg_lightning.config.RunConfig`.
        model: the ``LightningModule`` built from it.
        stage: ``"fit"`` checks everything; any other stage (``"validate"``) only the graph layer
            patterns, since no optimizer step runs.

    Raises:
        ConfigError: one line per conflict: ``strategy.graphs.layers`` selects no module of the model;
            the model uses manual optimization with a ``trainer.gradient_clip_val`` above 0 or with
            ``trainer.accumulate_grad_batches`` above 1.
    """
    problems: List[str] = []
    if _graphs_active(cfg):
        from cg_lightning.graphs.selection import select_layers  # torch only; imported when needed

        try:
            select_layers(model, cfg.strategy.graphs.layers)
        except ValueError as exc:
            problems.append(f"strategy.graphs.layers: {exc}" + from_text(cfg, "strategy.graphs.layers"))
    if stage == "fit" and not getattr(model, "automatic_optimization", True):
        what = f"{cfg.model.class_path} sets automatic_optimization = False (manual optimization)"
        clip = cfg.trainer.gradient_clip_val
        if clip is not None and clip > 0:
            problems.append(
                f"trainer.gradient_clip_val: Lightning clips gradients only under automatic optimization, but "
                f"{what}; expected null (clip inside training_step with self.clip_gradients)"
                + from_text(cfg, "trainer.gradient_clip_val", "model.class_path")
            )
        if cfg.trainer.accumulate_grad_batches > 1:
            problems.append(
                f"trainer.accumulate_grad_batches: Lightning accumulates gradients only under automatic "
                f"optimization, but {what}; expected 1 (accumulate inside training_step)"
                + from_text(cfg, "trainer.accumulate_grad_batches", "model.class_path")
            )
    if problems:
        raise ConfigError("\n".join(problems))


def partial_last_batch(loader: Any) -> Optional[Tuple[int, int, int]]:
    """``(full_batches, batch_size, last_batch_size)`` when ``loader`` ends each epoch with a smaller
    batch; ``None`` when it does not, or when that cannot be told without iterating it."""
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    batch_sampler = loader.batch_sampler
    batch_size = getattr(batch_sampler, "batch_size", None)
    drop_last = getattr(batch_sampler, "drop_last", None)
    if not isinstance(batch_size, int) or batch_size < 1 or drop_last is not False:
        return None
    try:
        samples = len(batch_sampler.sampler)
    except (AttributeError, TypeError):
        return None
    last = samples % batch_size
    return (samples // batch_size, batch_size, last) if last else None


def _loaders(combined: Any) -> List[Any]:
    if isinstance(combined, Mapping):
        return [loader for value in combined.values() for loader in _loaders(value)]
    if isinstance(combined, (list, tuple)):
        return [loader for value in combined for loader in _loaders(value)]
    return [] if combined is None else [combined]


class ShapePolicyDataCheck(Callback):
    """Refuses, at ``on_train_start``, training data whose smaller last batch ``shape_policy: error`` would
    turn into a ``GraphSignatureError`` in the middle of training (see this module's docstring).

    Args:
        cfg: the loaded :class:`~cg_lightning.config.RunConfig`, for key names and their files.

    Raises:
        ConfigError: from ``on_train_start``, before the first training batch, when a training loader
            ends an epoch with a smaller batch and ``max_steps`` lets training reach it.
    """

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        accumulate = max(1, int(trainer.accumulate_grad_batches))
        for loader in _loaders(trainer.train_dataloader):
            found = partial_last_batch(loader)
            if found is None:
                continue
            full, batch_size, last = found
            per_epoch = trainer.num_training_batches  # after limit_train_batches
            if per_epoch <= full or 0 <= trainer.max_steps <= full // accumulate:
                continue  # training stops before the smaller batch
            raise ConfigError(self._message(trainer, full, batch_size, last))

    def _message(self, trainer: Any, full: int, batch_size: int, last: int) -> str:
        cfg = self.cfg
        fixes = ["strategy.graphs.shape_policy 'eager' (that batch then runs eagerly)"]
        datamodule = getattr(trainer, "datamodule", None)
        try:
            takes_drop_last = datamodule is not None and "drop_last" in inspect.signature(type(datamodule)).parameters
        except (TypeError, ValueError):
            takes_drop_last = False
        fixes.append("data.init_args.drop_last=true" if takes_drop_last else "drop_last=True in the training DataLoader")
        fixes.append(f"a per-process sample count divisible by {batch_size}")
        return (
            f"strategy.graphs.shape_policy: 'error' cannot work with this training data: on process "
            f"{trainer.global_rank} each epoch ends, after {full} full batches of {batch_size}, with a batch of "
            f"{last} (drop_last=False), and a graphed layer called with that batch raises GraphSignatureError; "
            f"expected one of: {', '.join(fixes)}"
            + from_text(cfg, "strategy.graphs.shape_policy", "data.class_path")
        )
