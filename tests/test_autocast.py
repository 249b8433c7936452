"""Autocast around graphed layers: backward passes run outside autocast (as Lightning runs them), and
``CheckpointWithoutOutput`` recomputes under the forward's autocast settings. Found on an H200: a block
run with autocast disabled inside a bf16-mixed step got its weight gradients from bf16 GEMMs once its
backward graph was captured (inside the step's autocast), and the losses left "ddp" by 2e-3."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch import LightningModule, seed_everything

from cg_lightning import CheckpointWithoutOutput, SegmentError
from tests.helpers import cg_strategy, make_trainer, max_rel_diff, state_rel_diff, strategy_for
from tests.recorders import GradRecorder


class _AutocastProbe(torch.autograd.Function):
    """Identity that records, at every backward, whether CPU autocast is on."""

    seen = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _AutocastProbe.seen.append(torch.is_autocast_enabled("cpu"))
        return g


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(_AutocastProbe.apply(x))


class _Model(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        with torch.autocast("cpu", enabled=False):
            x = self.blocks[2](x.float())
        loss = F.mse_loss(self.head(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(6)]
        return torch.utils.data.DataLoader(data, batch_size=None)


def test_graphed_backward_runs_outside_autocast_like_eager():
    """bf16-mixed on CPU, eager graph backend (which runs the captured backward once at capture, inside the
    step's autocast): every backward of every block, in warmup, capture and replay, sees autocast off,
    exactly as under Lightning "ddp"; losses and weights equal "ddp" (1e-6)."""
    out = {}
    for name in ("ddp", "cg"):
        seed_everything(3)
        _AutocastProbe.seen = []
        model = _Model()
        rec = GradRecorder()
        make_trainer(strategy_for(name), 6, [rec], precision="bf16-mixed").fit(model)
        out[name] = (model, rec, list(_AutocastProbe.seen))
    (ref_model, ref, ref_seen), (model, rec, seen) = out["ddp"], out["cg"]
    assert ref_seen and not any(ref_seen)
    assert len(seen) > len(ref_seen)  # warmup and capture passes ran backwards too
    assert not any(seen), f"{sum(seen)} of {len(seen)} backward passes ran under autocast"
    assert max_rel_diff(rec.losses, ref.losses) < 1e-6
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-6


class _Checkpointed(nn.Module):
    def __init__(self, use_checkpoint: bool) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(16, 32), nn.GELU())
        self.proj = nn.Linear(32, 16)
        self.use_checkpoint = use_checkpoint

    def forward(self, x):
        if not self.use_checkpoint:
            return self.proj(self.inner(x))
        ckpt = CheckpointWithoutOutput()
        hidden = ckpt.checkpoint(self.inner, x)
        out = self.proj(hidden)
        ckpt.discard_output_and_register_recompute(out)
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_checkpoint_without_output_recomputes_under_the_forwards_autocast(dtype):
    """Forward under CPU autocast, backward outside it (the Lightning order): the recomputed output has the
    forward's dtype and values, so gradients equal those of the same module without checkpointing
    (exactly: the same kernels run). Without re-entering autocast the recomputation ran in fp32 and its
    bytes were copied into the bf16 output's storage."""
    torch.manual_seed(0)
    plain = _Checkpointed(False)
    ckpt = _Checkpointed(True)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(4, 16)
    grads = []
    for m in (plain, ckpt):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=dtype):
            out = m(xi)
        assert out.dtype == dtype
        out.float().square().sum().backward()
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


class _SwitchesAutocast(LightningModule):
    """blocks.2 runs with autocast off during the first 4 steps, under the step's bf16 autocast afterwards
    (or the other way round): same arguments (the residual stream stays fp32), other kernels."""

    def __init__(self, reverse: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(16, 1)
        self.reverse = reverse

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = self.blocks[1](self.blocks[0](x))
        fp32 = (self.global_step < 4) != self.reverse
        with torch.autocast("cpu", enabled=not fp32):
            x = self.blocks[2](x.float())
        loss = F.mse_loss(self.head(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return _Model.train_dataloader(self)


@pytest.mark.parametrize("reverse", [False, True], ids=["off-then-on", "on-then-off"])
def test_a_call_whose_autocast_changed_after_capture_does_not_replay(reverse):
    """A graph replays the kernels of its capture: when a block's autocast settings change after capture,
    that call follows the shape policy (here "eager": one warning naming the layer and both settings) and
    training equals "ddp" (1e-6). Before, it replayed under the old settings, 1.3e-3 off without a word."""
    out = {}
    for name in ("ddp", "cg"):
        seed_everything(3)
        model = _SwitchesAutocast(reverse)
        rec = GradRecorder()
        trainer = make_trainer(strategy_for(name, segments=False), 8, [rec], precision="bf16-mixed")
        if name == "cg":
            with pytest.warns(UserWarning, match=r"'blocks\.2'.*autocast: captured (disabled|enabled for cpu "
                                                 r"bfloat16), got (enabled for cpu bfloat16|disabled)"):
                trainer.fit(model)
        else:
            trainer.fit(model)
        out[name] = (model, rec, trainer)
    (ref_model, ref, _), (model, rec, trainer) = out["ddp"], out["cg"]
    stats = trainer.strategy.last_graph_stats
    assert stats.fallback_calls == 8 - 4  # blocks.2 from step 4 on
    assert stats.forward_replays == 3 * (4 - 2) + 2 * (8 - 4)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-6
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-6


def test_autocast_change_inside_a_segment_after_capture_is_an_error_naming_the_layer():
    """With segments (the default) blocks 0-2 chain into one segment whose graphs already ran for the pass
    when blocks.2 is called under other autocast settings: it cannot fall back alone, so ``SegmentError``
    names the layer and both settings, instead of replaying the old kernels."""
    seed_everything(3)
    trainer = make_trainer(cg_strategy(), 8, precision="bf16-mixed")
    match = r"(?s)'blocks\.2'.*autocast: captured disabled, got enabled for cpu bfloat16"
    with pytest.raises(SegmentError, match=match):
        trainer.fit(_SwitchesAutocast(False))
