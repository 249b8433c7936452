"""Gradients that a replayed step, or the transient ``main_grad`` storage before its capture, could lose.

A replayed step starts every gradient from zero and runs Lightning's hooks after its backward, and before the capture
each step begins with every ``main_grad`` a placeholder (one process). So a gradient that outlives ``zero_grad`` (a
trainable parameter in no optimizer, an optimizer's own ``zero_grad``) or one set in ``on_before_backward`` refuses
the whole step: per-layer graphs, equal to ``"ddp"``. A write into a placeholder before Lightning's ``zero_grad`` is
discarded, as ``"ddp"`` discards it; a kernel that starts writing ``main_grad`` itself after the first step gets an
error in the engine's words instead of torch's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from lightning.pytorch import Callback

from cg_lightning.ddp import GradSyncError
from tests.helpers import cg_strategy
from tests.lightning_models import D_IN
from tests.lightning_runs import assert_same, train
from tests.test_whole_step_default import STEPS, PlainStep, _run


class _Prior(Callback):
    """Sets every gradient before the backward, which adds onto it (a gradient prior)."""

    def on_before_backward(self, trainer, pl_module, loss):
        for p in pl_module.parameters():
            p.grad = torch.full_like(p, 0.01)


class _OutsideOptimizer(PlainStep):
    """A trainable head that no optimizer steps: under "ddp" its gradient accumulates over steps."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(1, 1)

    def forward(self, x):
        return self.head(self.body(x))

    def configure_optimizers(self):
        return torch.optim.SGD(self.body.parameters(), lr=0.05)


class _KeepsGrads(torch.optim.SGD):
    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=False)


class _OwnZeroGrad(PlainStep):
    def configure_optimizers(self):
        return _KeepsGrads(self.parameters(), lr=0.05)


def _lambda_prior():
    """``_Prior``'s hook given to a ``LambdaCallback`` (an instance attribute, not a method of a subclass)."""
    from lightning.pytorch.callbacks import LambdaCallback

    return LambdaCallback(on_before_backward=_Prior.on_before_backward.__get__(_Prior()))


@pytest.mark.parametrize("model, callbacks, refusal", [
    (PlainStep, [_Prior], "the callback _Prior implements on_before_backward"),
    (PlainStep, [_lambda_prior], "the callback LambdaCallback implements on_before_backward"),
    (_OutsideOptimizer, [], "the parameter 'head.weight' requires grad but is in no optimizer"),
    (_OwnZeroGrad, [], "_KeepsGrads.zero_grad is not torch.optim.Optimizer's"),
], ids=["on_before_backward", "lambda_on_before_backward", "outside_optimizer", "own_zero_grad"])
def test_gradients_that_outlive_zero_grad_refuse_the_whole_step_and_train_like_ddp(model, callbacks, refusal):
    ref = train("ddp", model, max_steps=STEPS, callbacks=[c() for c in callbacks])
    strategy = cg_strategy()
    got, warned = _run(model, strategy, callbacks=[c() for c in callbacks])
    assert_same(ref.facts(), got.facts())
    stats = strategy.last_step_graph_stats
    assert stats.captures == 0 and refusal in stats.refusal, stats.refusal
    assert strategy.last_graph_stats.captures > 0 and warned == []  # per-layer graphs instead


class _WritesGradsInForward(PlainStep):
    """Fills every existing gradient in place at the start of each forward (before Lightning's ``zero_grad``, which
    discards it under "ddp"); from the second step the gradients are placeholders there."""

    def __init__(self) -> None:
        super().__init__()
        self.body.register_forward_pre_hook(self._fill)

    def _fill(self, module, args) -> None:
        for p in module.parameters():
            if p.grad is not None:
                p.grad.fill_(0.5)


class _Placeholders(Callback):
    zeros: list = []

    def on_train_end(self, trainer, pl_module) -> None:
        type(self).zeros = [float(z) for z in trainer.strategy.engine.adoption._zeros.values()]


def test_a_write_into_a_placeholder_before_zero_grad_is_discarded_as_under_ddp():
    ref = train("ddp", _WritesGradsInForward, max_steps=STEPS)
    strategy = cg_strategy()
    got, _ = _run(_WritesGradsInForward, strategy, callbacks=[_Placeholders()])
    assert_same(ref.facts(), got.facts())
    assert strategy.last_step_graph_stats.replays == STEPS - 3
    assert _Placeholders.zeros == [0.0], _Placeholders.zeros  # the placeholders read zeros again


class _FusedWgrad(torch.autograd.Function):
    """A linear layer whose backward, once ``on``, writes the weight's gradient into ``main_grad`` itself and sets
    ``grad_added_to_main_grad`` (Megatron-LM's ``gradient_accumulation_fusion``)."""

    on = False
    op = "add"

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gw = g.t() @ x
        if _FusedWgrad.on and hasattr(w, "main_grad"):
            if _FusedWgrad.op == "add":
                w.main_grad.add_(gw)
            else:  # fill_ and zero_ pass torch's overlap check on a placeholder
                w.main_grad.zero_()
            w.grad_added_to_main_grad = True
            gw = None
        return g @ w, gw, g.sum(0)


class _Fused(nn.Linear):
    def forward(self, x):
        return _FusedWgrad.apply(x, self.weight, self.bias)


class _FusedStep(PlainStep):
    def __init__(self) -> None:
        super().__init__()
        self.first = _Fused(D_IN, D_IN)

    def forward(self, x):
        return self.body(self.first(x))


class _FuseFromStep1(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _FusedWgrad.on = trainer.global_step >= 1


@pytest.mark.parametrize("op", ["add", "zero"])
def test_a_kernel_that_writes_main_grad_only_after_the_first_step_gets_the_engines_error(monkeypatch, op):
    """The first step showed only the engine's hooks writing ``main_grad``, so the second holds placeholders: the
    kernel's ``add_`` (refused by torch) or ``zero_`` (accepted by torch, seen by the engine's hook through
    ``grad_added_to_main_grad``) is a ``GradSyncError`` that says so."""
    monkeypatch.setattr(_FusedWgrad, "op", op)
    monkeypatch.setattr(_FusedWgrad, "on", False)
    with pytest.raises(GradSyncError, match="transient placeholder.*graphs.whole_step: false"):
        _run(_FusedStep, cg_strategy(), callbacks=[_FuseFromStep1()])
