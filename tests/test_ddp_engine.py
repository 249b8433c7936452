"""The DDP engine (:mod:`cg_lightning.ddp`). Across two processes (gloo): bucket overlap, missing gradients, a stuck
rank, golden counts; in one process: gradient dtypes, counts and their errors, ``no_sync``, the gradient buffer.

Each two-process case runs ``tests/scripts/engine_dist.py`` with torchrun's environment (:func:`tests.launchers.run_ranks`)
and a timeout;
the engine's own timeout (``DDPOptions.timeout_s``) is 10 s there, so a hang would fail the test, not
block CI.
"""

import copy
import json
import os

import pytest
import torch

from cg_lightning.ddp import DataParallelEngine, DDPOptions, GradSyncError
from cg_lightning.ddp.buffer import ALIGN_BYTES
from tests import engine_models as em
from tests.helpers import ROOT
from tests.launchers import run_ranks

SCRIPT = os.path.join(ROOT, "tests", "scripts", "engine_dist.py")


def _run(scenario: str, tmp_path, timeout: float = 120) -> list:
    (log,) = run_ranks(SCRIPT, [(["--scenario", scenario, "--out", str(tmp_path)], 2)], str(tmp_path), timeout,
                       check=False)
    results = []
    for r in range(2):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote nothing:\n{log[-6000:]}"
        results.append(json.loads(path.read_text()))
    return results


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_first_bucket_all_reduce_starts_before_backward_reaches_first_layer(tmp_path):
    """In a replayed iteration the first bucket (the head's and last layer's gradients) is dispatched while
    the backward has not yet reached layers.0, and buckets go out in index order on both ranks."""
    for res in _run("overlap", tmp_path):
        assert "error" not in res, res.get("error")
        events = res["events"]
        assert res["buckets"] > 4
        first_dispatch = next(i for i, e in enumerate(events) if e[0] == "dispatch")
        first_layer_ready = next(i for i, e in enumerate(events) if e[0] == "ready" and e[1].startswith("layers.0."))
        assert first_dispatch < first_layer_ready, events
        dispatches = [e[1] for e in events if e[0] == "dispatch"]
        assert dispatches == list(range(res["buckets"])), dispatches
        # the dispatches interleave with the backward: some happen before the last grad-ready event
        last_ready = max(i for i, e in enumerate(events) if e[0] == "ready")
        assert sum(1 for i, e in enumerate(events) if e[0] == "dispatch" and i < last_ready) >= res["buckets"] - 2


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_missing_gradient_is_an_error_on_both_ranks(tmp_path):
    for res in _run("missing", tmp_path):
        msg = res.get("error")
        assert msg, f"rank {res['rank']} did not raise"
        assert res["iteration"] == 2
        assert f"seen on rank {res['rank']}" in msg
        assert "\n  rank 1: layers.1.projection.bias (ready 0 times, expected 1)" in msg
        assert "layers.1.checkpointed.weight (ready 0 times, expected 1)" in msg and "rank 0:" not in msg
        assert "recomputation" in msg  # the usual causes are listed
        assert res["error_after_s"] < 10


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_stuck_rank_gives_an_error_within_the_timeout(tmp_path):
    rank0, rank1 = _run("stuck", tmp_path)
    assert rank1.get("stuck")
    # the cause and the rank first (no peer watch here: in a world of two the other rank is named)
    assert rank0["error"].startswith("rank 0: rank 1 has been silent for 10 s (ddp.timeout_s) during the end of "
                                     "the backward (the grad-ready agreement of iteration 2)"), rank0["error"]
    assert 9 <= rank0["error_after_s"] < 40


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_golden_counts_that_differ_across_ranks_fail_the_first_iteration(tmp_path):
    for res in _run("golden", tmp_path):
        msg = res.get("error")
        assert msg and res["iteration"] == 0
        # checkpointed.* runs one nested backward per application; projection's two uses merge in one pass
        assert "golden counts" in msg and "layers.1.checkpointed.weight: rank 0=1, rank 1=2" in msg
        assert "projection" not in msg


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_average_and_sum_reduce_the_ranks_gradients(tmp_path):
    """average=True gives the mean of the two ranks' eager gradients, average=False their sum (1e-6)."""
    for res in _run("reduce", tmp_path):
        assert res["average"] < 1e-6 and res["sum"] < 1e-6, res


def test_main_grad_dtype_option():
    """grad_dtype picks main_grad's dtype: float32 accumulation for bfloat16 parameters (exact sum of the
    micro-batches' bf16 gradients, in fp32), and the optimizer sees param.grad in the parameter's dtype."""
    import torch

    from cg_lightning.ddp import DataParallelEngine, DDPOptions

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).to(torch.bfloat16)
    ref = torch.nn.Linear(8, 8).to(torch.bfloat16)
    ref.load_state_dict(lin.state_dict())
    engine = DataParallelEngine(lin, DDPOptions(grad_dtype="float32"))
    xs = [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(3)]
    expected = torch.zeros(8, 8, dtype=torch.float32)
    with engine.no_sync():
        for x in xs[:2]:
            lin(x).sum().backward()
    lin(xs[2]).sum().backward()
    engine.finish_grad_sync()
    for x in xs:
        ref.zero_grad()
        ref(x).sum().backward()
        expected += ref.weight.grad.float()
    assert lin.weight.main_grad.dtype == torch.float32
    torch.testing.assert_close(lin.weight.main_grad, expected, rtol=0, atol=0)
    engine.expose_grads()
    assert lin.weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lin.weight.grad, expected.to(torch.bfloat16), rtol=0, atol=0)


def test_more_reports_than_golden_is_a_named_error():
    """A parameter reporting ready more often than in the first iteration (two backward passes before one
    finish_grad_sync) is an error naming it, as a missing one is."""
    import torch

    from cg_lightning.ddp import DataParallelEngine, DDPOptions, GradSyncError

    lin = torch.nn.Linear(4, 4)
    engine = DataParallelEngine(lin, DDPOptions())
    lin(torch.randn(2, 4)).sum().backward()
    engine.finish_grad_sync()
    engine.zero_grad_buffer()
    lin(torch.randn(2, 4)).sum().backward()
    lin(torch.randn(2, 4)).sum().backward()
    with pytest.raises(GradSyncError, match=r"weight \(ready 2 times, expected 1\)"):
        engine.finish_grad_sync()


def test_batched_grad_ready_reports_count_like_one_by_one():
    """A graph replay reports its parameters through one batched call (the engine's grad-ready reporter,
    ``engine.grad_ready.batch``). Against the same reports made one by one on a twin engine: the same
    per-parameter counts, the same complete/dispatched buckets in the same order, the same overshoot error
    naming the parameter, nothing counted under no_sync, and with a ready_observer every occurrence observed in
    order."""
    import torch

    from cg_lightning.ddp import DataParallelEngine, DDPOptions, GradSyncError

    def engine_of(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 2))
        # tiny buckets: several buckets, so completion and dispatch order are visible
        return DataParallelEngine(model, DDPOptions(bucket_size_mb=16 / 2**20)), model

    one, m1 = engine_of(0)
    many, m2 = engine_of(0)
    assert len(one.buckets) > 2
    params1, params2 = list(m1.parameters()), list(m2.parameters())
    order = [4, 5, 0, 2, 1, 3, 4]  # out of bucket order, one parameter twice
    def grad_ready_reporter(p):
        return (one if any(p is q for q in params1) else many).grad_ready.notifier(p)

    batch = many.grad_ready.batch([grad_ready_reporter(params2[i]) for i in order])
    assert all(many.grad_ready.batches([grad_ready_reporter(p)]) for p in params2)

    def report(k):
        for i in order:
            grad_ready_reporter(params1[i])()
        batch()

    # first iteration: counts become the golden counts (every parameter must report: the rest one by one)
    rest = [i for i in range(len(params1)) if i not in order]
    for e, ps in ((one, params1), (many, params2)):
        for i in rest:
            grad_ready_reporter(ps[i])()
    report(0)
    assert [b.slot_counts for b in one.buckets] == [b.slot_counts for b in many.buckets]
    for e in (one, many):
        e.finish_grad_sync()
    assert one.last_ready_counts == many.last_ready_counts
    assert many.last_ready_counts["0.weight"] == 1 and many.last_ready_counts["2.weight"] == 2

    # replayed iterations: the buckets complete and are dispatched in the same order
    for e, ps in ((one, params1), (many, params2)):
        for i in rest:
            grad_ready_reporter(ps[i])()
    report(1)
    assert one.dispatch_log == many.dispatch_log == list(range(len(one.buckets)))
    assert all(b.complete for b in many.buckets)
    for e in (one, many):
        e.finish_grad_sync()

    # under no_sync nothing is counted
    with many.no_sync():
        batch()
    assert all(c == 0 for b in many.buckets for c in b.slot_counts)

    # a batch reported twice overshoots: the same named error as one by one
    for e, ps in ((one, params1), (many, params2)):
        for i in rest:
            grad_ready_reporter(ps[i])()
    report(2)
    for i in order:
        grad_ready_reporter(params1[i])()
    batch()
    errors = []
    for e in (one, many):
        with pytest.raises(GradSyncError) as info:
            e.finish_grad_sync()
        errors.append(str(info.value).split(": ", 1)[1].split(". ")[0])
    assert errors[0] == errors[1] and "2.weight (ready 4 times, expected 2)" in errors[1], errors

    # with an observer, every occurrence is observed, in order
    seen = []
    many.ready_observer = seen.append
    for b in many.buckets:
        b.reset()
    batch()
    assert [next(i for i, q in enumerate(params2) if q is p) for p in seen] == order


def test_expose_grads_casts_after_a_parameter_dtype_change():
    """expose_grads' fast path (main_grad views assigned as they are) must not break when a parameter's dtype
    changed after the engine was built (module.to(float64)): param.grad is then main_grad cast to it, as the
    per-parameter path does."""
    import torch

    from cg_lightning.ddp import DataParallelEngine, DDPOptions

    lin = torch.nn.Linear(3, 2)
    engine = DataParallelEngine(lin, DDPOptions())
    lin.weight.main_grad.fill_(0.5)
    engine.expose_grads()
    assert lin.weight.grad is lin.weight.main_grad
    lin.to(torch.float64)
    engine.expose_grads()
    assert lin.weight.grad.dtype == torch.float64
    assert torch.equal(lin.weight.grad, torch.full((2, 3), 0.5, dtype=torch.float64))


def test_a_cast_after_setup_is_named_in_the_missing_gradient_error():
    """Casting the model after the engine was built (``module.double()`` in a training hook) replaces the
    parameters' gradient accumulators, so the engine's grad-ready hooks never fire: the missing-gradient error
    names the cast, the parameters' old and new dtypes, and says to cast before ``Trainer.fit``, without the list of
    usual causes after it."""
    import torch

    from cg_lightning.ddp import DataParallelEngine, DDPOptions, GradSyncError

    lin = torch.nn.Linear(4, 4)
    engine = DataParallelEngine(lin, DDPOptions())
    lin(torch.randn(2, 4)).sum().backward()
    engine.finish_grad_sync()
    engine.zero_grad_buffer()
    lin.double()
    lin(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    with pytest.raises(GradSyncError, match=r"(?s)weight \(ready 0 times, expected 1\).*2 parameter\(s\) changed "
                       r"dtype or device after the engine was set up \(weight \(torch.float32 on cpu -> "
                       r"torch.float64 on cpu\).*Cast or move the model before Trainer.fit") as raised:
        engine.finish_grad_sync()
    assert "Usual causes" not in str(raised.value)  # the known cause is not buried under the generic ones


def test_a_missing_gradient_without_a_cast_does_not_mention_one():
    import torch

    from cg_lightning.ddp import DataParallelEngine, DDPOptions, GradSyncError

    lin = torch.nn.Linear(4, 4)
    engine = DataParallelEngine(lin, DDPOptions())
    lin(torch.randn(2, 4)).sum().backward()
    engine.finish_grad_sync()
    engine.zero_grad_buffer()
    with pytest.raises(GradSyncError) as info:
        engine.finish_grad_sync()
    assert "ready 0 times, expected 1" in str(info.value) and "changed dtype" not in str(info.value)


def test_a_backward_that_reaches_no_parameter_names_the_model_and_the_detached_forward():
    """A model whose forward ran but whose output the loss does not use (detached): every parameter 0 times. The
    error names the model's class and says what usually does that (a GAN generator's detached output) and what
    to do; a backward that reaches some parameters does not say it."""
    import torch

    from cg_lightning.ddp import DataParallelEngine, DDPOptions, GradSyncError

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    engine = DataParallelEngine(model, DDPOptions())
    model(torch.randn(2, 4)).sum().backward()
    engine.finish_grad_sync()
    engine.zero_grad_buffer()
    other = torch.nn.Parameter(torch.ones(1))
    (model(torch.randn(2, 4)).detach() * other).sum().backward()
    with pytest.raises(GradSyncError, match=r"(?s)parameters of Sequential did not report ready.*No parameter of this "
                       r"model \(Sequential\) got a gradient.*GAN generator's output.*torch.no_grad\(\)"):
        engine.finish_grad_sync()
    engine.close()
    engine2 = DataParallelEngine(model, DDPOptions())
    model(torch.randn(2, 4)).sum().backward()
    engine2.finish_grad_sync()
    engine2.zero_grad_buffer()
    model[1](torch.randn(2, 4)).sum().backward()  # the first layer gets nothing: a partial miss
    with pytest.raises(GradSyncError) as info:
        engine2.finish_grad_sync()
    assert "0.weight (ready 0 times, expected 1)" in str(info.value) and "No parameter of this model" not in str(info.value)


def test_main_grad_put_back_into_the_buffer_after_its_storage_was_swapped():
    """``param.grad.data = x`` while param.grad is main_grad swaps main_grad's storage out of the gradient
    buffer; before the next backward (keeping x) and at zero_grad_buffer (dropping it) main_grad points into the
    buffer again, so later gradients are zeroed and all-reduced with the rest."""
    import torch

    from cg_lightning.ddp import DataParallelEngine, DDPOptions

    lin = torch.nn.Linear(3, 2)
    engine = DataParallelEngine(lin, DDPOptions())
    lin(torch.ones(1, 3)).sum().backward()
    engine.finish_grad_sync()
    engine.expose_grads()
    lin.weight.grad.data = torch.full((2, 3), 7.0)
    assert lin.weight.main_grad.data_ptr() != engine._buffer_views[engine.params.index(lin.weight)].data_ptr()
    engine.take_back_grads()
    view = engine._buffer_views[engine.params.index(lin.weight)]
    assert lin.weight.main_grad.data_ptr() == view.data_ptr() and torch.equal(view, torch.full((2, 3), 7.0))
    lin(torch.ones(1, 3)).sum().backward()
    engine.finish_grad_sync()
    assert torch.equal(lin.weight.main_grad, torch.full((2, 3), 8.0))  # 7 kept, the new gradient (ones) added
    engine.expose_grads()
    lin.weight.grad.data = torch.full((2, 3), 5.0)
    engine.zero_grad_buffer()
    assert lin.weight.main_grad.data_ptr() == view.data_ptr() and not lin.weight.main_grad.any()


def test_missing_gradient_is_a_named_error():
    torch.manual_seed(0)
    model = em.Stack(em.SeedLayer, 16, 2, recompute=False)
    engine = DataParallelEngine(model, DDPOptions())
    x = torch.randn(4, 16)
    engine(x).backward()
    engine.finish_grad_sync()
    engine.zero_grad_buffer()
    # next iteration: skip the last layer, its parameters never report ready
    h = model.inp(x)
    h = model.layers[0](h)
    model.head(h).pow(2).mean().backward()
    with pytest.raises(GradSyncError, match=r"layers\.1\.projection\.weight \(ready 0 times, expected 1\)"):
        engine.finish_grad_sync()


def test_grad_added_to_main_grad_skips_add_and_reports_ready():
    lin = torch.nn.Linear(4, 4)
    engine = DataParallelEngine(lin, DDPOptions())
    lin(torch.randn(2, 4)).sum().backward()
    engine.finish_grad_sync()
    first = lin.weight.main_grad.clone()
    engine.zero_grad_buffer()
    lin.weight.grad_added_to_main_grad = True
    lin.weight.main_grad.fill_(7.0)
    lin(torch.randn(2, 4)).sum().backward()
    assert lin.weight.grad is None and lin.weight.grad_added_to_main_grad is False
    assert torch.all(lin.weight.main_grad == 7.0)
    assert engine.bucket_of[lin.weight].counts[lin.weight] == 1
    engine.finish_grad_sync()
    assert not torch.equal(first, lin.weight.main_grad)


def test_no_sync_accumulates_without_counting():
    lin = torch.nn.Linear(4, 4)
    engine = DataParallelEngine(lin, DDPOptions())
    xs = [torch.randn(2, 4) for _ in range(3)]
    with engine.no_sync():
        lin(xs[0]).sum().backward()
        lin(xs[1]).sum().backward()
    assert engine.bucket_of[lin.weight].counts[lin.weight] == 0
    lin(xs[2]).sum().backward()
    engine.finish_grad_sync()
    ref = torch.nn.Linear(4, 4)
    ref.load_state_dict(lin.state_dict())
    for x in xs:
        ref(x).sum().backward()
    torch.testing.assert_close(lin.weight.main_grad, ref.weight.grad, rtol=1e-6, atol=1e-6)


def test_main_grad_is_a_view_of_one_contiguous_buffer():
    model = em.Stack(em.SeedLayer, 8, 2, recompute=False)
    engine = DataParallelEngine(model, DDPOptions(bucket_size_mb=0.0005))
    assert len(engine.buffers_) == 1
    buf = engine.buffers_[0].data
    total = 0
    params = list(model.parameters())
    for p in params:
        assert p.main_grad.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        total += p.numel()
    align = ALIGN_BYTES // buf.element_size()
    assert total <= buf.numel() < total + align * len(params)  # only the gaps that align each start
    assert len(engine.buckets) > 1
    # the last parameter sits at the start of the buffer (reverse layout: buckets fill in backward order)
    last = list(model.parameters())[-1]
    assert last.main_grad.data_ptr() == buf.data_ptr()


def test_every_main_grad_starts_aligned_as_a_tensor_of_its_own():
    """After a 1-element bias the next parameter still starts at a multiple of 16 bytes (in fp32 and bf16): CUDA's
    multi-tensor norm of ``clip_grad_norm_`` sums aligned and unaligned tensors in different orders, and eager
    gradients are tensors of their own, aligned. The views do not overlap and the gaps stay zero."""
    for dtype in (torch.float32, torch.bfloat16):
        model = torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.Linear(1, 5), torch.nn.Linear(5, 3)).to(dtype)
        engine = DataParallelEngine(model, DDPOptions())
        buf = engine.buffers_[0].data
        spans = []
        for p in model.parameters():
            start = p.main_grad.data_ptr() - buf.data_ptr()
            assert start % ALIGN_BYTES == 0, (dtype, tuple(p.shape), start)
            spans.append((start, start + p.numel() * buf.element_size()))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        for p in model.parameters():
            p.main_grad.fill_(1)
        assert buf.sum().item() == sum(p.numel() for p in model.parameters())


def test_fresh_buffers_equal_a_fill_and_a_main_grad_written_outside_the_hooks_is_named():
    """``zero_grad_buffer(fill=False)`` with ``grad_adds_batched(fresh=True)``: the first share is copied into the
    stale buffer, so the gradients equal a zeroed run's; a gradient that reached ``main_grad`` without the hooks
    (``grad_added_to_main_grad``) would have added onto stale values, and is a GradSyncError naming the parameter."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    engine = DataParallelEngine(lin, DDPOptions())
    x = torch.randn(2, 4)
    lin(x).sum().backward()
    engine.finish_grad_sync()
    want = {n: p.main_grad.clone() for n, p in lin.named_parameters()}
    for p in lin.parameters():
        p.main_grad.fill_(3.0)  # stale values the unfilled buffer keeps
    engine.zero_grad_buffer(fill=False)
    with engine.grad_adds_batched(fresh=True):
        lin(x).sum().backward()
        engine.finish_grad_sync()
    for n, p in lin.named_parameters():
        assert torch.equal(p.main_grad, want[n]), n
    engine.zero_grad_buffer(fill=False)
    lin.weight.grad_added_to_main_grad = True
    with pytest.raises(GradSyncError, match=r"'weight' reached main_grad without the engine's hook"):
        with engine.grad_adds_batched(fresh=True):
            lin(x).sum().backward()


def _adopting_backward(engine, model, x, adopt=True):
    engine.zero_grad_buffer(fill=False)
    with engine.grad_adds_batched(fresh=True, adopt=adopt):
        model(x).sum().backward()
        engine.finish_grad_sync()


def test_adopted_first_shares_become_the_main_grad_storage_and_are_kept_or_undone():
    """One process, ``grad_adds_batched(fresh=True, adopt=True)``: each ``main_grad`` takes autograd's gradient tensor
    as its storage (no copy), with the values of a filled run; ``undo`` puts every ``main_grad`` back into the buffer;
    ``keep`` makes the adopted storage the home (restored after ``param.grad.data = x``, zeroed by
    ``zero_grad_buffer``) and frees the buffer, and later backwards copy into it and equal eager training."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    ref = copy.deepcopy(model)
    engine = DataParallelEngine(model, DDPOptions())
    x = torch.randn(5, 4)
    ref(x).sum().backward()
    views = [p.main_grad.data_ptr() for p in model.parameters()]
    _adopting_backward(engine, model, x)
    assert all(p.main_grad.data_ptr() != v for p, v in zip(model.parameters(), views))  # not the buffer any more
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.main_grad, r.grad)
    engine.adoption.undo()
    assert [p.main_grad.data_ptr() for p in model.parameters()] == views and not engine.adoption.kept

    _adopting_backward(engine, model, x)
    engine.adoption.keep()
    assert engine.adoption.kept and all(b.released for b in engine.buffers_)
    assert engine.buffers_[0].data.untyped_storage().nbytes() == 0  # the buffer's memory is given back
    homes = [p.main_grad.data_ptr() for p in model.parameters()]
    engine.expose_grads()
    first = model[0].weight
    first.grad.data = first.grad.data.clone()  # moved away: put back (with its values) before the next backward
    engine.take_back_grads()
    assert [p.main_grad.data_ptr() for p in model.parameters()] == homes
    engine.zero_grad_buffer()
    assert all(p.main_grad.abs().sum() == 0 for p in model.parameters())
    for _ in range(2):  # later backwards: no adoption (the home is kept), equal to eager training
        ref.zero_grad(set_to_none=True)
        ref(x).sum().backward()
        _adopting_backward(engine, model, x)
        assert [p.main_grad.data_ptr() for p in model.parameters()] == homes
        for p, r in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.main_grad, r.grad)


def _eager_backward(engine, model, x):
    engine.take_back_grads()
    model(x).sum().backward()
    engine.finish_grad_sync()
    engine.expose_grads()


def test_transient_main_grads_hold_no_buffer_between_steps_and_equal_eager_training():
    """``adoption.want()``: a watched backward proves that only the hooks write ``main_grad``; the next zeroing frees
    the buffer and leaves each ``main_grad`` a zero placeholder (no memory, reads as zeros, refuses in-place writes);
    each backward then adopts autograd's gradient (accumulation adds onto it), equal to eager training at every step;
    ``stop`` puts the values back into a restored buffer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    ref = copy.deepcopy(model)
    engine = DataParallelEngine(model, DDPOptions())
    adoption = engine.adoption
    views = [p.main_grad.data_ptr() for p in model.parameters()]
    adoption.want()
    xs = [torch.randn(5, 4) for _ in range(4)]

    def check():
        for p, r in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, r.grad) and p.grad is p.main_grad

    for i, x in enumerate(xs):
        ref.zero_grad(set_to_none=True)
        for p in model.parameters():
            p.grad = None  # zero_grad(set_to_none=True) on the exposed gradients
        _eager_backward(engine, model, x)  # its take_back_grads zeroes: transient from the second step on
        ref(x).sum().backward()
        check()
        assert adoption.proven and adoption.transient == (i > 0)
        if i == 0:
            assert [p.main_grad.data_ptr() for p in model.parameters()] == views
        else:
            assert all(b.released and b.data.untyped_storage().nbytes() == 0 for b in engine.buffers_)
            # each main_grad is autograd's own tensor (its storage exactly its size), not a view of a flat buffer; the
            # freed buffer's addresses may be handed out again, so addresses prove nothing here
            assert all(
                p.main_grad.untyped_storage().nbytes() == p.main_grad.numel() * p.main_grad.element_size()
                for p in model.parameters()
            )
    engine.zero_grad_buffer()
    first = model[0].weight.main_grad
    assert first.stride() == (0, 0) and first.untyped_storage().nbytes() == 4 and first.abs().sum() == 0
    with pytest.raises(RuntimeError):
        first.add_(1.0)
    # accumulation: a second backward without zeroing adds onto the adopted gradients
    ref.zero_grad(set_to_none=True)
    for x in xs[:2]:
        _eager_backward(engine, model, x)
        ref(x).sum().backward()
    check()
    adoption.stop()
    assert not adoption.transient and not any(b.released for b in engine.buffers_)
    assert [p.main_grad.data_ptr() for p in model.parameters()] == engine._buffer_ptrs  # views of the buffer again
    assert engine._buffer_views[0].untyped_storage().data_ptr() == engine.buffers_[0].data.data_ptr()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.main_grad, r.grad)
    engine.zero_grad_buffer()
    assert all(p.main_grad.abs().sum() == 0 for p in model.parameters())


def test_a_gradient_set_before_a_transient_backward_brings_the_buffer_back_and_is_added_onto():
    """Transient storage, a step begun (``step_begins``: placeholders while the last gradients are still exposed), then
    ``param.grad`` set to a prior before the backward (as ``on_before_backward`` may after ``zero_grad``): the buffer is
    restored for good and the backward adds onto the prior, equal to eager PyTorch. A ``fill_`` into a placeholder
    (torch lets it through, into the zero behind all of them) is undone at the next zeroing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    ref = copy.deepcopy(model)
    engine = DataParallelEngine(model, DDPOptions())
    engine.adoption.want()
    x = torch.randn(5, 4)
    for p in model.parameters():
        p.grad = None
    _eager_backward(engine, model, x)  # the proof
    engine.adoption.step_begins()  # the buffer freed, placeholders
    assert engine.adoption.transient
    model[0].weight.main_grad.fill_(3.0)
    engine.adoption.step_begins()
    assert all(p.main_grad.abs().sum() == 0 for p in model.parameters())  # undone
    for p, r in zip(model.parameters(), ref.parameters()):
        p.grad = torch.full_like(p, 0.25)
        r.grad = torch.full_like(r, 0.25)
    _eager_backward(engine, model, x)
    ref(x).sum().backward()
    assert not engine.adoption.transient and not engine.adoption.wanted
    assert not any(b.released for b in engine.buffers_)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad) and p.main_grad.data_ptr() in engine._buffer_ptrs


def test_no_transient_main_grads_where_a_kernel_writes_them():
    """A ``main_grad`` written by a kernel (``grad_added_to_main_grad``) in the watched backward: nothing is proven,
    the buffer stays."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    engine = DataParallelEngine(lin, DDPOptions())
    engine.adoption.want()
    x = torch.randn(5, 4)
    out = lin(x).sum()
    lin.weight.grad_added_to_main_grad = True
    out.backward()
    engine.finish_grad_sync()
    engine.zero_grad_buffer()
    assert not engine.adoption.proven and not engine.adoption.transient
    assert not any(b.released for b in engine.buffers_)


def test_no_adoption_where_the_buffer_is_read_whole_or_the_dtypes_differ():
    """``find_unused_parameters`` (its tracking reads the buckets) and a ``grad_dtype`` other than the parameters'
    (a share of another dtype cannot be the storage): the first shares are copied, the buffer kept."""
    torch.manual_seed(0)
    x = torch.randn(5, 4)
    for options in (DDPOptions(find_unused_parameters=True), DDPOptions(grad_dtype="float32")):
        model = torch.nn.Linear(4, 3)
        if options.grad_dtype:
            model = model.to(torch.bfloat16)
        engine = DataParallelEngine(model, options)
        views = [p.main_grad.data_ptr() for p in model.parameters()]
        _adopting_backward(engine, model, x.to(next(model.parameters()).dtype))
        engine.adoption.keep()
        assert not engine.adoption.kept and not any(b.released for b in engine.buffers_), options
        assert [p.main_grad.data_ptr() for p in model.parameters()] == views, options
