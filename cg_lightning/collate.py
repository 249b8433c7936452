"""Bucketed padding of variable-length token batches, so graphed layers see a bounded set of shapes.

A graph replays only calls shaped like the one it was captured for. Text batches padded to their longest
sequence (dynamic padding) have a new length almost every step: under ``graphs.shape_policy="eager"`` the graphs
never replay, under ``"recapture"`` the graph sets run out. :func:`pad_to_multiple` pads the sequence dimension
further, up to the next multiple of ``multiple`` (capped at ``max_length``), so a run sees at most
``ceil(max_length / multiple)`` lengths, each one graph set. Padding lengths to a multiple is what the
``pad_to_multiple_of`` argument of Hugging Face transformers' ``DataCollatorWithPadding`` and
``tokenizer.pad`` does (there, to fill tensor cores); bucketing sequences by padded length is long-standing
practice in sequence-model training (e.g. ``tf.data``'s ``bucket_by_sequence_length``).

Only torch is imported; the helper works on plain lists of token ids or on the dicts a transformers collator
returns. Padding does not change a causal language model's loss: padded positions have ``attention_mask`` 0 and
``labels`` -100, which the loss ignores.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Dict, Optional

import torch
from torch.utils.data import default_collate

PADDING_SIDES = ("right", "left")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"pad_to_multiple: {name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"pad_to_multiple: {name} must be >= {minimum}, got {value}")


class PadToMultiple:
    """A ``collate_fn`` that pads the sequence dimension (dim 1) up to a multiple of ``multiple``.

    Built by :func:`pad_to_multiple`, which documents the arguments. Picklable (DataLoader workers).

    Attributes:
        pad_values: key -> value that key is padded with; keys not in it pass through unchanged.
        num_lengths: how many distinct padded lengths it can produce, ``ceil(max_length / multiple)``
            (``None`` without ``max_length``): the value to give ``graphs.max_graph_sets``.
    """

    def __init__(self, multiple: int = 64, *, max_length: Optional[int] = None, pad_id: int = 0,
                 label_pad: int = -100, collate_fn: Optional[Callable[[list], Any]] = None,
                 padding_side: str = "right", pad_values: Optional[Mapping[str, Any]] = None) -> None:
        _check_int("multiple", multiple, 1)
        if max_length is not None:
            _check_int("max_length", max_length, 1)
        if padding_side not in PADDING_SIDES:
            raise ValueError(f"pad_to_multiple: padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")
        self.multiple = multiple
        self.max_length = max_length
        self.collate_fn = collate_fn
        self.padding_side = padding_side
        self.pad_values: Dict[str, Any] = {
            "input_ids": pad_id, "attention_mask": 0, "labels": label_pad, "token_type_ids": 0,
            "special_tokens_mask": 1,  # transformers marks padding as special tokens
        }
        self.pad_values.update(pad_values or {})

    @property
    def num_lengths(self) -> Optional[int]:
        return None if self.max_length is None else math.ceil(self.max_length / self.multiple)

    def padded_length(self, length: int) -> int:
        """The length a batch whose longest sequence has ``length`` tokens is padded to.

        Raises:
            ValueError: ``length`` exceeds ``max_length``.
        """
        if self.max_length is not None and length > self.max_length:
            raise ValueError(
                f"pad_to_multiple: a sequence of {length} tokens exceeds max_length={self.max_length}; truncate "
                f"when tokenizing (e.g. tokenizer(..., truncation=True, max_length={self.max_length})) or raise "
                "max_length")
        target = max(1, math.ceil(length / self.multiple)) * self.multiple
        return target if self.max_length is None else min(target, self.max_length)

    def __call__(self, examples: Any) -> Dict[str, Any]:
        if self.collate_fn is not None:
            examples = self.collate_fn(examples)
        if isinstance(examples, Mapping):
            return self.pad(examples)
        if isinstance(examples, Sequence) and examples and all(isinstance(e, Mapping) for e in examples):
            return self._from_examples(list(examples))
        raise TypeError(
            "pad_to_multiple: expected a list of examples (dicts of token-id lists or 1-D tensors) or a collated "
            f"dict of tensors (e.g. from collate_fn=DataCollatorWithPadding(...)), got {type(examples).__name__}")

    def pad(self, batch: Mapping) -> Dict[str, Any]:
        """Pad a collated batch: every tensor under a key of :attr:`pad_values`, shape ``[B, L, ...]``, to
        ``[B, padded_length(L), ...]``, same dtype and device. Other entries are returned as they are.

        Raises:
            ValueError: no key of :attr:`pad_values` holds a tensor of at least 2 dimensions, those tensors
                disagree on ``L``, or ``L`` exceeds ``max_length``.
        """
        keys = [k for k in self.pad_values if isinstance(batch.get(k), torch.Tensor) and batch[k].dim() >= 2]
        if not keys:
            raise ValueError(f"pad_to_multiple: the batch has none of {sorted(self.pad_values)} as a [batch, "
                             f"length] tensor; its keys: {sorted(batch)}")
        lengths = {k: batch[k].shape[1] for k in keys}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"pad_to_multiple: the sequence tensors differ in length (dim 1): {lengths}")
        target = self.padded_length(lengths[keys[0]])
        out = dict(batch)
        for k in keys:
            out[k] = self._pad_tensor(batch[k], target, self.pad_values[k])
        return out

    def _pad_tensor(self, t: torch.Tensor, target: int, value: Any) -> torch.Tensor:
        missing = target - t.shape[1]
        if missing == 0:
            return t
        fill = torch.full((t.shape[0], missing, *t.shape[2:]), value, dtype=t.dtype, device=t.device)
        return torch.cat([t, fill] if self.padding_side == "right" else [fill, t], dim=1)

    def _from_examples(self, examples: list) -> Dict[str, Any]:
        """Collate examples whose sequences (lists of ints or 1-D tensors) differ in length, straight to the
        padded length; ``attention_mask`` is made (1 on tokens, 0 on padding) when the examples have none."""
        keys = [k for k in self.pad_values if k in examples[0]]
        if not keys:
            raise ValueError(f"pad_to_multiple: the examples have none of {sorted(self.pad_values)}; their keys: "
                             f"{sorted(examples[0])}")
        for i, e in enumerate(examples):
            for k in keys:
                if k not in e:
                    raise ValueError(f"pad_to_multiple: example {i} has no {k!r} (example 0 has)")
                if len(e[k]) != len(e[keys[0]]):
                    raise ValueError(f"pad_to_multiple: example {i}: {k!r} has {len(e[k])} entries, "
                                     f"{keys[0]!r} {len(e[keys[0]])}")
        target = self.padded_length(max(len(e[keys[0]]) for e in examples))
        out: Dict[str, Any] = {}
        for k in keys:
            rows = [torch.as_tensor(e[k]) for e in examples]
            floating = [r for r in rows if r.is_floating_point() and r.numel()]  # an empty list reads as float
            dtype = floating[0].dtype if floating else torch.long
            out[k] = torch.stack([self._pad_tensor(r.to(dtype).unsqueeze(0), target, self.pad_values[k])[0]
                                  for r in rows])
        if "attention_mask" not in out and "attention_mask" in self.pad_values:
            ones = [torch.ones(1, len(e[keys[0]]), dtype=torch.long) for e in examples]
            out["attention_mask"] = torch.cat([self._pad_tensor(o, target, self.pad_values["attention_mask"])
                                               for o in ones])
        for k in examples[0]:
            if k not in out:
                out[k] = default_collate([e[k] for e in examples])
        return out


def pad_to_multiple(multiple: int = 64, *, max_length: Optional[int] = None, pad_id: int = 0,
                    label_pad: int = -100, collate_fn: Optional[Callable[[list], Any]] = None,
                    padding_side: str = "right", pad_values: Optional[Mapping[str, Any]] = None) -> PadToMultiple:
    """A DataLoader ``collate_fn`` padding token batches to a length that is a multiple of ``multiple``.

    ``DataLoader(ds, batch_size=8, collate_fn=pad_to_multiple(64, max_length=512, pad_id=tok.pad_token_id))``
    takes examples that are dicts of token-id lists or 1-D tensors (``input_ids``, optionally
    ``attention_mask``, ``labels``, ...). With ``collate_fn=DataCollatorWithPadding(tok)`` (or
    ``DataCollatorForLanguageModeling``) it pads that collator's output dict further.

    Returns a dict: ``input_ids`` ``[B, L]`` padded with ``pad_id``, ``attention_mask`` ``[B, L]`` with 0 (made,
    int64, from raw examples that have none), ``labels`` with ``label_pad``, ``token_type_ids`` with 0,
    ``special_tokens_mask`` with 1; ``L = min(ceil(longest / multiple) * multiple, max_length)``. Sequences of raw
    examples become int64 (floating ones keep their dtype); collated tensors keep their dtype and device. Other keys: ``default_collate`` (raw
    examples) or unchanged (collated dicts). ``pad_values`` adds or overrides key -> pad value.
    ``padding_side="left"`` puts the padding first. The result's ``num_lengths`` is the bound on distinct
    lengths, ``ceil(max_length / multiple)``, for ``graphs.max_graph_sets``.

    Raises:
        TypeError: ``multiple``/``max_length`` not ints; at a call, a batch that is neither a list of dicts nor a
            dict.
        ValueError: ``multiple`` or ``max_length`` below 1, an unknown ``padding_side``; at a call, a sequence
            longer than ``max_length`` (truncate when tokenizing), sequences of one example or keys of a
            collated batch that differ in length, or no paddable key in the batch.
    """
    return PadToMultiple(multiple, max_length=max_length, pad_id=pad_id, label_pad=label_pad,
                         collate_fn=collate_fn, padding_side=padding_side, pad_values=pad_values)
