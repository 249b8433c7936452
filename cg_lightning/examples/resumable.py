"""A training DataLoader that Lightning resumes mid-epoch exactly: same order, next batch, nothing repeated.

Lightning saves ``state_dict()`` of every training loader that has ``state_dict``/``load_state_dict`` in each
checkpoint (``loops.fit_loop.state_dict.combined_loader``) and, on ``fit(ckpt_path=...)``, hands it back to
``load_state_dict`` before it asks the loader for an iterator. Without that a run resumed mid-epoch starts the
epoch over: it trains on batches it already took and never on the rest of the epoch.

* :class:`ResumableSampler` is a ``DistributedSampler`` (so Lightning keeps it and does not inject its own: same
  arguments as the one Lightning would inject, so the same order) that can begin its next pass after its first
  ``start`` indices, without loading what it skips.
* :class:`ResumableDataLoader` counts the batches it handed out in the current pass; its state is that count and
  the sampler's epoch. Lightning's fetcher takes no batch ahead from a loader with a length, so the count at a
  checkpoint is the number of batches the training loop consumed.

Use them for your own map-style dataset as :meth:`cg_lightning.examples.data.TextDataModule.train_dataloader` does
(docs/usage.md, "Exact resume mid-epoch").
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Dict, Iterator

from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

__all__ = ["ResumableDataLoader", "ResumableSampler", "resumable_loader"]


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` whose next pass skips its first :attr:`start` indices (then :attr:`start` is 0)."""

    def __init__(self, dataset: Dataset, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        start, self.start = self.start, 0
        return itertools.islice(super().__iter__(), start, None)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableSampler` with ``state_dict``/``load_state_dict``.

    The state is ``{"epoch": e, "batches": n}``: ``n`` batches of epoch ``e`` were handed out. After
    :meth:`load_state_dict` the next pass starts at batch ``n`` of epoch ``e`` (a full epoch: at the next epoch's
    first batch); ``len()`` stays the whole epoch's, as Lightning counts the skipped batches itself.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, ResumableSampler) or self.batch_size is None:
            raise TypeError("ResumableDataLoader needs sampler=ResumableSampler(...) and a batch_size")
        self.taken = 0  # batches handed out in the current pass, counting those its start skipped

    def __iter__(self) -> Iterator[Any]:
        skip = self.sampler.start // self.batch_size
        self.taken = skip
        for batch in super().__iter__():
            self.taken += 1
            yield batch

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": int(self.sampler.epoch), "batches": int(self.taken)}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        epoch, batches = int(state["epoch"]), int(state["batches"])
        if batches >= len(self):  # the epoch was complete: the next pass is the next epoch, from its start
            epoch, batches = epoch + 1, 0
        self.sampler.set_epoch(epoch)
        self.sampler.start = batches * self.batch_size
        self.taken = batches


def resumable_loader(dataset: Dataset, trainer: Any, *, batch_size: int, shuffle: bool = True,
                     drop_last: bool = False, **kwargs: Any) -> ResumableDataLoader:
    """A :class:`ResumableDataLoader` for ``trainer``'s rank: the ``DistributedSampler`` Lightning would inject
    (``num_replicas`` = world size, ``rank`` = global rank, ``seed`` = ``seed_everything``'s), made resumable.
    ``kwargs`` go to the ``DataLoader`` (``num_workers``, ``collate_fn``, ...)."""
    sampler = ResumableSampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank,
                               shuffle=shuffle, seed=int(os.getenv("PL_GLOBAL_SEED", 0)))
    return ResumableDataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)
