"""Fine-tune a small random ``LlamaForCausalLM`` (no downloads) with ``transformers.Trainer``, through cg-lightning
(``CUDAGraphTrainer``) or (``--plain``) not, on random tokens: accumulation, clipping, evaluation and checkpoints.

CPU (graphs on the eager backend)::

    python examples/train_transformers.py --cpu --steps 20 --out /tmp/hf_run

One GPU, CUDA graphs, bf16; two GPUs with ``torchrun --nproc_per_node 2 examples/train_transformers.py ...``::

    python examples/train_transformers.py --bf16 --steps 100 --out /tmp/hf_run

The output directory receives the ``Trainer``'s checkpoints; ``--resume`` continues from the last one. Rank 0 prints
the loss every ``--log-every`` steps.
"""

from __future__ import annotations

import argparse

import torch
import transformers

from cg_lightning.transformers import CUDAGraphTrainer


#: model sizes: vocabulary, width, MLP width, layers, and the window length
SIZES = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, seq=32),
    "small": dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4, seq=128),
}


class RandomTokens(torch.utils.data.Dataset):
    """``n`` windows of ``seq`` random token ids, the labels the ids themselves (causal LM)."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the Trainer's output_dir (checkpoints)")
    ap.add_argument("--plain", action="store_true", help="transformers.Trainer itself, the reference")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    ap.add_argument("--size", choices=sorted(SIZES), default="small", help="tiny: a few seconds on a CPU")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    size = SIZES[a.size]
    seq = size.pop("seq")
    config = transformers.LlamaConfig(**size, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config)
    args = transformers.TrainingArguments(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=8, per_device_eval_batch_size=8,
        gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=3e-4, logging_steps=a.log_every,
        eval_strategy="steps", eval_steps=max(a.steps // 2, 1), save_steps=max(a.steps // 2, 1), report_to=[],
        use_cpu=a.cpu, bf16=a.bf16, seed=0, disable_tqdm=True)
    data = dict(train_dataset=RandomTokens(512, seq, config.vocab_size, 1),
                eval_dataset=RandomTokens(64, seq, config.vocab_size, 2))
    if a.plain:
        trainer = transformers.Trainer(model=model, args=args, **data)
    else:
        trainer = CUDAGraphTrainer(model=model, args=args, graphs={"warmup_steps": 2}, **data)
    trainer.train(resume_from_checkpoint=True if a.resume else None)


if __name__ == "__main__":
    main()
