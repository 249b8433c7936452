"""Lightning features under ``strategy="cudagraph_ddp"`` against Lightning's ``"ddp"``.

Precision plugins, gradient clipping, LR schedulers, parameter groups, gradient accumulation, validation
during fit, the sanity check and ``trainer.validate/test/predict`` after fit: each run twice from the same
seed on the same data, once under ``"ddp"`` and once under ``"cudagraph_ddp"`` (eager graph backend on
CPU), and compared value by value. Tiny GPT (2 blocks, d=32), a few steps each.
"""

from __future__ import annotations

import sys

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.plugins import MixedPrecision

from cg_lightning.examples.gpt import GPTLightningModule
from tests.helpers import (
    DEVICES, MODEL, N_LAYER, WARMUP, EvalGPT, fit_gpt, max_rel_diff, state_rel_diff, strategy_for, train_subprocess,
)
from tests.recorders import LifecycleRecorder


def _fit(strategy_name: str, steps: int = 8, backend: str = "eager", **kwargs):
    """Fit the tiny GPT under ``"ddp"`` or ``"cudagraph_ddp"``; returns (model, GradRecorder, trainer, data)."""
    return fit_gpt(strategy_for(strategy_name, backend, whole_step=False), steps, **kwargs)  # per-layer graphs


def _print_diffs(rec, ref, model, ref_model) -> None:
    """Print the measured differences (``pytest -s``) under the calling test's name."""
    print(f"{sys._getframe(1).f_code.co_name}: max rel loss diff {max_rel_diff(rec.losses, ref.losses):.1e}, "
          f"rel weight diff {state_rel_diff(model.state_dict(), ref_model.state_dict()):.1e}")


def _stats(trainer):
    return trainer.strategy.last_graph_stats


def _assert_replayed(trainer, steps: int, micro_batches_per_step: int = 1) -> None:
    stats = _stats(trainer)
    assert stats.captured_runners == N_LAYER
    assert stats.forward_replays == N_LAYER * micro_batches_per_step * (steps - WARMUP)


# ---------------------------------------------------------------------------------------------- precision


_PROBE: list = []


class _ProbeLayerNorm(torch.nn.LayerNorm):
    """``blocks.0.ln1`` with a forward (not a hook: hooks inside a graphed layer are refused) that records,
    per call in a training step: (phase, autocast on, autocast dtype, autocast cache on). Phase: "eager"
    (a warmup step), "capture" (the first step after warmup, before its graphs exist: the manager's
    warmup, probe and capture passes) or "replay"."""

    trainer = None  # set by _ProbeStart

    def forward(self, x):
        trainer = type(self).trainer
        manager = getattr(trainer.strategy, "graph_manager", None) if trainer is not None else None
        if manager is not None and self.training and torch.is_grad_enabled():
            if manager.captured:
                phase = "replay"
            else:
                phase = "eager" if trainer.global_step < WARMUP else "capture"
            _PROBE.append((phase, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                           torch.is_autocast_cache_enabled()))
        return super().forward(x)


class _ProbeStart(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        _ProbeLayerNorm.trainer = trainer

    def on_train_end(self, trainer, pl_module) -> None:
        _ProbeLayerNorm.trainer = None


def _probed_gpt(**kwargs):
    model = GPTLightningModule(**kwargs)
    model.model.blocks[0].ln1.__class__ = _ProbeLayerNorm  # same parameters, same init
    return model


class _CachedAutocast(MixedPrecision):
    """bf16-mixed with autocast's weight-cast cache ON (Lightning 2.6 turns it off): capture must not
    depend on that setting."""

    def autocast_context_manager(self):
        return torch.autocast(self.device, dtype=torch.bfloat16, cache_enabled=True)


@pytest.mark.cuda
def test_cached_autocast_plugin_with_real_graphs():
    """The cache-on bf16 autocast plugin on a GPU with real CUDA graphs: a cast cached during capture would
    replay stale bf16 weights after the first optimizer step, so parity with "ddp" (same plugin, 1e-2) over
    steps that update the weights is what shows the capture ran with the cache off."""
    steps = 8
    ref_model, ref, _, _ = _fit("ddp", steps, accelerator="gpu", plugins=[_CachedAutocast("bf16-mixed", "cuda")])
    model, rec, trainer, _ = _fit("cg", steps, accelerator="gpu", backend="cuda",
                                  plugins=[_CachedAutocast("bf16-mixed", "cuda")])
    _assert_replayed(trainer, steps)
    assert _stats(trainer).backend == "cuda"
    _print_diffs(rec, ref, model, ref_model)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-2
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-2


def test_bf16_mixed_parity():
    """precision="bf16-mixed" (CPU autocast, bf16): losses and weights equal "ddp" within 1e-2 (measured: 0),
    and the graphed blocks' replays really run under bf16 autocast."""
    steps = 8
    ref_model, ref, _, _ = _fit("ddp", steps, model_cls=_probed_gpt, precision="bf16-mixed")
    _PROBE.clear()
    model, rec, trainer, _ = _fit("cg", steps, model_cls=_probed_gpt, precision="bf16-mixed", callbacks=[_ProbeStart()])
    _assert_replayed(trainer, steps)
    replays = [p for p in _PROBE if p[0] == "replay"]
    assert len(replays) == steps - WARMUP
    assert all(p[1] and p[2] == torch.bfloat16 for p in replays), replays
    _print_diffs(rec, ref, model, ref_model)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-2
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-2


def test_capture_disables_a_cached_autocast():
    """A precision plugin whose autocast keeps its weight-cast cache on (as other Lightning versions did):
    eager steps see the cache on, the capture itself runs with it off (a cached cast must not be baked into
    a graph), and training equals "ddp" with the same plugin within 1e-2."""
    steps = 6
    ref_model, ref, _, _ = _fit("ddp", steps, model_cls=_probed_gpt, plugins=[_CachedAutocast("bf16-mixed", "cpu")])
    _PROBE.clear()
    model, rec, trainer, _ = _fit("cg", steps, model_cls=_probed_gpt, callbacks=[_ProbeStart()],
                                  plugins=[_CachedAutocast("bf16-mixed", "cpu")])
    _assert_replayed(trainer, steps)
    eager = [p for p in _PROBE if p[0] == "eager"]
    during_capture = [p for p in _PROBE if p[0] == "capture"]
    assert len(eager) == WARMUP and all(p[1] and p[3] for p in eager), eager  # the plugin's cache setting arrived
    assert len(during_capture) >= 3 and all(p[1] and not p[3] for p in during_capture), during_capture
    _print_diffs(rec, ref, model, ref_model)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-2
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-2


class _GradDtypes(Callback):
    """The (weight, main_grad, grad) dtypes the optimizer sees, over all parameters and steps."""

    def __init__(self) -> None:
        self.seen = set()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.seen |= {(p.dtype, p.main_grad.dtype, p.grad.dtype) for p in pl_module.parameters()}


@pytest.mark.parametrize("accelerator,backend", DEVICES)
def test_bf16_true_parity(accelerator, backend):
    """precision="bf16-true" (Lightning's HalfPrecision: bf16 weights, main_grad in bf16): equal to "ddp"
    within 1e-2 (measured on CPU: 0)."""
    steps = 6
    dtypes = _GradDtypes()
    ref_model, ref, _, _ = _fit("ddp", steps, precision="bf16-true", accelerator=accelerator)
    model, rec, trainer, _ = _fit("cg", steps, precision="bf16-true", callbacks=[dtypes], accelerator=accelerator,
                                  backend=backend)
    _assert_replayed(trainer, steps)
    assert _stats(trainer).backend == backend
    assert dtypes.seen == {(torch.bfloat16, torch.bfloat16, torch.bfloat16)}  # weight, main_grad, grad
    _print_diffs(rec, ref, model, ref_model)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-2
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-2


class _ScalerRecorder(Callback):
    """The GradScaler's scale after every step and AdamW's step count (it does not grow on a skipped step)."""

    def __init__(self) -> None:
        self.scales, self.opt_steps = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())
        opt = trainer.optimizers[0]
        p = next(pl_module.parameters())
        self.opt_steps.append(int(opt.state[p]["step"]) if p in opt.state else 0)


FORCED_OVERFLOW_STEPS = (0, 5)  # one eager step, one replayed step (WARMUP = 2)


class _OverflowGPT(GPTLightningModule):
    """At the steps in FORCED_OVERFLOW_STEPS the gradient entering the blocks' backward (the last block's
    output) is replaced by +inf, whatever the device's fp16 range: the graphed backwards then write non-finite
    values into ``main_grad`` and the scaler must skip the step; the next step must start from zeros."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        hidden = self.model.hidden(x)
        if self.trainer.global_step in FORCED_OVERFLOW_STEPS:
            hidden.register_hook(lambda g: torch.full_like(g, float("inf")))
        loss = self.model.head_loss(hidden, y)
        self.log("train_loss", loss)
        return loss


def _fp16_overflow_pair(accelerator: str, device: str, backend: str, steps: int = 10):
    """16-mixed with a GradScaler that starts too high (2**18) and grows every 3 good steps, so that fp16
    overflows on its own at some steps (on CPU: right after a growth), plus the forced overflows of
    :class:`_OverflowGPT`."""
    out = []
    for name in ("ddp", "cg"):
        scaler = torch.amp.GradScaler(device, init_scale=2.0**18, growth_interval=3)
        srec = _ScalerRecorder()
        model, rec, trainer, _ = _fit(name, steps, model_cls=_OverflowGPT, accelerator=accelerator, backend=backend,
                                      callbacks=[srec], plugins=[MixedPrecision("16-mixed", device, scaler=scaler)])
        out.append((model, rec, trainer, srec))
    return out


def _assert_same_skipped_steps(pair, steps: int) -> None:
    (ref_model, ref, _, ref_s), (model, rec, trainer, s) = pair
    _assert_replayed(trainer, steps)
    skipped = [i for i in range(steps) if s.opt_steps[i] == (s.opt_steps[i - 1] if i else 0)]
    ref_skipped = [i for i in range(steps) if ref_s.opt_steps[i] == (ref_s.opt_steps[i - 1] if i else 0)]
    print(f"16-mixed: skipped steps {skipped} (ddp: {ref_skipped}), scales {s.scales}")
    assert skipped == ref_skipped
    assert set(FORCED_OVERFLOW_STEPS) <= set(skipped) and len(skipped) < steps, skipped
    assert s.scales == ref_s.scales
    assert all(torch.isfinite(p).all() for p in model.parameters())
    _print_diffs(rec, ref, model, ref_model)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-2
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-2


def test_fp16_mixed_grad_scaler_skips_the_same_steps_on_cpu():
    """precision="16-mixed" on CPU: Lightning turns the *string* into bf16-mixed on CPU (with a warning), but
    accepts an explicit ``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))`` (fp16 autocast on
    CPU). The scaler acts outside the graphs on the exposed ``main_grad``: the steps it skips on overflow
    (forced ones in an eager and a replayed step, natural ones after a scale growth), its scale after every
    step, the losses and the final weights all equal "ddp" (measured: identical)."""
    steps = 10
    _assert_same_skipped_steps(_fp16_overflow_pair("cpu", "cpu", "eager", steps), steps)


@pytest.mark.cuda
def test_fp16_mixed_grad_scaler_skips_the_same_steps_on_cuda():
    """The same on a GPU with real CUDA graphs (backend "auto" -> cuda): GradScaler stays outside the graphs."""
    steps = 10
    pair = _fp16_overflow_pair("gpu", "cuda", "cuda", steps)
    assert _stats(pair[1][2]).backend == "cuda"
    _assert_same_skipped_steps(pair, steps)


# ---------------------------------------------------------------------------------------------- optimization


class _ClipProbe(GPTLightningModule):
    """Records the gradient norm and max |grad| over all parameters before and after Lightning clips."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.before, self.after = [], []

    @staticmethod
    def _measure(module):
        grads = [p.grad.detach().double() for p in module.parameters() if p.grad is not None]
        return float(torch.stack([g.norm() for g in grads]).norm()), float(max(g.abs().max() for g in grads))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.before.append(self._measure(self))
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.after.append(self._measure(self))


@pytest.mark.parametrize("algorithm,clip", [("norm", 0.05), ("value", 2e-3)])
def test_gradient_clipping_parity(algorithm, clip):
    """gradient_clip_val with algorithm "norm" / "value", small enough to clip every step: Lightning clips
    the exposed ``main_grad`` (the optimizer's gradient); losses and weights equal "ddp" within 1e-5."""
    steps = 6
    kw = dict(model_cls=_ClipProbe, gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
    ref_model, ref, _, _ = _fit("ddp", steps, **kw)
    model, rec, trainer, _ = _fit("cg", steps, **kw)
    _assert_replayed(trainer, steps)
    which = 0 if algorithm == "norm" else 1
    assert len(model.before) == steps
    print(f"clip {algorithm} {clip}: unclipped {min(b[which] for b in model.before):.4f}.."
          f"{max(b[which] for b in model.before):.4f}, clipped max {max(a[which] for a in model.after):.4f}")
    assert all(b[which] > 1.5 * clip for b in model.before), model.before  # clipping happened, every step
    assert all(a[which] <= clip * (1 + 1e-5) for a in model.after), model.after
    assert max_rel_diff([b[which] for b in model.before], [b[which] for b in ref_model.before]) < 1e-5
    _print_diffs(rec, ref, model, ref_model)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5


class _AfterBackwardProbe(GPTLightningModule):
    """In ``on_after_backward`` (every micro-batch): records the norm of every ``p.grad`` and how many are
    ``None``; with ``scale`` also multiplies every gradient in place (gradient surgery between micro-batches)."""

    def __init__(self, scale=None, **kwargs):
        super().__init__(**kwargs)
        self.scale = scale
        self.seen = []

    def on_after_backward(self) -> None:
        grads = [p.grad for p in self.parameters()]
        present = [g.detach().double().norm() for g in grads if g is not None]
        self.seen.append((sum(g is None for g in grads), float(torch.stack(present).norm()) if present else 0.0))
        if self.scale is not None:
            for g in grads:
                if g is not None:
                    g.mul_(self.scale)


@pytest.mark.parametrize("accelerator,backend", DEVICES)
@pytest.mark.parametrize("scale", [None, 0.5])
def test_on_after_backward_sees_and_changes_gradients_as_under_ddp(scale, accelerator, backend):
    """``on_after_backward`` runs after every micro-batch's backward: under "ddp" ``p.grad`` then holds the sum
    so far (all-reduced on the micro-batch that steps). With accumulation 2 the hook sees the same gradients
    (none missing, norms within 1e-5) and scaling them there trains the same weights (1e-5) as "ddp"; before,
    it ran before the engine exposed anything and saw every ``p.grad`` as ``None``."""
    steps, accumulate = 6, 2
    kw = dict(model_cls=_AfterBackwardProbe, model_kwargs=dict(scale=scale), accumulate_grad_batches=accumulate,
              accelerator=accelerator, backend=backend)
    ref_model, ref, _, _ = _fit("ddp", steps, **kw)
    model, rec, trainer, _ = _fit("cg", steps, **kw)
    _assert_replayed(trainer, steps, micro_batches_per_step=accumulate)
    assert len(model.seen) == len(ref_model.seen) == steps * accumulate
    assert all(missing == 0 for missing, _ in model.seen), model.seen
    assert max_rel_diff([n for _, n in model.seen], [n for _, n in ref_model.seen]) < 1e-5
    _print_diffs(rec, ref, model, ref_model)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5


class _DataAssignProbe(GPTLightningModule):
    """``on_after_backward`` replaces every gradient's storage: ``p.grad.data = p.grad.data * 0.5``."""

    def on_after_backward(self) -> None:
        for p in self.parameters():
            if p.grad is not None:
                p.grad.data = p.grad.data * 0.5


class _BeforeBackwardProbe(GPTLightningModule):
    """``on_before_backward`` counts the ``p.grad`` that are ``None`` and halves the others (the sum so far)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.none_seen = []

    def on_before_backward(self, loss) -> None:
        self.none_seen.append(sum(p.grad is None for p in self.parameters()))
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)


class _SkipStepAccumulation(GPTLightningModule):
    """Accumulation by hand: even batches run only the closure (no optimizer step) and only they zero."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if batch_idx % 2 == 0:
            optimizer_closure()
        else:
            optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        if batch_idx % 2 == 0:
            optimizer.zero_grad()


@pytest.mark.parametrize("case", ["data_assign", "before_backward", "skip_step_accumulation"])
def test_gradient_edits_in_lightning_hooks_match_ddp(case):
    """Three ways a LightningModule works on param.grad between backwards, each bit-identical to "ddp":
    replacing a gradient's storage in on_after_backward (p.grad is main_grad there, so `.data =` must not detach
    main_grad from the buffer, or later gradients miss the zeroing and the all-reduce); halving the sum so far
    in on_before_backward with accumulation 2 (p.grad must hold that sum there); accumulating by skipping
    optimizer.step and zero_grad on odd batches (main_grad must keep the skipped batch's gradient)."""
    steps = 6
    kw = {
        "data_assign": dict(model_cls=_DataAssignProbe),
        "before_backward": dict(model_cls=_BeforeBackwardProbe, accumulate_grad_batches=2),
        "skip_step_accumulation": dict(model_cls=_SkipStepAccumulation),
    }[case]
    ref_model, ref, _, _ = _fit("ddp", steps, **kw)
    model, rec, trainer, _ = _fit("cg", steps, **kw)
    if case == "before_backward":
        assert model.none_seen == ref_model.none_seen and 0 in model.none_seen  # grads present on micro-batch 2
    assert rec.losses == ref.losses
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) == 0.0


class _LrRecorder(Callback):
    def __init__(self) -> None:
        self.lrs = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs.append([g["lr"] for g in optimizer.param_groups])


def test_lr_scheduler_every_step_parity():
    """The GPT's per-step LambdaLR warmup (warmup_lr_steps=6 over 8 steps): the learning rate seen by every
    optimizer step, the losses and the weights equal "ddp" (1e-5)."""
    steps = 8
    out = []
    for name in ("ddp", "cg"):
        lrs = _LrRecorder()
        out.append((*_fit(name, steps, model_kwargs=dict(warmup_lr_steps=6), callbacks=[lrs]), lrs))
    (ref_model, ref, _, _, ref_lrs), (model, rec, trainer, _, lrs) = out
    _assert_replayed(trainer, steps)
    assert lrs.lrs == ref_lrs.lrs
    assert [round(g[0] / MODEL["lr"], 6) for g in lrs.lrs] == [round(min(1.0, (i + 1) / 6), 6) for i in range(steps)]
    _print_diffs(rec, ref, model, ref_model)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5


class _GroupLrGPT(GPTLightningModule):
    """Three parameter groups with different learning rates and weight decays: the graphed blocks' matrices,
    their vectors (biases, norms), and everything outside the blocks."""

    def configure_optimizers(self):
        blocks = [p for n, p in self.named_parameters() if n.startswith("model.blocks.")]
        rest = [p for n, p in self.named_parameters() if not n.startswith("model.blocks.")]
        groups = [
            {"params": [p for p in blocks if p.ndim >= 2], "lr": 5e-3, "weight_decay": 0.1},
            {"params": [p for p in blocks if p.ndim < 2], "lr": 1e-2, "weight_decay": 0.0},
            {"params": rest, "lr": 1e-3, "weight_decay": 0.01},
        ]
        return torch.optim.AdamW(groups, betas=self.betas)


def test_param_groups_with_different_lrs_parity():
    """Three AdamW groups with their own lr/weight decay: losses and weights equal "ddp" (1e-5)."""
    steps = 8
    ref_model, ref, _, _ = _fit("ddp", steps, model_cls=_GroupLrGPT)
    model, rec, trainer, _ = _fit("cg", steps, model_cls=_GroupLrGPT)
    _assert_replayed(trainer, steps)
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == [5e-3, 1e-2, 1e-3]
    _print_diffs(rec, ref, model, ref_model)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_process_accumulation_clipping_and_scheduler(tmp_path):
    """gloo, 2 processes: plain accumulate_grad_batches=2 (engine.no_sync on the first micro-batch), clipping by
    norm (the norm of the all-reduced gradient, clip small enough to act) and the per-step LR warmup: the
    losses of every micro-batch and the final weights equal "ddp" within 1e-5."""
    steps = 5
    common = ["--devices", "2", "--steps", str(steps), "--accumulate", "2", "--backend", "eager",
              "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--block-size", "16",
              "--gradient-clip-val", "0.05", "--gradient-clip-algorithm", "norm", "--warmup-lr-steps", "4"]
    ref = train_subprocess(str(tmp_path / "ddp.pt"), "--strategy", "ddp", *common, timeout=200)
    cg = train_subprocess(str(tmp_path / "cg.pt"), "--strategy", "cudagraph_ddp", *common, timeout=200)
    assert len(cg["losses"]) == len(ref["losses"]) == 2 * steps
    assert cg["stats"]["captured_runners"] == N_LAYER
    assert cg["stats"]["forward_replays"] == N_LAYER * 2 * (steps - WARMUP)
    assert len(cg["grad_norms"]) == len(ref["grad_norms"]) == steps
    assert all(n > 1.5 * 0.05 for n in cg["grad_norms"]), cg["grad_norms"]  # clipping acted on every step
    assert max_rel_diff(cg["grad_norms"], ref["grad_norms"]) < 1e-5
    loss_diff, state_diff = max_rel_diff(cg["losses"], ref["losses"]), state_rel_diff(cg["state"], ref["state"])
    print(f"2 processes, accumulate 2, clip norm 0.05, LR warmup: unclipped norms {min(cg['grad_norms']):.3f}.."
          f"{max(cg['grad_norms']):.3f}, loss diff {loss_diff:.1e}, weight diff {state_diff:.1e}")
    assert loss_diff < 1e-5
    assert state_diff < 1e-5


# ---------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("accelerator,backend", DEVICES)
def test_validation_during_fit_and_sanity_check(accelerator, backend):
    """val_check_interval=3, limit_val_batches=2, num_sanity_val_steps=2, 7 steps: training losses and weights
    equal "ddp" (1e-5), so do the validation losses; graphs are captured exactly once (one capture, one
    runner per block, replays only in training steps); every validation call, sanity check included, runs
    eagerly; and every training batch, in particular each one right after a validation run, starts with the
    gradients "ddp" shows there (the last step's, kept until Lightning's ``zero_grad``; none before the first)."""
    steps = 7
    kw = dict(val_check_interval=3, limit_val_batches=2, num_sanity_val_steps=2)
    ref_life, life = LifecycleRecorder(), LifecycleRecorder()
    ref_model, ref, _, _ = _fit("ddp", steps, callbacks=[ref_life], accelerator=accelerator, **kw)
    model, rec, trainer, _ = _fit("cg", steps, callbacks=[life], accelerator=accelerator, backend=backend, **kw)

    _assert_replayed(trainer, steps)
    assert _stats(trainer).backend == backend
    assert life.captures == 1 and life.capture_seconds[WARMUP - 1] == 0 < life.capture_seconds[WARMUP]
    if hasattr(_stats(trainer), "captures"):  # capture events, where GraphStats counts them
        assert _stats(trainer).captures == 1
    _print_diffs(rec, ref, model, ref_model)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5

    assert [r[:2] for r in life.val_runs] == [r[:2] for r in ref_life.val_runs]
    assert life.val_runs[0][:2] == (True, 2)  # the sanity check
    assert len(life.val_runs) >= 1 + steps // 3
    for sanity, batches, eager, replays in life.val_runs:
        assert eager == N_LAYER * batches and replays == 0, life.val_runs
    assert max_rel_diff(life.val_losses, ref_life.val_losses) < 1e-5
    # all eager block calls: the warmup steps' training calls + every validation call
    assert _stats(trainer).eager_calls == N_LAYER * (WARMUP + sum(r[1] for r in life.val_runs))

    assert len(life.clean_starts) == steps
    assert [c[3] for c in life.clean_starts] == [c[3] for c in ref_life.clean_starts], life.clean_starts
    after_val = [c for c in life.clean_starts if c[2]]
    print(f"validation runs (sanity, batches, eager calls, replays): {life.val_runs}; "
          f"val loss diff {max_rel_diff(life.val_losses, ref_life.val_losses):.1e}; stats {vars(_stats(trainer))}")
    assert len(after_val) >= 3 and any(c[0] > WARMUP for c in after_val), after_val  # replayed steps among them


@pytest.mark.parametrize("accelerator,backend", DEVICES)
def test_validation_in_the_middle_of_gradient_accumulation(accelerator, backend):
    """accumulate_grad_batches=2 with val_check_interval=3 (micro-batches): validation runs between the two
    micro-batches of a window; the partial gradient survives it (the next micro-batch starts with it, as
    under "ddp") and losses and weights equal "ddp" (1e-5)."""
    steps = 5
    kw = dict(val_check_interval=3, limit_val_batches=2, num_sanity_val_steps=2, accumulate_grad_batches=2)
    ref_life, life = LifecycleRecorder(), LifecycleRecorder()
    ref_model, ref, _, _ = _fit("ddp", steps, callbacks=[ref_life], accelerator=accelerator, **kw)
    model, rec, trainer, _ = _fit("cg", steps, callbacks=[life], accelerator=accelerator, backend=backend, **kw)
    _assert_replayed(trainer, steps, micro_batches_per_step=2)
    assert _stats(trainer).backend == backend
    assert life.captures == 1
    assert len(rec.losses) == len(ref.losses) == 2 * steps
    assert [r[:2] for r in life.val_runs] == [r[:2] for r in ref_life.val_runs] and len(life.val_runs) == 4
    assert all(eager == N_LAYER * batches and replays == 0 for _, batches, eager, replays in life.val_runs)
    # every micro-batch starts with the gradients "ddp" shows there: the last step's until Lightning's zero_grad
    # in a window's first micro-batch, the first one's in its second
    assert [c[3] for c in life.clean_starts] == [c[3] for c in ref_life.clean_starts], life.clean_starts
    mid_window = [c for c in life.clean_starts if c[2] and c[1] % 2 == 1]
    assert any(c[0] >= WARMUP for c in mid_window), life.clean_starts  # validation split a replayed window
    _print_diffs(rec, ref, model, ref_model)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5
    assert max_rel_diff(life.val_losses, ref_life.val_losses) < 1e-5


def test_validate_test_predict_after_fit():
    """After fit on the same trainer and model: trainer.validate, trainer.test and trainer.predict run (the
    graphs are gone: the blocks' own forwards are back) and give the same numbers as under "ddp" (1e-5)."""
    steps = 6
    out = {}
    for name in ("ddp", "cg"):
        model, rec, trainer, data = _fit(name, steps, model_cls=EvalGPT, limit_val_batches=3,
                                         limit_test_batches=3, limit_predict_batches=3)
        if name == "cg":
            _assert_replayed(trainer, steps)
            assert all("forward" not in b.__dict__ for b in model.model.blocks)
        loader = data.val_dataloader()
        val = trainer.validate(model, datamodule=data, verbose=False)
        test = trainer.test(model, dataloaders=loader, verbose=False)
        pred = trainer.predict(model, dataloaders=loader)
        out[name] = (model, rec, val, test, pred)
    ref_model, ref, ref_val, ref_test, ref_pred = out["ddp"]
    model, rec, val, test, pred = out["cg"]
    _print_diffs(rec, ref, model, ref_model)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5
    assert val[0].keys() == ref_val[0].keys() == {"val_loss"}
    assert max_rel_diff(val[0]["val_loss"], ref_val[0]["val_loss"]) < 1e-5
    assert test[0].keys() == ref_test[0].keys() == {"test_loss"}
    assert max_rel_diff(test[0]["test_loss"], ref_test[0]["test_loss"]) < 1e-5
    assert len(pred) == len(ref_pred) == 3
    for a, b in zip(pred, ref_pred):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
