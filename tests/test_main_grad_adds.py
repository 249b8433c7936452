"""``main_grad_adds``: a segment's members add their gradients into ``main_grad`` together, in few
multi-tensor kernels, with the same additions in the same order as one ``add_`` per parameter."""

import pytest
import torch
from lightning.pytorch import Callback, seed_everything

import cg_lightning
from cg_lightning.main_grad_adds import MainGradAdds
from cg_lightning.examples.data import TextDataModule
from cg_lightning.examples.gpt import GPTLightningModule
from tests.helpers import DATA, MODEL, make_trainer, strategy_for


class _CountForeachAdds:
    """Counts ``torch._foreach_add_`` calls and the tensors each one adds into."""

    def __init__(self, monkeypatch) -> None:
        self.calls = []
        real = torch._foreach_add_

        def counting(mains, *args, **kwargs):
            self.calls.append(list(mains))
            return real(mains, *args, **kwargs)

        monkeypatch.setattr(torch, "_foreach_add_", counting)


def test_shares_of_one_main_grad_are_added_in_order_and_bit_identical(monkeypatch):
    """Two shares of the same ``main_grad`` queued in one batch: the first batch is flushed before the second
    share joins, so no kernel holds a tensor twice, and float32 rounding equals ``add_`` one by one (the
    values are chosen so that (m + a) + b and m + (a + b) differ)."""
    counter = _CountForeachAdds(monkeypatch)
    m1, m2 = torch.tensor([1.0, 3.0]), torch.tensor([5.0])
    a, b, c = torch.tensor([1e-8, 2.0 ** -23]), torch.tensor([1e-8, 2.0 ** -23]), torch.tensor([0.25])
    assert not torch.equal((m1 + a) + b, m1 + (a + b))
    want1, want2 = m1.clone().add_(a).add_(b), m2.clone().add_(c)
    adds = MainGradAdds(flush_bytes=2 ** 20)
    adds.add([m1, m2], [a, c])
    adds.add([m1], [b])  # m1 is pending: [m1, m2] go first, then m1 alone at the flush
    assert len(counter.calls) == 1 and [t is m for t, m in zip(counter.calls[0], [m1, m2])] == [True, True]
    assert adds.flush() == []
    assert len(counter.calls) == 2 and counter.calls[1][0] is m1
    assert torch.equal(m1, want1) and torch.equal(m2, want2)
    adds.flush()
    assert len(counter.calls) == 2  # nothing pending: nothing launched


def test_flush_bytes_bounds_what_stays_pending(monkeypatch):
    """``flush_bytes=0`` launches at every ``add`` (one kernel per backward body); a bound of 100 bytes
    launches once 25 float32 elements are pending."""
    counter = _CountForeachAdds(monkeypatch)
    mains = [torch.zeros(10) for _ in range(3)]
    every = MainGradAdds(flush_bytes=0)
    for m in mains:
        every.add([m], [torch.ones(10)])
    assert len(counter.calls) == 3
    bounded = MainGradAdds(flush_bytes=100)
    bounded.add(mains[:2], [torch.ones(10)] * 2)  # 80 bytes: pending
    assert len(counter.calls) == 3
    bounded.add(mains[2:], [torch.ones(10)])  # 120 bytes: launched
    assert len(counter.calls) == 4 and len(counter.calls[3]) == 3
    assert all(torch.equal(m, torch.full((10,), 2.0)) for m in mains)


class _CountMainGradAddsPerStep(Callback):
    """In the second step after capture: how many multi-tensor additions went into ``main_grad`` buffers."""

    def __init__(self, monkeypatch, step: int) -> None:
        self.monkeypatch, self.step, self.counter, self.main_grads = monkeypatch, step, None, set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.main_grads = {id(p.main_grad) for p in pl_module.parameters()}
            self.counter = _CountForeachAdds(self.monkeypatch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step + 1:
            self.monkeypatch.undo()

    def kernels(self) -> int:
        return sum(1 for call in self.counter.calls if call and id(call[0]) in self.main_grads)


@pytest.mark.parametrize("segments,kernels", [(True, 1), (False, 4)])
def test_a_segment_adds_its_members_gradients_in_one_kernel(monkeypatch, segments, kernels):
    """The example GPT's 4 blocks chained into one segment: one multi-tensor addition into ``main_grad`` per
    step for all 48 block parameters (the backward graph's last body); per-layer graphs: one per block. The
    losses equal Lightning "ddp" exactly either way (same seed and data, 6 steps)."""
    losses = {}
    for name in ("ddp", "cg"):
        seed_everything(3, workers=True)
        model = GPTLightningModule(**dict(MODEL, n_layer=4))
        count = _CountMainGradAddsPerStep(monkeypatch, step=4)
        trainer = make_trainer(strategy_for(name, segments=segments, whole_step=False), 6, [count] if name == "cg" else [],
                               validation=True)
        trainer.fit(model, datamodule=TextDataModule(**DATA))
        losses[name] = trainer.callback_metrics["train_loss"].item()
    assert trainer.strategy.last_graph_stats.forward_replays > 0
    assert count.kernels() == kernels
    assert losses["cg"] == losses["ddp"]


class _FusedWgradLinear(torch.autograd.Function):
    """``x @ w.T`` whose backward accumulates the weight gradient straight into ``w.main_grad`` and returns a
    zero placeholder (Megatron-LM's gradient-accumulation fusion; the DDP engine honours it through
    ``grad_added_to_main_grad``)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        wgrad = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        if not hasattr(w, "main_grad"):
            return g @ w, wgrad
        w.main_grad.add_(wgrad)
        w.grad_added_to_main_grad = True
        return g @ w, torch.zeros_like(w)


class _FusedThenRecomputing(torch.nn.Module):
    """Layer 0 uses its weight P through :class:`_FusedWgradLinear`; layer 1 recomputes
    (``CheckpointWithoutOutput``) a function that closes over P, so P is a foreign parameter of layer 1."""

    def __init__(self, d: int, other=None) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d, bias=False)
        self.other = [other]  # a list, so that layer 0's Linear is not registered as layer 1's submodule

    def forward(self, x):
        if self.other[0] is None:
            return torch.tanh(_FusedWgradLinear.apply(x, self.lin.weight))
        from cg_lightning import CheckpointWithoutOutput

        ckpt = CheckpointWithoutOutput()
        h = ckpt.checkpoint(lambda t: torch.tanh(t @ self.other[0].weight.t()), x)
        out = self.lin(h)
        ckpt.discard_output_and_register_recompute(out)
        return out


def _fit_fused_then_recomputing(graphs):
    from lightning.pytorch import LightningModule

    class Model(LightningModule):
        def __init__(self, d=16):
            super().__init__()
            self.inp = torch.nn.Linear(d, d)
            first = _FusedThenRecomputing(d)
            self.layers = torch.nn.ModuleList([first, _FusedThenRecomputing(d, other=first.lin)])

        def training_step(self, batch, batch_idx):
            x = self.inp(batch[0])
            for layer in self.layers:
                x = layer(x)
            loss = x.pow(2).mean()
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            data = torch.randn(64, 8, 16, generator=torch.Generator().manual_seed(0)) * 3
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)

    seed_everything(0)
    model = Model()
    model.losses = []
    trainer = make_trainer(cg_lightning.CUDAGraphDDPStrategy(graphs=graphs), 8, accumulate_grad_batches=2)
    trainer.fit(model)
    return model, trainer


@pytest.mark.parametrize("segments", [True, False])
def test_nested_share_of_a_parameter_another_member_writes_itself_goes_in_first(segments):
    """A segment [layer 0, layer 1]: layer 1's recomputation leaves a share for layer 0's weight P, and layer 0's
    backward (it runs after layer 1's) writes its own share into P.main_grad directly. Eager training adds the
    nested share first; queued until the end of the segment it would go in second, and with accumulation 2
    (main_grad not zero) the weights came out 3.7e-9 apart after 8 steps. Reference: the same engine with graphs
    off (Lightning "ddp" has no main_grad, so the fused path would not run); losses and weights bit-identical."""
    ref_model, _ = _fit_fused_then_recomputing({"enabled": False})
    model, trainer = _fit_fused_then_recomputing({"warmup_steps": 2, "backend": "eager", "segments": segments})
    assert trainer.strategy.last_graph_stats.forward_replays == 2 * 2 * (8 - 2)
    assert trainer.strategy.last_graph_stats.segments == (1 if segments else 0)
    assert [float(v) for v in model.losses] == [float(v) for v in ref_model.losses]
    for (name, a), (_, b) in zip(model.state_dict().items(), ref_model.state_dict().items()):
        assert torch.equal(a, b), name


def test_fresh_main_grads_take_their_first_share_by_copy_and_equal_a_fill_then_adds(monkeypatch):
    """``fresh``: the first share of each ``main_grad`` is copied in (no fill, no addition), a second share is
    added after it, and ``settle`` zeroes the ones that got none; the values equal zeroing then adding, bit for bit
    (a ``-0.0`` share stays ``-0.0``, equal to the ``+0.0`` of ``0 + -0.0``)."""
    adds_counter = _CountForeachAdds(monkeypatch)
    copies = []
    real_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: (copies.append(list(dst)), real_copy(dst, src)))
    g = torch.Generator().manual_seed(0)
    shares = [torch.randn(5, generator=g) for _ in range(3)] + [torch.tensor([-0.0, 1.0, 2.0, 3.0, 4.0])]
    stale = [torch.full((5,), 9.0) for _ in range(4)]  # what the last step left: never filled
    want = [torch.zeros(5) for _ in range(4)]
    want[0].add_(shares[0]).add_(shares[1])
    want[2].add_(shares[3])
    adds = MainGradAdds(fresh=stale)
    adds.add([stale[0], stale[2]], [shares[0], shares[3]])
    assert adds.is_fresh(stale[1]) and not adds.is_fresh(stale[0])
    adds.add([stale[0]], [shares[1]])  # pending: the copies go first, then this share is added
    adds.settle()
    assert [[t is m for t, m in zip(c, [stale[0], stale[2]])] for c in copies] == [[True, True]]
    assert len(adds_counter.calls) == 1 and adds_counter.calls[0][0] is stale[0]
    for got, ref in zip(stale, want):
        assert torch.equal(got, ref)
    assert not adds.is_fresh(stale[1]) and not adds.is_fresh(stale[3])  # settled: zeros, as a fill leaves


def test_settle_zeroes_only_the_named_fresh_main_grads():
    """Before a bucket's all-reduce the engine settles that bucket's ``main_grad`` tensors only."""
    a, b = torch.full((3,), 5.0), torch.full((3,), 5.0)
    adds = MainGradAdds(fresh=[a, b])
    adds.settle([a])
    assert torch.equal(a, torch.zeros(3)) and torch.equal(b, torch.full((3,), 5.0)) and adds.is_fresh(b)
