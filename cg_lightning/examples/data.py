"""Byte-level (or pre-tokenized) language-modelling data for the GPT example.

:class:`TextDataModule` turns a token stream into non-overlapping windows of
``block_size + 1`` tokens and serves ``(x, y)`` pairs, ``y`` being ``x`` shifted
left by one token.  Sources:

* ``path=None``: the ``.py`` files of the running interpreter's standard library
  (real text that exists on every machine, no download needed);
* a ``.bin`` file: pre-tokenized ``uint16`` token ids, memory-mapped;
* any other file: a UTF-8 text file, tokenized as raw bytes (vocab 256);
* a directory: every UTF-8 file below it, tokenized as raw bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from cg_lightning.examples.arguments import check_arguments, finite_at_least, whole
from cg_lightning.examples.resumable import resumable_loader
from cg_lightning.examples.text_source import read_stdlib_bytes, read_text_bytes

__all__ = ["TextDataModule", "TokenWindowDataset", "check_arguments", "finite_at_least", "model_fit_problems",
           "read_stdlib_bytes", "read_text_bytes", "whole"]



def model_fit_problems(datamodule, vocab_size: int, block_size: int) -> list[str]:
    """Why the data of ``datamodule`` (after its ``setup``) cannot feed a model with ``vocab_size`` token ids and
    ``block_size`` positions: windows longer than the model's context, token ids beyond its vocabulary."""
    problems = []
    data_block = getattr(datamodule, "block_size", None)
    if isinstance(data_block, int) and data_block > block_size:
        problems.append(
            f"data.init_args.block_size: {data_block} is longer than the model's context, model.init_args.block_size: "
            f"{block_size}; the model cannot take windows that long. Set the data's block_size to at most the model's "
            "(the shipped configs set it to ${model.init_args.block_size}), or raise the model's.")
    data_vocab = getattr(datamodule, "vocab_size", None)
    if isinstance(data_vocab, int) and data_vocab > vocab_size:
        source = getattr(datamodule, "path", None)
        what = f"the token ids of {source!r} reach {data_vocab - 1}" if source else f"the data has {data_vocab} token ids"
        problems.append(f"data.init_args.path: {what}, beyond the model's vocabulary, model.init_args.vocab_size: "
                        f"{vocab_size}; set the model's vocab_size to at least {data_vocab}")
    return problems


class TokenWindowDataset(Dataset):
    """Non-overlapping windows of ``block_size + 1`` tokens over a 1-D token array.

    Item ``i`` covers ``tokens[i * (block_size + 1) : (i + 1) * (block_size + 1)]``
    and is returned as ``(x, y) = (window[:-1], window[1:])``, both int64 tensors
    of shape ``(block_size,)``.  Conversion to int64 happens lazily per item.

    Args:
        tokens: 1-D integer array (``uint8`` bytes or a ``uint16`` memmap slice).
            Ignored when ``bin_path`` is given.
        block_size: model context length ``T``.
        bin_path, start, stop: alternatively, a ``uint16`` ``.bin`` file and the
            token range ``[start, stop)`` to use; the file is memory-mapped lazily
            in each process, so pickling the dataset (DataLoader workers) stays cheap.
    """

    def __init__(
        self,
        tokens: np.ndarray | None,
        block_size: int,
        *,
        bin_path: str | None = None,
        start: int = 0,
        stop: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = int(block_size)
        self.window = self.block_size + 1
        self.bin_path = bin_path
        self._tokens = tokens
        if bin_path is not None:
            self.start = int(start)
            self.stop = int(stop) if stop is not None else len(self._mapped())
            self._tokens = None
        else:
            if tokens is None:
                raise ValueError("either tokens or bin_path must be given")
            self.start, self.stop = 0, len(tokens)

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start

    def _mapped(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.memmap(self.bin_path, dtype=np.uint16, mode="r")
        return self._tokens

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if self.bin_path is not None:
            state["_tokens"] = None  # re-mapped on first access in the new process
        return state

    def __len__(self) -> int:
        return self.num_tokens // self.window

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"window index {i} out of range for {len(self)} windows")
        lo = self.start + i * self.window
        chunk = torch.from_numpy(np.asarray(self._mapped()[lo : lo + self.window], dtype=np.int64))
        return chunk[:-1], chunk[1:]


class TextDataModule(LightningDataModule):
    """LightningDataModule serving next-token ``(x, y)`` batches.

    Each batch is a pair of int64 tensors of shape ``(batch_size, block_size)``.

    Args:
        path: ``None`` for the standard library's ``.py`` files; a ``.bin`` file of
            uint16 token ids; a UTF-8 text file; or a directory of UTF-8 files.
        block_size: context length ``T``; windows hold ``T + 1`` tokens.
        batch_size: windows per batch.
        val_fraction: trailing fraction of the token stream used for validation
            (the leading ``1 - val_fraction`` is training data).  ``0`` disables
            validation (``val_dataloader`` then returns an empty list).
        max_bytes: cap on the bytes read from text sources (``None`` = no cap).
            Not applied to ``.bin`` files, which are memory-mapped whole.
        num_workers: DataLoader worker processes.
        drop_last: drop the last incomplete training batch.

    Attributes:
        vocab_size: 256 for text; ``max token id + 1`` for ``.bin`` files (known
            after :meth:`setup`; ``None`` before).
        train_dataset, val_dataset: :class:`TokenWindowDataset` after :meth:`setup`
            (``val_dataset`` is ``None`` when ``val_fraction == 0``).
    """

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.1,
        max_bytes: int | None = 4_000_000,
        num_workers: int = 0,
        drop_last: bool = True,
    ) -> None:
        super().__init__()
        check_arguments(
            block_size=(block_size, whole(block_size), "an int >= 1"),
            batch_size=(batch_size, whole(batch_size), "an int >= 1"),
            val_fraction=(val_fraction, finite_at_least(val_fraction, 0.0) and val_fraction < 1.0,
                          "a fraction in [0, 1)"),
            max_bytes=(max_bytes, max_bytes is None or whole(max_bytes), "an int >= 1 or null (no cap)"),
            num_workers=(num_workers, whole(num_workers, 0), "an int >= 0"),
        )
        self.path = None if path is None else str(path)
        self.block_size = int(block_size)
        self.batch_size = int(batch_size)
        self.val_fraction = float(val_fraction)
        self.max_bytes = max_bytes
        self.num_workers = int(num_workers)
        self.drop_last = bool(drop_last)
        self.is_bin = self.path is not None and self.path.endswith(".bin")
        self.vocab_size: int | None = None if self.is_bin else 256
        self.train_dataset: TokenWindowDataset | None = None
        self.val_dataset: TokenWindowDataset | None = None

    # ------------------------------------------------------------------ loading
    def _describe(self) -> str:
        return "the standard library .py files" if self.path is None else repr(self.path)

    def _check_split(self, name: str, n: int, total: int) -> None:
        need = self.block_size + 1
        if n < need:
            frac = (1.0 - self.val_fraction) if name == "train" else self.val_fraction
            unit = "tokens" if self.is_bin else "bytes"
            raise ValueError(
                f"{name} split of {self._describe()} has {n} tokens but one window needs "
                f"block_size + 1 = {need}; the source gave {total} {unit}, at least "
                f"{int(np.ceil(need / frac))} {unit} are needed with val_fraction="
                f"{self.val_fraction} (raise max_bytes, add data or lower block_size)"
            )

    def _load_bin(self) -> None:
        p = Path(self.path)
        if not p.is_file():
            what = "is not a regular file" if p.exists() else "does not exist"
            raise FileNotFoundError(f"token file {self.path!r} {what}; expected a .bin file of uint16 token ids")
        size = p.stat().st_size
        if size == 0 or size % 2:
            raise ValueError(f"token file {self.path!r} has {size} bytes; expected a non-empty "
                             f"file of uint16 token ids (an even number of bytes)")
        tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        n = len(tokens)
        n_train = int(n * (1.0 - self.val_fraction))
        self._check_split("train", n_train, n)
        if self.val_fraction > 0:
            self._check_split("val", n - n_train, n)
        # Chunked max keeps the resident set small for very large files.
        step = 1 << 24
        self.vocab_size = int(max(int(tokens[i : i + step].max()) for i in range(0, n, step))) + 1
        del tokens
        self.train_dataset = TokenWindowDataset(None, self.block_size, bin_path=self.path,
                                                start=0, stop=n_train)
        self.val_dataset = (TokenWindowDataset(None, self.block_size, bin_path=self.path,
                                               start=n_train, stop=n)
                            if self.val_fraction > 0 else None)

    def _load_text(self) -> None:
        if self.path is None:
            data = read_stdlib_bytes(self.max_bytes)
        else:
            data = read_text_bytes(self.path, self.max_bytes)
        if not data:
            raise ValueError(f"no UTF-8 text found in {self._describe()}; expected a UTF-8 "
                             f"text file, a directory containing UTF-8 files, or a .bin file")
        tokens = np.frombuffer(data, dtype=np.uint8)
        n = len(tokens)
        n_train = int(n * (1.0 - self.val_fraction))
        self._check_split("train", n_train, n)
        if self.val_fraction > 0:
            self._check_split("val", n - n_train, n)
        self.vocab_size = 256
        self.train_dataset = TokenWindowDataset(tokens[:n_train], self.block_size)
        self.val_dataset = (TokenWindowDataset(tokens[n_train:], self.block_size)
                            if self.val_fraction > 0 else None)

    def setup(self, stage: str | None = None) -> None:
        """Load the token stream and build both splits (idempotent, no ``prepare_data`` needed)."""
        if self.train_dataset is not None:
            return
        if self.is_bin:
            self._load_bin()
        else:
            self._load_text()

    # -------------------------------------------------------------- dataloaders
    def train_dataloader(self) -> DataLoader:
        """Shuffled batches of ``(x, y)``, each int64 ``(batch_size, block_size)``.

        Under a Trainer, a :class:`~cg_lightning.examples.resumable.ResumableDataLoader` for this rank (the order
        Lightning's ``DistributedSampler`` would give): a run resumed from any step's checkpoint continues with the
        next batch of the same epoch, exactly as the uninterrupted run. Without a Trainer, a plain shuffled loader."""
        self.setup()
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return resumable_loader(self.train_dataset, trainer, batch_size=self.batch_size, drop_last=self.drop_last,
                                    num_workers=self.num_workers, persistent_workers=self.num_workers > 0)
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=self.drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader | list:
        """Validation batches in order (empty list when ``val_fraction == 0``)."""
        self.setup()
        if self.val_dataset is None:
            return []
        return DataLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            shuffle=False,
            drop_last=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
