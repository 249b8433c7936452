"""Accelerate training loops that plain ``accelerate.Accelerator`` and ``CUDAGraphAccelerator`` must run alike.

Each case trains a small model (an embedding, two graphed blocks, a head; with ``bn`` a BatchNorm on the
transposed activations in front of the blocks, so the blocks take and return non-contiguous tensors) on
fixed data, and returns what the test compares: losses, what the loop saw in ``p.grad``, buffers, weights.

* ``two_optimizers``: SGD over the embedding and head, Adam over the blocks, ``o1.step(); o1.zero_grad();
  o2.step(); o2.zero_grad()``.
* ``microbatch_grads``: gradient accumulation 2; after every ``accelerator.backward`` the loop reads the
  gradient norm, clips it with ``accelerator.clip_grad_norm_`` and halves every gradient in place.
* ``gan``: a generator and a discriminator, the generator's output detached in the discriminator's loss.
* ``bn``: the BatchNorm model, an eval forward after every step (running statistics matter); under torchrun
  each rank gets its own data shard, so only ``ddp.broadcast_buffers`` keeps the ranks' statistics equal.

In-process: ``run(kind, case, device)``. Under torchrun: ``python tests/scripts/accelerate_cases.py KIND CASE
OUT`` writes ``OUT.rankR`` (``torch.save`` of the result).
"""

from __future__ import annotations

import sys
from typing import Dict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

V, D, T = 50, 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.bn = nn.BatchNorm1d(D) if bn else None
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if self.bn is not None:
            h = self.bn(h.transpose(1, 2)).transpose(1, 2)  # (B, T, D) with strides of a (B, D, T) tensor
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V).float(), y.reshape(-1))


def _data(n: int, seed: int = 123) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g))


def _accelerator(kind: str, device: str, **kwargs):
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    if kind == "cg":
        from cg_lightning.accelerate import CUDAGraphAccelerator

        backend = "cuda" if device == "cuda" else "eager"
        return CUDAGraphAccelerator(cpu=device == "cpu", graphs={"warmup_steps": 2, "backend": backend}, **kwargs)
    from accelerate import Accelerator

    return Accelerator(cpu=device == "cpu", **kwargs)


def _result(acc, model, losses, seen=None) -> Dict[str, object]:
    raw = acc.unwrap_model(model)
    return {
        "losses": losses,
        "seen": seen or [],
        "state": {k: v.detach().float().cpu().clone() for k, v in raw.state_dict().items()},
        "replays": getattr(getattr(model, "graph_stats", None), "forward_replays", None),
    }


def two_optimizers(kind: str, device: str, steps: int = 6) -> Dict[str, object]:
    acc = _accelerator(kind, device)
    torch.manual_seed(0)
    model = Net()
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks")]
    o1, o2 = torch.optim.SGD(rest, lr=0.1), torch.optim.Adam(blocks, lr=1e-2)
    model, o1, o2, loader = acc.prepare(model, o1, o2, DataLoader(_data(4 * steps), batch_size=4))
    losses = []
    for x, y in loader:
        loss = _loss(model(x), y)
        acc.backward(loss)
        o1.step()
        o1.zero_grad()
        o2.step()
        o2.zero_grad()
        losses.append(float(loss.detach()))
    return _result(acc, model, losses)


def microbatch_grads(kind: str, device: str, steps: int = 6) -> Dict[str, object]:
    acc = _accelerator(kind, device, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(_data(8 * steps), batch_size=4))
    losses, seen = [], []
    for x, y in loader:
        with acc.accumulate(model):
            loss = _loss(model(x), y)
            acc.backward(loss)
            grads = [p.grad for p in model.parameters()]
            seen.append(float(torch.stack([g.norm() for g in grads]).norm()) if all(
                g is not None for g in grads) else float("nan"))
            acc.clip_grad_norm_(model.parameters(), 0.5)
            for g in grads:
                if g is not None:
                    g.mul_(0.5)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return _result(acc, model, losses, seen)


def bn(kind: str, device: str, steps: int = 6) -> Dict[str, object]:
    acc = _accelerator(kind, device)
    torch.manual_seed(0)
    model = Net(bn=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _data(4 * steps * max(1, acc.num_processes))
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(data, batch_size=4))
    x_eval, y_eval = (t.to(acc.device) for t in _data(4, seed=7).tensors)
    losses, seen = [], []
    for x, y in loader:
        loss = _loss(model(x), y)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        model.eval()
        with torch.no_grad():
            seen.append(float(_loss(model(x_eval), y_eval)))
        model.train()
    return _result(acc, model, losses, seen)


class Mlp(nn.Module):
    """A vector-to-vector model with two graphed blocks (a GAN's generator or discriminator)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, D)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.out = nn.Linear(D, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def gan(kind: str, device: str, steps: int = 6) -> Dict[str, object]:
    """Two prepared models, one optimizer each; the generator's forward feeds the discriminator's loss detached
    (no gradient reaches it there), then the generator's loss through the discriminator. Each optimizer's
    gradients are zeroed before its backward, as GAN loops do."""
    acc = _accelerator(kind, device)
    torch.manual_seed(0)
    gen, disc = Mlp(8, 16), Mlp(16, 1)
    o_gen, o_disc = torch.optim.Adam(gen.parameters(), lr=1e-3), torch.optim.Adam(disc.parameters(), lr=1e-3)
    gen, disc, o_gen, o_disc = acc.prepare(gen, disc, o_gen, o_disc)
    g = torch.Generator().manual_seed(5)
    bce = F.binary_cross_entropy_with_logits
    losses = []
    for _ in range(steps):
        z, real = torch.randn(4, 8, generator=g).to(acc.device), torch.randn(4, 16, generator=g).to(acc.device)
        ones, zeros = torch.ones(4, 1, device=acc.device), torch.zeros(4, 1, device=acc.device)
        fake = gen(z)
        o_disc.zero_grad()
        d_loss = bce(disc(real), ones) + bce(disc(fake.detach()), zeros)
        acc.backward(d_loss)
        o_disc.step()
        o_gen.zero_grad()
        g_loss = bce(disc(fake), ones)
        acc.backward(g_loss)
        o_gen.step()
        losses.extend([float(d_loss.detach()), float(g_loss.detach())])
    result = _result(acc, gen, losses)
    result["state"].update({f"disc.{k}": v for k, v in _result(acc, disc, [])["state"].items()})
    return result


CASES = {"two_optimizers": two_optimizers, "microbatch_grads": microbatch_grads, "bn": bn, "gan": gan}


def run(kind: str, case: str, device: str = "cpu") -> Dict[str, object]:
    """Train ``case`` under ``kind`` (``"cg"`` or ``"eager"``, plain Accelerate) on ``device``."""
    return CASES[case](kind, device)


if __name__ == "__main__":
    import os

    import torch.distributed as dist

    kind, case, out = sys.argv[1:4]
    result = run(kind, case, "cuda" if torch.cuda.is_available() else "cpu")
    torch.save(result, f"{out}.rank{os.environ.get('RANK', '0')}")
    if dist.is_initialized():
        # a gloo group still alive at interpreter exit can abort the process on recent torch ("terminate called
        # without an active exception"), with plain Accelerate too
        dist.barrier()
        dist.destroy_process_group()
