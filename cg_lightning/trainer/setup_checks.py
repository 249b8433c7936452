"""Settings the strategy cannot honour, refused before the first training step, for every entry point.

The strategy calls these itself, so they hold for ``Trainer(strategy=...)`` in Python, for a ``LightningCLI`` in a
user's script and for ``python -m cg_lightning`` alike:

* :func:`check_setup`, first thing in the strategy's ``setup`` (the model is built and configured, nothing
  wrapped or graphed yet): ``graphs.layers`` patterns that select no module; ``graphs.backend: cuda`` on a
  device that is not a GPU.
* :func:`check_train_data`, from the strategy's ``on_train_start`` (the training loader is built, the distributed
  sampler in place, no batch run): ``graphs.shape_policy: error`` with a map-style training loader whose epoch
  ends in a smaller batch that training would reach (``drop_last=False``, a per-process sample count not divisible
  by the batch size). Iterable datasets and batch samplers without ``batch_size`` / ``drop_last`` cannot be judged
  without iterating them and are not checked.

Each refusal is a :class:`~cg_lightning.errors.ConfigError` whose lines start with the option at fault
(``graphs.layers: ...``) and say what would be accepted instead. Lightning's own refusals (manual optimization
with ``gradient_clip_val`` or ``accumulate_grad_batches``) come from Lightning, before these.
"""

from __future__ import annotations

import inspect
from typing import Any, List, Mapping, Optional, Tuple

from ..errors import ConfigError


def check_setup(strategy: Any, trainer: Any) -> None:
    """Refuse graph options that cannot work with the strategy's model and device.

    Args:
        strategy: the ``CUDAGraphDDPStrategy`` (either Lightning package), before its own setup.
        trainer: the Trainer being set up.

    Raises:
        ConfigError: one line per problem: ``graphs.layers`` selects no module of the LightningModule (the line
            lists some module names); ``graphs.backend`` is ``'cuda'`` while the strategy's device is not a GPU.
    """
    options = strategy.graph_options
    if not options.enabled:
        return
    problems: List[str] = []
    model = strategy.lightning_module
    if options.layers is not None and model is not None:
        from ..graphs.selection import select_layers

        try:
            select_layers(model, options.layers)
        except ValueError as exc:
            text = str(exc).replace("graphs.layers ", "", 1)
            problems.append(f"graphs.layers: {text}; patterns are matched against the LightningModule's module "
                            "names (self.model.blocks -> 'model.blocks.*')")
    device = strategy.root_device
    if options.backend == "cuda" and device.type != "cuda":
        problems.append(f"graphs.backend: 'cuda' needs a CUDA device but the strategy runs on {device.type!r}; "
                        "expected 'eager' or 'auto' on this device, or a GPU accelerator")
    if problems:
        raise ConfigError("\n".join(problems))


def partial_last_batch(loader: Any) -> Optional[Tuple[int, int, int]]:
    """``(full_batches, batch_size, last_batch_size)`` when ``loader`` ends each epoch with a smaller batch;
    ``None`` when it does not, or when that cannot be told without iterating it."""
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


def check_train_data(strategy: Any, trainer: Any) -> None:
    """Refuse training data whose smaller last batch ``graphs.shape_policy: 'error'`` would turn into a
    ``GraphSignatureError`` in the middle of training (see the module docstring).

    Raises:
        ConfigError: a training loader ends an epoch with a smaller batch and ``max_steps`` lets training reach it.
    """
    options = strategy.graph_options
    if not (options.enabled and options.shape_policy == "error"):
        return
    accumulate = max(1, int(trainer.accumulate_grad_batches))
    for loader in _loaders(trainer.train_dataloader):
        found = partial_last_batch(loader)
        if found is None:
            continue
        full, batch_size, last = found
        if trainer.num_training_batches <= full or 0 <= trainer.max_steps <= full // accumulate:
            continue  # training stops before the smaller batch
        raise ConfigError(_shape_policy_message(trainer, full, batch_size, last))


def _shape_policy_message(trainer: Any, full: int, batch_size: int, last: int) -> str:
    fixes = ["graphs.shape_policy 'eager' (that batch then runs eagerly)"]
    datamodule = getattr(trainer, "datamodule", None)
    try:
        takes_drop_last = datamodule is not None and "drop_last" in inspect.signature(type(datamodule)).parameters
    except (TypeError, ValueError):
        takes_drop_last = False
    fixes.append("data.init_args.drop_last: true" if takes_drop_last else "drop_last=True in the training DataLoader")
    fixes.append(f"a per-process sample count divisible by {batch_size}")
    return (f"graphs.shape_policy: 'error' cannot work with this training data: on process {trainer.global_rank} "
            f"each epoch ends, after {full} full batches of {batch_size}, with a batch of {last} (drop_last=False), "
            f"and a graphed layer called with that batch raises GraphSignatureError; expected one of: "
            f"{', '.join(fixes)}")
