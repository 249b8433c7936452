"""``graphs.capture_eval``: forward-only graphs for graphed layers in eval mode, against
Lightning "ddp" on the same seed and data (eager graph backend on CPU, real graphs on the GPU machine)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from lightning.pytorch import seed_everything

from cg_lightning.callbacks import CUDAGraphCallback
from cg_lightning.graphs import GraphManager, GraphOptions
from cg_lightning.examples.data import TextDataModule
from cg_lightning.examples.gpt import GPTLightningModule
from tests.helpers import (
    DATA, DEVICES, MODEL, N_LAYER, WARMUP, EvalGPT, cg_strategy, fit_gpt, make_trainer, max_rel_diff, state_rel_diff,
    strategy_for,
)
from tests.recorders import LifecycleRecorder


@pytest.mark.parametrize("accelerator,backend", DEVICES)
def test_validation_and_sanity_check_replay_eval_graphs_like_ddp(accelerator, backend):
    """val_check_interval=3, limit_val_batches=2, sanity check 2 batches, 7 steps: validation losses, training
    losses and weights equal "ddp" (1e-5); each block gets one eval graph (first eval call eager, every later
    one replayed), the training graphs are captured exactly once (eval never recaptures them) and every
    training batch after a validation run starts with no gradient pending."""
    steps = 7
    kw = dict(val_check_interval=3, limit_val_batches=2, num_sanity_val_steps=2)
    ref_life, life = LifecycleRecorder(), LifecycleRecorder()
    ref_model, ref, _, _ = fit_gpt("ddp", steps, callbacks=[ref_life], accelerator=accelerator, **kw)
    model, rec, trainer, _ = fit_gpt(strategy_for("cg", backend, capture_eval=True, whole_step=False), steps,
                                     callbacks=[life],
                                     accelerator=accelerator, **kw)
    stats = trainer.strategy.last_graph_stats
    val_batches = sum(r[1] for r in life.val_runs)
    print(f"eval graphs: val loss diff {max_rel_diff(life.val_losses, ref_life.val_losses):.1e}, "
          f"loss diff {max_rel_diff(rec.losses, ref.losses):.1e}, eval graphs {stats.eval_graphs}, "
          f"eval replays {stats.eval_replays}, val batches {val_batches}")
    assert [r[:2] for r in life.val_runs] == [r[:2] for r in ref_life.val_runs] and val_batches >= 6
    assert max_rel_diff(life.val_losses, ref_life.val_losses) < 1e-5
    assert max_rel_diff(rec.losses, ref.losses) < 1e-5
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-5
    assert stats.captures == 1 and stats.captured_runners == N_LAYER
    assert stats.forward_replays == N_LAYER * (steps - WARMUP)
    assert stats.eval_graphs == N_LAYER
    assert stats.eval_replays == N_LAYER * (val_batches - 1)
    assert stats.eager_calls == N_LAYER * (WARMUP + 1)  # warmup training steps + the first eval call
    assert [c[3] for c in life.clean_starts] == [c[3] for c in ref_life.clean_starts], life.clean_starts


@pytest.mark.parametrize("accelerator,backend", DEVICES)
def test_validate_test_predict_after_fit_replay_eval_graphs(accelerator, backend):
    """After fit, ``trainer.validate``, ``trainer.test`` and ``trainer.predict`` (3 batches each) under
    capture_eval replay eval graphs (a manager for eval graphs only, removed at the end of each stage) and
    give the numbers of the same calls under "ddp" (1e-5)."""
    out = {}
    for name in ("ddp", "cg"):
        model, _, trainer, data = fit_gpt(strategy_for(name, backend, capture_eval=True), 4, model_cls=EvalGPT,
                                          accelerator=accelerator, limit_val_batches=3, limit_test_batches=3,
                                          limit_predict_batches=3)
        loader = data.val_dataloader()
        stats = []
        val = trainer.validate(model, datamodule=data, verbose=False)
        stats.append(getattr(trainer.strategy, "last_graph_stats", None))
        test = trainer.test(model, dataloaders=loader, verbose=False)
        stats.append(getattr(trainer.strategy, "last_graph_stats", None))
        pred = trainer.predict(model, dataloaders=loader)
        stats.append(getattr(trainer.strategy, "last_graph_stats", None))
        out[name] = (val, test, pred, stats, model)
    (ref_val, ref_test, ref_pred, _, _), (val, test, pred, stats, model) = out["ddp"], out["cg"]
    assert all("forward" not in b.__dict__ for b in model.model.blocks)  # every stage's manager removed
    for s in stats:
        assert s.eval_graphs == N_LAYER and s.eval_replays == N_LAYER * 2 and s.captured_runners == 0
    assert max_rel_diff(val[0]["val_loss"], ref_val[0]["val_loss"]) < 1e-5
    assert max_rel_diff(test[0]["test_loss"], ref_test[0]["test_loss"]) < 1e-5
    assert len(pred) == len(ref_pred) == 3
    for a, b in zip(pred, ref_pred):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _Block(nn.Module):
    def __init__(self, sync: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.sync = sync

    def forward(self, x):
        y = torch.tanh(self.fc(x))
        if self.sync and float(y.sum()) > 1e9:  # a host sync: not capturable
            y = y * 0
        return y


class _Net(nn.Module):
    def __init__(self, sync_last: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block(sync=sync_last)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_eval_graphs_keyed_by_shape_outputs_not_overwritten():
    """Eval calls of two shapes, interleaved: one graph per layer and shape, every output equals the eager
    forward, and an output kept from an earlier call is not overwritten by later replays (outputs are
    copies of the static buffers)."""
    torch.manual_seed(0)
    net = _Net()
    reference = _Net()
    reference.load_state_dict(net.state_dict())
    manager = GraphManager(net, GraphOptions(backend="eager", capture_eval=True, layers=["blocks.*"]),
                           torch.device("cpu"))
    net.eval()
    xs = [torch.randn(4, 8), torch.randn(2, 8), torch.randn(4, 8), torch.randn(2, 8), torch.randn(4, 8)]
    kept = []
    with torch.no_grad():
        for x in xs:
            kept.append(net(x))
        expected = [reference(x) for x in xs]
    for k, e in zip(kept, expected):
        assert torch.equal(k, e)
    assert manager.stats.eval_graphs == 2 * 2  # 2 layers x 2 shapes
    assert manager.stats.eval_replays == 2 * 3  # shape 4: calls 2, 3; shape 2: call 2 (the first of each is eager)
    with torch.no_grad(), torch.inference_mode():
        assert torch.equal(net(xs[0]), expected[0])  # inference mode: its own key
    assert manager.stats.eval_graphs == 2 * 2  # not captured yet: first call of that key is eager
    net.train()
    out = net(xs[0])  # training mode: the eval graphs are not used
    assert out.requires_grad and manager.stats.eval_replays == 6
    manager.remove()


def test_eval_capture_failure_warns_names_layer_and_runs_eagerly():
    """A host sync inside a layer's forward: its eval capture fails with one warning naming the layer; that
    layer runs eagerly in eval from then on, the other one replays; outputs equal eager."""
    torch.manual_seed(0)
    net = _Net(sync_last=True)
    reference = _Net(sync_last=True)
    reference.load_state_dict(net.state_dict())
    manager = GraphManager(net, GraphOptions(backend="eager", capture_eval=True, layers=["blocks.*"]),
                           torch.device("cpu"))
    net.eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        net(x)
        with pytest.warns(UserWarning, match=r"eval graph of layer 'blocks.1' could not be captured"):
            second = net(x)
        third = net(x)
        expected = reference(x)
    assert torch.equal(second, expected) and torch.equal(third, expected)
    assert manager.stats.eval_graphs == 1 and manager.stats.eval_replays == 2  # blocks.0 only
    manager.remove()


def test_callback_sets_capture_eval_and_monitor_logs_eval_replays(tmp_path):
    """``CUDAGraphCallback(capture_eval=True)`` turns eval graphs on for the strategy and keeps the setting in
    checkpoints; ``GraphMonitor`` logs ``graphs/eval_replays`` through the CSV logger."""
    import csv
    import glob

    from lightning.pytorch.loggers import CSVLogger

    from cg_lightning.callbacks import GraphMonitor

    cb = CUDAGraphCallback(capture_eval=True)
    assert cb.overrides == {"capture_eval": True}
    seed_everything(7, workers=True)
    trainer = make_trainer(cg_strategy(), 6, [cb, GraphMonitor(log_every_n_steps=1)], val_check_interval=3,
                           limit_val_batches=3, log_every_n_steps=1, logger=CSVLogger(tmp_path))
    trainer.fit(GPTLightningModule(**MODEL), datamodule=TextDataModule(**DATA))
    assert trainer.strategy.graph_options.capture_eval is True
    assert trainer.strategy.last_graph_stats.eval_replays == N_LAYER * (2 * 3 - 1)
    assert cb.state_dict()["options"]["capture_eval"] is True
    rows = list(csv.DictReader(open(glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)[0])))
    logged = [float(r["graphs/eval_replays"]) for r in rows if r.get("graphs/eval_replays")]
    assert logged and logged[-1] == N_LAYER * (3 - 1)  # after the first validation run (step 3)


class _Noisy(nn.Module):
    """Eval-mode randomness and a buffer updated by every call (MC-dropout style sampling, a call counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += 1
        return self.fc(x) + 0.1 * torch.randn_like(x)


def _eval_twins(cls, n=2):
    torch.manual_seed(0)
    net = nn.ModuleDict({"blocks": nn.ModuleList(cls() for _ in range(n))})
    ref = nn.ModuleDict({"blocks": nn.ModuleList(cls() for _ in range(n))})
    ref.load_state_dict(net.state_dict())
    manager = GraphManager(net, GraphOptions(backend="eager", capture_eval=True, layers=["blocks.*"]),
                           torch.device("cpu"))
    net.eval()
    ref.eval()
    return net, ref, manager


def _run_blocks(model, x):
    for b in model["blocks"]:
        x = b(x)
    return x


def test_eval_capture_changes_no_rng_or_buffer_state():
    """Random numbers drawn and buffers updated in eval: with eval graphs every call draws the same numbers
    and leaves the same buffers as the eager model called the same way (the capture restores RNG states and
    buffers; its replay is the call's only run). Before, the capture call ran the layer twice on the eager
    backend: the helper measured validation losses off by 0.14 and later training by 0.2."""
    net, ref, manager = _eval_twins(_Noisy)
    xs = [torch.randn(4, 8) for _ in range(5)]
    with torch.no_grad():
        torch.manual_seed(11)
        got = [_run_blocks(net, x) for x in xs]
        after_graphs = torch.rand(())
        torch.manual_seed(11)
        want = [_run_blocks(ref, x) for x in xs]
        after_eager = torch.rand(())
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(after_graphs, after_eager)
    assert [float(b.seen) for b in net["blocks"]] == [float(b.seen) for b in ref["blocks"]] == [5.0, 5.0]
    assert manager.stats.eval_replays == 2 * 4
    manager.remove()


class _InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(2)  # changes the caller's tensor in eager execution
        return self.fc(x)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_layer_modifying_its_input_in_place_stays_eager_in_eval(mode):
    """A layer that changes its input in place is seen in its warmup call (version counter, or a copy for
    inference tensors) and runs eagerly in eval, with one warning naming it: a replay would change only the
    static copy, not the caller's tensor."""
    net, ref, manager = _eval_twins(_InPlace, n=1)
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        xs = [torch.randn(4, 8) for _ in range(3)]
        xr = [x.clone() for x in xs]
        with pytest.warns(UserWarning, match=r"'blocks\.0'.*modifies an input in place"):
            outs = [net["blocks"][0](x) for x in xs]
        want = [ref["blocks"][0](x) for x in xr]
    for o, w, x, r in zip(outs, want, xs, xr):
        assert torch.equal(o, w) and torch.equal(x, r)  # the callers' tensors changed as in eager
    assert manager.stats.eval_graphs == 0
    manager.remove()


def test_hook_added_after_eval_capture_makes_the_layer_eager():
    """A forward hook registered on a submodule after the eval graph exists (an activation-logging callback,
    say) would not run in a replay: the next call sees it, warns naming the layer and runs eagerly, so the
    hook runs every time."""
    net, _, manager = _eval_twins(_Block, n=1)
    seen = []
    x = torch.randn(4, 8)
    with torch.no_grad():
        net["blocks"][0](x)
        net["blocks"][0](x)  # captured and replayed
        handle = net["blocks"][0].fc.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        with pytest.warns(UserWarning, match=r"'blocks\.0'.*forward hook on submodule 'fc'"):
            net["blocks"][0](x)
        net["blocks"][0](x)
    assert len(seen) == 2 and manager.stats.eval_replays == 1
    handle.remove()
    manager.remove()


def test_eval_input_with_another_layout_gets_its_own_graph():
    """The same shape with other strides (a transposed view) is another key: its output equals the eager
    layer's exactly (copied into the first layout's static buffer it was 6e-8 off)."""
    net, ref, manager = _eval_twins(_Block, n=1)
    a = torch.randn(4, 8)
    b = torch.randn(8, 4).t()
    with torch.no_grad():
        outs = [net["blocks"][0](x) for x in (a, a, b, b, b)]
        want = [ref["blocks"][0](x) for x in (a, a, b, b, b)]
    for o, w in zip(outs, want):
        assert torch.equal(o, w)
    assert manager.stats.eval_graphs == 2
    manager.remove()


def test_eval_outputs_with_none_and_constants_replay_like_eager():
    """Layers returning ``(h, None)``, ``(h, None, bias)`` and a dict with ``None`` and flag leaves
    (:class:`tests.engine_models.ConstantsStack`, which checks every constant where it unpacks it) get eval
    graphs: each replay rebuilds the output around the captured constants and the model's output equals the
    eager model's exactly."""
    from tests.engine_models import ConstantsStack

    kinds = ["pair", "triple", "triple", "dict", "plain", "pair"]
    torch.manual_seed(0)
    net = ConstantsStack(kinds)
    ref = ConstantsStack(kinds)
    ref.load_state_dict(net.state_dict())
    manager = GraphManager(net, GraphOptions(backend="eager", capture_eval=True, layers=["layers.*"]),
                           torch.device("cpu"))
    net.eval()
    ref.eval()
    xs = [torch.randn(4, 16) for _ in range(4)]
    with torch.no_grad():
        got = [net(x) for x in xs]
        want = [ref(x) for x in xs]
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert manager.stats.eval_graphs == len(kinds) and manager.stats.eval_replays == len(kinds) * 3
    manager.remove()


class _ReturnsCache(_Block):
    def forward(self, x):
        return super().forward(x), {"cache": [x.shape[0], set()]}


def test_eval_output_leaf_that_may_change_between_calls_stays_eager():
    """A layer whose output holds a mutable object (here a set) cannot be replayed (a replay would return the
    captured one): one warning naming the layer and the leaf, then eager calls equal to the reference."""
    net, ref, manager = _eval_twins(_ReturnsCache, n=1)
    x = torch.randn(4, 8)
    with torch.no_grad():
        net["blocks"][0](x)
        with pytest.warns(UserWarning, match=r"'blocks\.0'.*returns a set at output\[1\]\['cache'\]\[1\]"):
            second = net["blocks"][0](x)
        third = net["blocks"][0](x)
        want = ref["blocks"][0](x)
    for out in (second, third):
        assert torch.equal(out[0], want[0]) and out[1] == want[1]
    assert manager.stats.eval_graphs == 0
    manager.remove()
