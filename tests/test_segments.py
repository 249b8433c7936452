"""``graphs.segments``: consecutive graphed calls that feed each other captured as one forward and one
backward graph, against Lightning ``"ddp"`` on the same seed and data. On CPU (eager graph
backend) the segment's launching member re-runs every member body, so these tests check the chaining, the
skip-and-check paths of the other members and the grad-ready counts; the ``cuda`` test checks real capture."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningDataModule, LightningModule, seed_everything

from cg_lightning import SegmentError
from cg_lightning.ddp import GradSyncError
from cg_lightning.examples.data import TextDataModule
from cg_lightning.examples.gpt import GPTLightningModule
from tests import engine_models as em
from tests.engine_models import BACKENDS, assert_grads_equal, eager_reference, graphed_run
from tests.helpers import DATA, DEVICES, MODEL, WARMUP, make_trainer, max_rel_diff, state_rel_diff, strategy_for
from tests.recorders import GradRecorder

GPT = dict(MODEL, n_layer=4)


class _Roles(Callback):
    """Once graphs exist: per runner (in call order), whether its forward / backward handle launches."""

    def __init__(self) -> None:
        self.roles = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        manager = getattr(trainer.strategy, "graph_manager", None)
        if self.roles is None and manager is not None and manager.captured:
            runners = list(manager.runners.values())
            self.roles = [(getattr(r._fwd, "launcher", None), getattr(r._bwd, "launcher", None)) for r in runners]


def _fit(strategy_name, steps, module, data, accelerator="cpu", backend="eager", segments=True, callbacks=(),
         **trainer_kwargs):
    rec = GradRecorder()
    trainer = make_trainer(strategy_for(strategy_name, backend, segments=segments), steps, [rec, *callbacks],
                           accelerator=accelerator, **trainer_kwargs)
    trainer.fit(module, datamodule=data)
    return rec, trainer


@pytest.mark.parametrize("accelerator,backend", DEVICES)
def test_gpt_blocks_form_one_segment_and_train_like_ddp(accelerator, backend):
    """The example GPT's 4 blocks (``for block in blocks: x = block(x)``) chain into one segment: the first
    block's forward and the last block's backward launch, the others only check their inputs; 10 steps with
    accumulate 2: per-step losses and final weights equal "ddp" (1e-5; measured on CPU: identical), and the
    grad-ready counts equal those of per-layer graphs."""
    steps = 10
    out = {}
    for name, segments in (("ddp", False), ("cg", True), ("cg_layers", False)):
        seed_everything(7, workers=True)
        roles = _Roles()
        model = GPTLightningModule(**GPT)
        rec, trainer = _fit("ddp" if name == "ddp" else "cg", steps, model, TextDataModule(**DATA), accelerator,
                            backend, segments=segments, callbacks=[roles], accumulate_grad_batches=2)
        out[name] = (model, rec, trainer, roles)
    (ref_model, ref, _, _), (model, rec, trainer, roles), (_, layers_rec, _, _) = out["ddp"], out["cg"], out["cg_layers"]
    assert roles.roles == [(True, False), (False, False), (False, False), (False, True)], roles.roles
    assert trainer.strategy.last_graph_stats.forward_replays == 4 * 2 * (steps - WARMUP)
    assert trainer.strategy.last_graph_stats.segments == 1
    assert rec.ready_counts == layers_rec.ready_counts
    loss_diff = max_rel_diff(rec.losses, ref.losses)
    weight_diff = state_rel_diff(model.state_dict(), ref_model.state_dict())
    print(f"segments ({backend}): max rel loss diff {loss_diff:.1e}, weight diff {weight_diff:.1e}")
    assert loss_diff < 1e-5 and weight_diff < 1e-5


def _decay_bias(module, args) -> None:
    module[3].bias.data.mul_(0.9)


class _Chain(LightningModule):
    """Four residual MLP blocks on random regression data. ``between``: an op between blocks 1 and 2 (breaks
    the chain there); ``aux``: block 1's output also feeds an auxiliary loss (a second consumer);
    ``inplace_at``: global steps at which block 1's output is changed in place before block 2 (``"all"``: every
    step); ``grad_input_every``: every that many batches the first block's input requires grad (its call
    then differs from the captured signature)."""

    def __init__(self, between: bool = False, aux: bool = False, inplace_at=(), grad_input_every: int = 0,
                 grad_hook=False, rng_between=False, prehook: bool = False, backward_hook: bool = False,
                 late=None) -> None:
        super().__init__()
        self.late = late  # from two steps after capture on, what happens to block 1's output (see _late)
        drop = 0.2 if rng_between or grad_hook or late in ("rng", "subeval", "anneal") else 0.0
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(drop), nn.Linear(32, 16))
                                    for _ in range(4))
        self.head = nn.Linear(16, 1)
        self.between, self.aux, self.inplace_at, self.grad_input_every = between, aux, inplace_at, grad_input_every
        self.grad_hook, self.rng_between = grad_hook, rng_between
        if prehook:  # block 2's state changes right before each of its calls (as a schedule or FP8 scaling would)
            self.blocks[2].register_forward_pre_hook(_decay_bias)
        if backward_hook:  # a module backward hook on block 1 (sees its input and output gradients)
            self.blocks[1].register_full_backward_hook(lambda module, grad_input, grad_output: None)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.late == "freeze" and self.global_step >= WARMUP + 2:  # block 0 frozen before the step's forward
            self.blocks[0].requires_grad_(False)
        if self.grad_input_every and batch_idx % self.grad_input_every == 0:
            x = x.detach().requires_grad_()
        extra = 0.0
        for i, block in enumerate(self.blocks):
            x = block(x)
            if self.between and i == 1:
                x = x * 0.5
            if i == 1 and (self.inplace_at == "all" or self.global_step in self.inplace_at):
                x.add_(0.5)
            if i == 1 and (self.aux is True or (self.aux == "even_batches" and batch_idx % 2 == 0)
                           or (type(self.aux) is int and self.global_step >= self.aux)):
                extra = x.pow(2).mean()  # aux: every step, even batches only, or from a global step (int) on
            if i == 1 and (self.grad_hook is True or (self.grad_hook == "even_batches" and batch_idx % 2 == 0)
                           or (type(self.grad_hook) is int and self.global_step >= self.grad_hook)):
                x.register_hook(lambda g: g.mul_(0.5))  # changes the gradient in place, returns None
            if i == 1 and self.late is not None and self.global_step >= WARMUP + 2:
                x = _late(self, x)
            if i == 1 and (self.rng_between is True or (self.rng_between == "even_batches" and batch_idx % 2 == 0)):
                self.noise = torch.rand(4, device=x.device)  # a random draw between blocks 1 and 2 (x untouched)
        if getattr(self, "kept", None) is not None:
            self.kept.register_hook(lambda g: None)
            self.kept = None
        loss = F.mse_loss(self.head(x), y) + extra
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _late(module, x):
    """What ``_Chain(late=...)`` does to block 1's output once the segment replays through its one node."""
    if module.late == "detach":  # eager: no gradient reaches blocks 0-1 through block 2
        return x.detach()
    if module.late == "view":
        return x.view(x.shape)
    if module.late == "retain_grad":
        x.retain_grad()
        return x
    if module.late == "kept_hook":  # a read-only hook put on it after block 2 already ran: seen at the backward
        module.kept = x
    if module.late == "rng":  # a random draw between blocks whose dropout draws too (the segment drew all at once)
        module.noise = torch.rand(4)
    if module.late == "clamp":  # block 2's weight changed in place right before its call
        with torch.no_grad():
            module.blocks[2][0].weight.clamp_(-0.05, 0.05)
    if module.late == "eval":  # block 2 called in eval mode in the middle of the chain
        module.blocks[2].eval()
    if module.late == "subeval":  # only block 2's dropout switched to eval (the graph would still drop)
        module.blocks[2][2].eval()
    if module.late == "anneal":  # block 2's dropout probability lowered (the graph would still drop at 0.2)
        module.blocks[2][2].p = 0.1
    if module.late == "swap":  # block 2's activation replaced (the graph would still run GELU)
        module.blocks[2][1] = nn.Tanh()
    return x


class _ChainData(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(64, 8, 16, generator=g), torch.randn(64, 8, 1, generator=g)

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return self.x[i], self.y[i]



class _ChainDM(LightningDataModule):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(_ChainData(), batch_size=None)


def _chain_fit(name, steps, segments=True, **kwargs):
    seed_everything(5, workers=True)
    model = _Chain(**kwargs)
    roles = _Roles()
    rec, trainer = _fit(name, steps, model, _ChainDM(), segments=segments, callbacks=[roles])
    return model, rec, trainer, roles


SPLIT_AT_1 = [(True, False), (False, True), (True, False), (False, True)]  # segments blocks 0-1 and 2-3


@pytest.mark.parametrize("kwargs", [{"between": True}, {"aux": True}], ids=["op_between", "aux_loss"])
def test_what_separates_blocks_1_and_2_splits_the_segment(kwargs):
    """``op_between``: ``x = x * 0.5`` between blocks 1 and 2. ``aux_loss``: block 1's output also feeds an
    auxiliary loss on every step, so its gradient is the sum of two contributions, which a segment's backward
    graph fed by block 2 alone could not know; the recorded step's backward shows the second use
    (``segments.mark_outside_uses``). Either way blocks 0-1 and 2-3 form two segments; training equals "ddp"."""
    steps = 8
    ref_model, ref, _, _ = _chain_fit("ddp", steps, **kwargs)
    model, rec, _, roles = _chain_fit("cg", steps, **kwargs)
    assert roles.roles == SPLIT_AT_1, roles.roles
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5


@pytest.mark.parametrize("case", ["grad_hook", "rng_between", "prehook", "backward_hook"])
def test_what_happens_between_two_calls_ends_the_segment(case):
    """Three things between two chained calls that a segment's graphs would run in the wrong order, each seen
    in the recorded step, each ending the segment there; training equals "ddp" (1e-5):
    ``grad_hook``: a gradient hook on block 1's output that changes the gradient in place (block 1's backward
    would already have run inside the segment's backward graph); ``rng_between``: a random draw between
    blocks 1 and 2, with dropout in the blocks (the segment's graph would draw block 2's masks before it);
    ``prehook``: a forward pre-hook on block 2 that changes its bias (the segment would run block 2 at block
    0's call, before the hook); ``backward_hook``: a module backward hook on block 1 (``SegmentError`` at
    the first replay otherwise). Without the checks each case would train silently off "ddp"."""
    steps = 8
    kw = {case: True}
    ref_model, ref, _, _ = _chain_fit("ddp", steps, **kw)
    model, rec, _, roles = _chain_fit("cg", steps, **kw)
    # a module backward hook on block 1 wraps its input and output: block 1 stands alone (no role)
    expected = SPLIT_AT_1 if case != "backward_hook" else [(None, None), (None, None), (True, False), (False, True)]
    assert roles.roles == expected, roles.roles
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5


def test_in_place_gradient_hook_added_after_capture_is_an_error_naming_the_layer():
    """The in-place gradient hook on block 1's output starts two steps after capture: inside the segment's one
    autograd node no gradient reaches that output outside the graph, so block 2's call raises ``SegmentError``
    naming block 1 (before anything ran with the hook missing)."""
    with pytest.raises(SegmentError, match=r"'blocks\.1'.*gradient hook or retain_grad\(\) was put on its output"):
        _chain_fit("cg", 8, grad_hook=WARMUP + 2)


def test_blocks_chained_into_a_segment_share_one_autograd_node():
    """After capture, the four chained blocks leave one ``SegmentFunctionBackward`` node in the loss's autograd
    graph (no per-block replay node); each block's call still counts as a forward replay."""
    from cg_lightning.graphs.recompute.discovery import autograd_edges

    names = []

    class Nodes(Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            if trainer.global_step == WARMUP + 1:
                names.extend(type(n).__name__ for _, n in autograd_edges(loss.grad_fn) if n is not None)

    seed_everything(5, workers=True)
    _, trainer = _fit("cg", WARMUP + 2, _Chain(), _ChainDM(), callbacks=[Nodes()])
    assert names.count("SegmentFunctionBackward") == 1, names
    assert "ReplayFunctionBackward" not in names, names
    assert trainer.strategy.last_graph_stats.forward_replays == 8  # 4 calls in steps WARMUP and WARMUP + 1


@pytest.mark.parametrize("late,match", [
    ("detach", r"'blocks\.2'.*not called with the previous layer's output itself"),
    ("view", r"'blocks\.2'.*not called with the previous layer's output itself"),
    ("retain_grad", r"'blocks\.1'.*gradient hook or retain_grad\(\) was put on its output"),
    ("kept_hook", r"'blocks\.1'.*gradient hook or retain_grad\(\) was put on its output"),
    ("rng", r"'blocks\.3' is the last layer of a segment .* random numbers were drawn between its layer calls"),
    ("clamp", r"'blocks\.2' .* parameters was changed in place after the segment's graphs ran this layer"),
    ("eval", r"'blocks\.2' .* already ran it for this pass, but it was called in eval mode"),
    ("subeval", r"(?s)'blocks\.2' .*train/eval mode changed since capture for submodule\(s\) \['2'\]"),
    ("anneal", r"(?s)'blocks\.2' .*attribute\(s\) changed since capture.*: 2\.p: 0\.2 -> 0\.1"),
    ("swap", r"(?s)'blocks\.2' .*since capture: submodule\(s\) \['1'\] replaced or removed"),
])
def test_what_the_one_node_cannot_honour_after_capture_is_an_error_naming_the_layer(late, match):
    """From two steps after capture: block 1's output detached or viewed before block 2 (the one node would
    hand block 2 an output still connected to blocks 0-1, or computed from another tensor), ``retain_grad()``
    on it, or a read-only gradient hook registered on it after block 2 ran (no gradient reaches it outside the
    graph, so neither would ever see one); a random draw between blocks whose dropout draws (the segment made
    all the blocks' draws at its first call); block 2's weight clamped in place right before its call (the
    segment already ran block 2); block 2 called in eval mode, or only its dropout; block 2's dropout probability
    lowered, or its activation replaced by another module (the graph holds the old ones). Each is ``SegmentError``
    naming the layer, never a silent difference (the next test: the draw, the clamp and the eval calls train
    like "ddp" with graphs.segments=false)."""
    with pytest.raises(SegmentError, match=match):
        _chain_fit("cg", 8, late=late)


def test_freezing_a_segment_member_after_capture_runs_the_segment_eagerly():
    """Block 0 frozen two steps after capture (``toggle_optimizer`` does this between passes): the segment no
    longer matches its capture and runs eagerly; the frozen parameters then report no gradient, and the engine
    names them, as "ddp" stops for parameters without a gradient (find_unused_parameters allows them)."""
    with pytest.warns(UserWarning, match=r"requires_grad changed since capture for parameter\(s\) \['0\.weight'"):
        with pytest.raises(GradSyncError, match=r"blocks\.0\.0\.weight \(ready 0 times, expected 1\)"):
            _chain_fit("cg", 8, late="freeze")


@pytest.mark.parametrize("late", ["rng", "clamp", "eval", "subeval", "anneal", "swap"])
def test_what_segments_refuse_trains_like_ddp_with_per_layer_graphs(late):
    """The cases above that per-layer graphs handle: with graphs.segments=false, training equals "ddp"
    (CPU, eager backend: identical; 1e-6 bound). ``subeval``: the call whose dropout was switched to eval no
    longer matches its capture and runs eagerly (shape policy "eager", one warning), as does the call whose dropout
    probability was lowered or whose activation was replaced."""
    steps = 8
    ref_model, ref, _, _ = _chain_fit("ddp", steps, late=late)
    model, rec, trainer, _ = _chain_fit("cg", steps, segments=False, late=late)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-6
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-6
    if late in ("subeval", "anneal", "swap"):  # the eager backend would replay the current module anyway: the
        # fallback is what counts
        assert trainer.strategy.last_graph_stats.fallback_calls >= steps - (WARMUP + 2)


def test_forward_pre_hook_added_after_capture_on_a_following_member_is_an_error():
    """A pre-hook registered on block 2 after capture would run after the segment already ran block 2."""

    class AddHookLater(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == WARMUP + 2:
                pl_module.blocks[2].register_forward_pre_hook(lambda module, args: None)

    seed_everything(5, workers=True)
    with pytest.raises(SegmentError, match=r"'blocks\.2'.*forward pre-hook"):
        _fit("cg", 8, _Chain(), _ChainDM(), callbacks=[AddHookLater()])


@pytest.mark.parametrize("case", ["aux", "rng_between", "grad_hook"])
def test_what_the_first_micro_batch_of_each_step_shows_ends_the_segment(case):
    """accumulate_grad_batches=2 and, only in the first micro-batch of each step, an auxiliary loss on block
    1's output (``aux``), a random draw between blocks 1 and 2 (``rng_between``, dropout in the blocks) or an
    in-place gradient hook on block 1's output (``grad_hook``): the last recorded micro-batch shows nothing,
    the first does; what every recorded micro-batch showed counts, so the segment ends at block 1 and
    training equals "ddp" (judged from the last micro-batch alone: ``SegmentError`` for the first and last,
    silently 4.9e-2 off "ddp" in loss for the random draw)."""
    out = {}
    for name in ("ddp", "cg"):
        seed_everything(5, workers=True)
        roles = _Roles()
        model = _Chain(**{case: "even_batches"})
        rec, _ = _fit(name, 6, model, _ChainDM(), callbacks=[roles], accumulate_grad_batches=2)
        out[name] = (model, rec, roles)
    (ref_model, ref, _), (model, rec, roles) = out["ddp"], out["cg"]
    assert roles.roles == SPLIT_AT_1, roles.roles
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5


def test_intermediate_output_used_elsewhere_only_after_capture_is_an_error_naming_the_layer():
    """The auxiliary loss on block 1's output starts two steps after capture: the recorded step gave no sign
    of it, blocks 0-3 form one segment, and the first backward with the second use raises ``SegmentError``
    naming the layer, instead of training on a wrong gradient."""
    with pytest.raises(SegmentError, match=r"'blocks\.1'.*graphs\.segments=false"):
        _chain_fit("cg", 8, aux=WARMUP + 2)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("repeat", [1, 2], ids=["once", "applied-twice"])
@pytest.mark.parametrize("layer_cls_name", ["SeedLayer", "InsideOutsideLayer", "RepeatedNestedLayer",
                                            "TorchReentrantLayer", "CgCheckpointLayer", "TorchNonReentrantLayer"])
def test_segments_with_recomputation_keep_gradients_and_counts(layer_cls_name, repeat, backend, device):
    """The engine-level layer kinds of tests/engine_models.py (parameters hidden behind recomputation,
    nested backwards, a stack applied twice), 3 layers chained into one segment: ``main_grad`` equals the
    un-checkpointed eager gradient (1e-6) and the grad-ready counts equal per-layer graphs', every step."""
    layer_cls = getattr(em, layer_cls_name)
    ref, _ = eager_reference(layer_cls, n=3, device=device, repeat=repeat)
    got, counts, manager, _, _ = graphed_run(layer_cls, backend, device, n=3, repeat=repeat, segments=True)
    _, layer_counts, _, _, _ = graphed_run(layer_cls, backend, device, n=3, repeat=repeat, segments=False)
    launchers = [getattr(r._fwd, "launcher", None) for r in manager.runners.values()]
    assert launchers.count(True) == 1 and launchers.count(False) == 3 * repeat - 1, launchers
    assert_grads_equal(got, ref)
    assert counts == layer_counts


def test_in_place_change_between_blocks_breaks_the_chain():
    """``x.add_(0.5)`` on block 1's output before block 2, in every step: seen at recording (version counter),
    so blocks 0-1 and 2-3 form two segments; training equals "ddp" (one segment would compute block 2 from the
    unchanged output, silently)."""
    steps = 8
    ref_model, ref, _, _ = _chain_fit("ddp", steps, inplace_at="all")
    model, rec, _, roles = _chain_fit("cg", steps, inplace_at="all")
    assert roles.roles == [(True, False), (False, True), (True, False), (False, True)], roles.roles
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5


def test_in_place_change_after_capture_is_an_error_naming_the_layer():
    """The same change only at step 5 (after capture): the segment already computed block 2; the replay
    raises ``SegmentError`` naming ``blocks.2`` instead of training on the stale value."""
    with pytest.raises(SegmentError, match=r"'blocks\.2'.*changed in place"):
        _chain_fit("cg", 8, inplace_at=(5,))


def test_first_call_running_eagerly_takes_the_whole_segment_along():
    """Every third batch the first block's input requires grad, so under ``shape_policy="eager"`` that call runs
    eagerly; the rest of the segment follows it eagerly in that pass (a segment replays all or none of its
    calls) and training equals "ddp"."""
    steps = 9
    ref_model, ref, _, _ = _chain_fit("ddp", steps, grad_input_every=3)
    with pytest.warns(UserWarning, match="blocks.0"):
        model, rec, trainer, roles = _chain_fit("cg", steps, grad_input_every=3)
    stats = trainer.strategy.last_graph_stats
    assert stats.fallback_calls == 4 * len([i for i in range(WARMUP + 1, steps) if i % 3 == 0]), vars(stats)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5


def test_layer_failing_in_a_later_graph_set_drops_the_sets_segments():
    """``shape_policy="recapture"`` and ``on_capture_error="eager"``: the full-batch set is one segment; the
    set for the smaller last batch fails on block 2 (a host sync at that size only), which makes block 2
    eager everywhere. The full-batch set, whose segment contains block 2, is dropped and captured again
    without it; training equals "ddp" (no error)."""

    class SyncOnSmallBatch(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            y = self.inner(x)
            if x.shape[0] < 8:
                y = y * (1.0 if y.detach().abs().max().item() >= 0 else 0.0)
            return y

    class DM(LightningDataModule):
        def train_dataloader(self):
            g = torch.Generator().manual_seed(3)
            data = torch.utils.data.TensorDataset(torch.randn(36, 16, generator=g), torch.randn(36, 1, generator=g))
            return torch.utils.data.DataLoader(data, batch_size=8, drop_last=False)

    out = {}
    for name in ("ddp", "cg"):
        seed_everything(5, workers=True)
        model = _Chain()
        model.blocks[2] = SyncOnSmallBatch(model.blocks[2])
        strategy = strategy_for(name, segments=True, shape_policy="recapture", on_capture_error="eager",
                                layers=["blocks.*"])
        rec = GradRecorder()
        trainer = make_trainer(strategy, 15, [rec])
        if name == "cg":
            with pytest.warns(UserWarning, match="blocks.2"):
                trainer.fit(model, datamodule=DM())
        else:
            trainer.fit(model, datamodule=DM())
        out[name] = (model, rec, trainer)
    (ref_model, ref, _), (model, rec, trainer) = out["ddp"], out["cg"]
    assert trainer.strategy.last_graph_stats.failed_layers == ["blocks.2"]
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x):
        return x + self.mlp(x)  # fp32 stream + bf16 branch under autocast: the chained tensor stays fp32


class _LastBlockFullPrecision(_Chain):
    """bf16 autocast from the precision plugin, but the last (residual) block runs with autocast disabled."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Residual() for _ in range(4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        for i, block in enumerate(self.blocks):
            if i == len(self.blocks) - 1:
                with torch.autocast(self.device.type, enabled=False):
                    x = block(x)
            else:
                x = block(x)
        loss = F.mse_loss(self.head(x).float(), y)
        self.log("train_loss", loss)
        return loss


@pytest.mark.parametrize("accelerator,backend", DEVICES)
@pytest.mark.parametrize("segments", [False, True], ids=["layers", "segments"])
def test_each_call_is_captured_under_its_own_autocast_settings(segments, accelerator, backend):
    """bf16-mixed with the last block called under ``autocast(enabled=False)``: every call is warmed up,
    captured and replayed under the autocast settings it was recorded with (capture happens inside the
    first block's call); training equals "ddp" within 1e-5. Without that, segments on CPU differed by
    3.7e-3, and on CUDA every per-layer graph was captured under the first call's settings."""
    out = {}
    for name in ("ddp", "cg"):
        seed_everything(5, workers=True)
        model = _LastBlockFullPrecision()
        rec = GradRecorder()
        trainer = make_trainer(strategy_for(name, backend, segments=segments, whole_step=False), 8, [rec], accelerator=accelerator,
                               precision="bf16-mixed")
        trainer.fit(model, datamodule=_ChainDM())
        out[name] = (model, rec, trainer)
    (ref_model, ref, _), (model, rec, trainer) = out["ddp"], out["cg"]
    assert trainer.strategy.last_graph_stats.forward_replays == 4 * (8 - WARMUP)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5
