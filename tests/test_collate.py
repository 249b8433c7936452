"""Bucketed padding (:mod:`cg_lightning.collate`) and variable-length text under the strategy.

The helper is checked on raw examples and on collated dicts (the output of transformers' collators). The training
runs fit a tiny random ``LlamaForCausalLM`` (no downloads) on batches of varying length through
``DataCollatorForLanguageModeling`` and ``pad_to_multiple``, under ``shape_policy="recapture"``, against
Lightning's ``"ddp"`` on the same data: weights equal bit for bit (eager backend on CPU: replays run the same
kernels), and graph counters equal to those the documented recapture schedule gives for the step lengths.
"""

import warnings

import pytest
import torch
from lightning.pytorch import LightningModule, seed_everything
from torch.utils.data import DataLoader

from cg_lightning import pad_to_multiple
from tests.helpers import cg_strategy, make_trainer

try:
    import transformers
except ImportError:  # the helper's own tests still run
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers is not installed")


# ------------------------------------------------------------------------------------------------ the helper
def test_raw_examples_are_padded_to_the_next_multiple():
    collate = pad_to_multiple(8, pad_id=5)
    batch = collate([{"input_ids": [1, 2, 3], "labels": [1, 2, 3], "label": 0},
                     {"input_ids": torch.arange(10), "labels": list(range(10)), "label": 1}])
    assert batch["input_ids"].shape == (2, 16) and batch["input_ids"].dtype == torch.long
    assert batch["input_ids"][0].tolist() == [1, 2, 3] + [5] * 13
    assert batch["input_ids"][1].tolist() == list(range(10)) + [5] * 6
    assert batch["labels"][0].tolist() == [1, 2, 3] + [-100] * 13
    assert batch["attention_mask"].tolist() == [[1] * 3 + [0] * 13, [1] * 10 + [0] * 6]  # made: none was given
    assert batch["label"].tolist() == [0, 1]  # default_collate
    empty = pad_to_multiple(4)([{"input_ids": []}, {"input_ids": [4]}])
    assert empty["input_ids"].dtype == torch.long and empty["input_ids"].tolist() == [[0] * 4, [4, 0, 0, 0]]


def test_collated_dicts_are_padded_further_keeping_dtype():
    inner = lambda examples: {  # noqa: E731  (what a pad-to-longest collator returns)
        "input_ids": torch.tensor([[7, 8, 9], [7, 8, 0]], dtype=torch.int32),
        "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "labels": torch.tensor([[7, 8, 9], [7, 8, -100]]),
        "meta": "kept",
    }
    batch = pad_to_multiple(4, collate_fn=inner)([None, None])
    assert batch["input_ids"].dtype == torch.int32 and batch["input_ids"].tolist() == [[7, 8, 9, 0], [7, 8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[7, 8, 9, -100], [7, 8, -100, -100]]
    assert batch["meta"] == "kept"
    left = pad_to_multiple(4, padding_side="left", pad_id=3, collate_fn=inner)([None])
    assert left["input_ids"].tolist() == [[3, 7, 8, 9], [3, 7, 8, 0]]
    assert left["labels"].tolist() == [[-100, 7, 8, 9], [-100, 7, 8, -100]]


def test_max_length_caps_the_last_bucket_and_refuses_longer_sequences():
    collate = pad_to_multiple(8, max_length=28)
    assert collate.num_lengths == 4  # 8, 16, 24, 28
    assert [collate.padded_length(n) for n in (1, 8, 9, 24, 25, 28)] == [8, 8, 16, 24, 28, 28]
    with pytest.raises(ValueError, match=r"a sequence of 29 tokens exceeds max_length=28; truncate"):
        collate([{"input_ids": [1] * 29}])
    with pytest.raises(ValueError, match=r"exceeds max_length=28"):
        collate({"input_ids": torch.ones(2, 29, dtype=torch.long)})
    assert pad_to_multiple(8).num_lengths is None


def test_argument_and_batch_errors():
    with pytest.raises(ValueError, match=r"multiple must be >= 1, got 0"):
        pad_to_multiple(0)
    with pytest.raises(TypeError, match=r"max_length must be an int"):
        pad_to_multiple(8, max_length=12.5)
    with pytest.raises(ValueError, match=r"padding_side must be one of"):
        pad_to_multiple(8, padding_side="middle")
    collate = pad_to_multiple(8)
    with pytest.raises(TypeError, match=r"expected a list of examples"):
        collate(torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"differ in length \(dim 1\)"):
        collate({"input_ids": torch.ones(2, 3), "attention_mask": torch.ones(2, 4)})
    with pytest.raises(ValueError, match=r"example 0: 'labels' has 2 entries, 'input_ids' 3"):
        collate([{"input_ids": [1, 2, 3], "labels": [1, 2]}])
    with pytest.raises(ValueError, match=r"has none of"):
        collate({"pixels": torch.ones(2, 3)})


# ------------------------------------------------------------------------------------------------ training
MULTIPLE, MAX_LENGTH, BATCH = 8, 32, 4
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)


def _tokenizer():
    """A word-level tokenizer built in memory (pad id 0): what ``DataCollatorForLanguageModeling`` needs."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, LLAMA["vocab_size"])}}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(WordLevel(vocab, "[UNK]")),
                                                pad_token="[PAD]", unk_token="[UNK]")


class Llama(LightningModule):
    """A random tiny ``LlamaForCausalLM``; ``use_cache=False``: a cache object per step is another signature."""

    def __init__(self):
        super().__init__()
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))

    def training_step(self, batch, batch_idx):
        return self.model(**batch, use_cache=False).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _examples(buckets, seed=0):
    """``BATCH`` examples per entry of ``buckets``: ``(padded length, full)``. A full batch's rows all have that
    length (no padding at all, as truncated text gives); otherwise the longest row is 1..MULTIPLE tokens short
    of it at most and the others are shorter."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for length, full in buckets:
        longest = length if full else int(torch.randint(length - MULTIPLE + 1, length + 1, (1,), generator=g))
        rows = [longest] + [longest if full else int(torch.randint(1, length, (1,), generator=g))
                            for _ in range(BATCH - 1)]
        examples += [{"input_ids": torch.randint(2, LLAMA["vocab_size"], (n,), generator=g).tolist()} for n in rows]
    return examples


def _fit(strategy, examples, steps):
    seed_everything(0)
    module = Llama()
    collate = pad_to_multiple(MULTIPLE, max_length=MAX_LENGTH,
                              collate_fn=transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False))
    loader = DataLoader(examples, batch_size=BATCH, shuffle=False, collate_fn=collate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # no DistributedSampler: "ddp" would shuffle the training batches, and the steps' lengths are chosen here
        make_trainer(strategy, steps, use_distributed_sampler=False).fit(module, loader)
    return module, [str(w.message) for w in caught if "cg_lightning" in str(w.message)]


def _recapture_schedule(kinds, warmup, limit, layers):
    """(graph sets, replays, eager calls after warmup) of the recapture schedule (docs/usage.md): warmup
    steps run eagerly and the last one's kind waits to be captured; afterwards a step of a captured kind
    replays, one of a waiting kind is captured and replays, a new kind is recorded (eager) and waits, while
    captured and waiting kinds are fewer than ``limit``; beyond that it runs eagerly."""
    captured, waiting = [], [kinds[warmup - 1]]
    replays = fallbacks = 0
    for kind in kinds[warmup:]:
        if kind in waiting:
            waiting.remove(kind)
            captured.append(kind)
        if kind in captured:
            replays += layers
        else:
            if len(captured) + len(waiting) < limit:
                waiting.append(kind)
            fallbacks += layers
    return len(captured), replays, fallbacks


def _assert_equal_weights(module, reference):
    for (name, p), q in zip(module.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(p, q), name


# each padded length (every batch with padding) occurs again after its first step
PADDED = [(32, 0), (16, 0), (24, 0), (16, 0), (8, 0), (24, 0), (8, 0), (32, 0), (16, 0), (32, 0), (24, 0), (8, 0)]


@needs_transformers
def test_variable_length_llama_one_graph_set_per_padded_length():
    """Four padded lengths, graphs.max_graph_sets=collate.num_lengths=4: four graph sets, every step replays
    from the second step of its length on, no warning, weights equal to "ddp" bit for bit."""
    examples = _examples(PADDED)
    longest = {max(len(e["input_ids"]) for e in examples[i:i + BATCH]) for i in range(0, len(examples), BATCH)}
    assert len(longest) > 4  # padded to the longest only, the steps would have more lengths than that
    steps, warmup = len(PADDED), 2
    reference, _ = _fit("ddp", examples, steps)
    strategy = cg_strategy("eager", whole_step=False, warmup_steps=warmup, shape_policy="recapture", max_graph_sets=4)
    module, messages = _fit(strategy, examples, steps)
    _assert_equal_weights(module, reference)
    assert not [m for m in messages if "eagerly" in m], messages
    stats, layers = strategy.last_graph_stats, LLAMA["num_hidden_layers"]
    sets, replays, fallbacks = _recapture_schedule([length for length, _ in PADDED], warmup, 4, layers)
    assert stats.graph_sets == sets == 4 == len({length for length, _ in PADDED})
    assert stats.captured_runners == 4 * layers
    assert stats.forward_replays == replays == 7 * layers  # 12 steps: 2 warmup, 3 recorded, 7 replayed
    assert stats.fallback_calls == fallbacks == 3 * layers


@needs_transformers
def test_batches_without_padding_and_more_kinds_than_graph_sets():
    """Full batches of the longest length (no padding: transformers' sdpa attention then passes no mask, another
    signature) make a fifth kind of step; with graphs.max_graph_sets=4 its steps run eagerly, one warning, and the
    weights still equal "ddp" bit for bit."""
    buckets = PADDED[:8] + [(32, 1), (32, 0), (32, 1), (16, 0)]
    examples = _examples(buckets, seed=1)
    steps, warmup = len(buckets), 2
    reference, _ = _fit("ddp", examples, steps)
    strategy = cg_strategy("eager", whole_step=False, warmup_steps=warmup, shape_policy="recapture", max_graph_sets=4)
    module, messages = _fit(strategy, examples, steps)
    _assert_equal_weights(module, reference)
    full = [m for m in messages if "max_graph_sets=4" in m]
    assert len(full) == 1 and "Tensor[4, 32, 32] float32 on cpu, requires_grad; None;" in full[0], messages
    stats, layers = strategy.last_graph_stats, LLAMA["num_hidden_layers"]
    sets, replays, fallbacks = _recapture_schedule(buckets, warmup, 4, layers)
    assert stats.graph_sets == sets == 4
    assert stats.forward_replays == replays and stats.fallback_calls == fallbacks
    assert replays == 5 * layers and fallbacks == 5 * layers  # recorded: 2, 4, 7; full cache: 8, 10


@needs_transformers
def test_bucketed_padding_leaves_the_llama_loss_unchanged():
    """The loss of a batch padded to the longest sequence and of the same batch padded to a multiple of 8 agree
    to 1e-6 (relative): padded positions carry attention_mask 0 and labels -100."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()
    tok = _tokenizer()
    examples = [{"input_ids": list(range(2, 2 + n))} for n in (13, 5, 9, 2, 7, 3, 6, 1)]  # longest 13 and 7
    longest = transformers.DataCollatorForLanguageModeling(tok, mlm=False)
    bucketed = pad_to_multiple(MULTIPLE, collate_fn=longest)
    with torch.no_grad():
        for i in (0, BATCH):
            a, b = longest(examples[i:i + BATCH]), bucketed(examples[i:i + BATCH])
            assert a["input_ids"].shape[1] in (13, 7) and b["input_ids"].shape[1] == (16 if i == 0 else 8)
            torch.testing.assert_close(model(**b).loss, model(**a).loss, rtol=1e-6, atol=0)
