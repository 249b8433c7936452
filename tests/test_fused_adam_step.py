"""``graphs.cached_optimizer_step``: a fused Adam/AdamW step on cached tensor lists is bit-identical to
``optimizer.step()``, and any change to what it cached makes that step an ordinary one.

Each test steps two copies of the same parameters: one with ``optimizer.step()``, one through
:class:`CachedFusedAdamStep`, and compares every parameter and state tensor with ``torch.equal`` (tolerance 0:
same kernels, same arguments). Fused Adam runs on CPU in torch >= 2.4, so these run in CPU CI; the cuda test
repeats the main one on the GPU."""

import copy

import pytest
import torch

from cg_lightning.optim.fused_adam_step import CachedFusedAdamStep, fused_adam_refusal
from cg_lightning.optim.step_graph import step_replaced
from tests.helpers import DEVICES, MODEL, cg_strategy, fit_gpt, max_rel_diff, state_rel_diff

TORCH_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _params(device, n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (3,), (4, 4), (1,), (2, 3, 2), (6,), (3, 5)][:n]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]


def _groups(params, **extra):
    return [{"params": params[:4], "weight_decay": 0.1}, {"params": params[4:], "weight_decay": 0.0, **extra}]


class _Pair:
    """The same parameters and optimizer twice: ``ref`` stepped by ``optimizer.step()``, ``fast`` by the cached
    step. Gradients are persistent tensors refilled in place every step (as views of ``main_grad`` are)."""

    def __init__(self, device, cls=torch.optim.AdamW, scheduler=True, **opt_kwargs):
        self.ref_params = _params(device)
        self.params = copy.deepcopy(self.ref_params)
        kwargs = dict(lr=1e-2, betas=(0.9, 0.95), fused=True, **opt_kwargs)
        self.ref_opt = cls(_groups(self.ref_params), **kwargs)
        self.opt = cls(_groups(self.params), **kwargs)
        self.fast = CachedFusedAdamStep(self.opt)
        self.scheds = []
        if scheduler:  # the learning rate changes at every step, as under a warmup schedule
            self.scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.3 + 0.1 * s) for o in (self.ref_opt, self.opt)]
        self.gen = torch.Generator().manual_seed(1)
        for ps in (self.ref_params, self.params):
            for p in ps:
                p.grad = torch.zeros_like(p)

    def step(self):
        for p, q in zip(self.ref_params, self.params):
            new = torch.randn(p.shape, generator=self.gen).to(p.device)
            if p.grad is not None:
                p.grad.copy_(new)
            if q.grad is not None:
                q.grad.copy_(new)
        self.ref_opt.step()
        with step_replaced(self.opt, self.fast.step):  # as the strategy calls it (marks the step for schedulers)
            self.opt.step()
        for sched in self.scheds:
            sched.step()

    def assert_equal(self):
        for i, (p, q) in enumerate(zip(self.ref_params, self.params)):
            assert torch.equal(p, q), f"parameter {i}: max diff {(p - q).abs().max().item():.3e}"
            ref_state, state = self.ref_opt.state[p], self.opt.state[q]
            assert ref_state.keys() == state.keys(), i
            for key in ref_state:
                assert torch.equal(ref_state[key], state[key]), f"parameter {i} state {key!r}"


@pytest.mark.parametrize("device", TORCH_DEVICES)
@pytest.mark.parametrize("cls,extra", [
    (torch.optim.AdamW, {}),
    (torch.optim.AdamW, {"amsgrad": True}),
    (torch.optim.Adam, {"weight_decay": 0.05}),
    (torch.optim.Adam, {"maximize": True}),
], ids=["adamw", "adamw-amsgrad", "adam-l2", "adam-maximize"])
def test_cached_step_is_bit_identical_to_optimizer_step(device, cls, extra):
    """Twelve steps under a learning rate that changes every step, two groups (decay / no decay): parameters and
    every state tensor equal ``optimizer.step()`` exactly; all steps after the first ran on cached lists."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pair = _Pair(device, cls, **extra)
    for _ in range(12):
        pair.step()
        pair.assert_equal()
    assert pair.fast.cached_steps == 11
    assert pair.opt.param_groups[0]["lr"] == pair.ref_opt.param_groups[0]["lr"] != 1e-2  # the scheduler ran


def _changes():
    """(name, change applied to both optimizers/parameter sets before a step, cached steps expected after 6)."""

    def new_grad(pair):  # .grad replaced by a new tensor (not refilled in place)
        for ps in (pair.ref_params, pair.params):
            ps[1].grad = ps[1].grad.clone()

    def grad_none(pair):  # a parameter without a gradient this step: skipped, as optimizer.step() skips it
        for ps in (pair.ref_params, pair.params):
            ps[2].grad = None

    def hyper(pair):  # betas and eps changed in a group: read at every cached step
        for opt in (pair.ref_opt, pair.opt):
            opt.param_groups[1]["betas"] = (0.8, 0.9)
            opt.param_groups[0]["eps"] = 1e-6

    def new_group(pair):
        for ps, opt in ((pair.ref_params, pair.ref_opt), (pair.params, pair.opt)):
            extra = torch.nn.Parameter(torch.ones(3, device=ps[0].device))
            extra.grad = torch.zeros_like(extra)
            ps.append(extra)
            opt.add_param_group({"params": [extra], "weight_decay": 0.0})

    def reload(pair):  # load_state_dict replaces param_groups and state
        for opt in (pair.ref_opt, pair.opt):
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))

    def state_clear(pair):  # torch initializes the state again at the next step
        for opt in (pair.ref_opt, pair.opt):
            opt.state.clear()

    def state_replaced(pair):  # one parameter's state dict replaced by an empty one
        for ps, opt in ((pair.ref_params, pair.ref_opt), (pair.params, pair.opt)):
            opt.state[ps[2]] = {}

    def step_reset(pair):  # a new step-count tensor (bias corrections restart)
        for ps, opt in ((pair.ref_params, pair.ref_opt), (pair.params, pair.opt)):
            opt.state[ps[0]]["step"] = torch.zeros((), dtype=torch.float32, device=ps[0].device)

    return [("new_grad", new_grad, 4), ("grad_none", grad_none, 4), ("hyper", hyper, 5),
            ("new_group", new_group, 4), ("reload", reload, 4), ("state_clear", state_clear, 4),
            ("state_replaced", state_replaced, 4), ("step_reset", step_reset, 4)]


@pytest.mark.parametrize("name,change,cached", _changes(), ids=[c[0] for c in _changes()])
def test_a_change_makes_that_step_ordinary_and_results_stay_equal(name, change, cached):
    """A change after three steps (gradient tensors replaced or dropped, a group added, the state reloaded,
    cleared, one parameter's state replaced, a new step tensor) makes the next step an ordinary
    ``optimizer.step()`` (the lists are rebuilt after it); hyperparameter changes are read at every cached step
    without that. Bit-identical to ``optimizer.step()`` throughout."""
    pair = _Pair("cpu", scheduler=name != "new_group")  # LambdaLR does not follow added groups
    for i in range(6):
        if i == 3:
            change(pair)
        pair.step()
        pair.assert_equal()
    assert pair.fast.cached_steps == cached


def test_step_hooks_and_grad_scaler_attributes_take_torchs_own_step():
    """A step pre-hook registered after the lists were built runs (the ordinary step runs hooks); with
    GradScaler's ``grad_scale``/``found_inf`` set on the optimizer (16-mixed with a fused optimizer), torch
    unscales and skips inf steps itself: ordinary steps, equal to the reference."""
    pair = _Pair("cpu", scheduler=False)
    for _ in range(3):
        pair.step()
    calls = []
    handle = pair.opt.register_step_pre_hook(lambda opt, args, kwargs: calls.append(1))
    pair.ref_opt.register_step_pre_hook(lambda opt, args, kwargs: None)
    pair.step()
    pair.assert_equal()
    assert calls == [1] and pair.fast.cached_steps == 2
    handle.remove()
    for opt in (pair.ref_opt, pair.opt):
        opt.grad_scale = torch.tensor(4.0)
        opt.found_inf = torch.tensor(0.0)
    pair.step()
    pair.assert_equal()
    assert pair.fast.cached_steps == 2


def test_amsgrad_switched_on_later_fails_as_optimizer_step_does():
    """``amsgrad`` turned on after the state exists: torch's own step raises ``KeyError`` (no
    ``max_exp_avg_sq``); the cached step takes torch's path and raises the same, instead of running its
    lists without that state."""
    pair = _Pair("cpu", scheduler=False)
    for _ in range(3):
        pair.step()
    for opt in (pair.ref_opt, pair.opt):
        opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(KeyError, match="max_exp_avg_sq"):
        pair.ref_opt.step()
    with pytest.raises(KeyError, match="max_exp_avg_sq"):
        pair.fast.step()


def test_refusal_names_the_reason():
    params = _params("cpu", 2)
    assert fused_adam_refusal(torch.optim.AdamW(params, fused=True)) is None
    assert "fused=True" in fused_adam_refusal(torch.optim.AdamW(params))
    assert "SGD is not" in fused_adam_refusal(torch.optim.SGD(params, lr=0.1))

    class MyAdamW(torch.optim.AdamW):
        pass

    assert "MyAdamW is not" in fused_adam_refusal(MyAdamW(params, fused=True))


FUSED_MODEL = dict(MODEL, warmup_lr_steps=4, fused=True)


def _fit(strategy, steps, accelerator, **trainer_kwargs):
    model, rec, trainer, _ = fit_gpt(strategy, steps, model=FUSED_MODEL, accelerator=accelerator, **trainer_kwargs)
    return model, rec, trainer


@pytest.mark.parametrize("accelerator,backend", DEVICES)
def test_strategy_defaults_step_fused_adamw_on_cached_lists_like_ddp(accelerator, backend):
    """GPT with fused AdamW, a warmup schedule and norm clipping, 10 steps: cudagraph_ddp's defaults (segments,
    direct grad-ready, the cached step) against Lightning "ddp": losses and weights equal within 1e-6 (CPU:
    identical); every optimizer step after the first ran on cached lists."""
    steps = 10
    ref_model, ref, _ = _fit("ddp", steps, accelerator, gradient_clip_val=0.05)
    strategy = cg_strategy(backend)
    model, rec, trainer = _fit(strategy, steps, accelerator, gradient_clip_val=0.05)
    loss_diff = max_rel_diff(rec.losses, ref.losses)
    weight_diff = state_rel_diff(model.state_dict(), ref_model.state_dict())
    print(f"cached fused AdamW step ({backend}): max rel loss diff {loss_diff:.1e}, weight diff {weight_diff:.1e}")
    assert loss_diff < 1e-6 and weight_diff < 1e-6
    assert trainer.strategy.last_cached_optimizer_steps == steps - 1
    assert trainer.strategy.last_optimizer_replays == 0
