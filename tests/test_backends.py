"""Graph backends: a capture that fails leaves the process as it was before it.

A layer that reads a value on the host fails its capture (``GraphCaptureError``, ``on_capture_error="raise"``).
Afterwards the graph-building flags are off, ``torch.utils.checkpoint`` is unpatched, the host-sync checks are gone,
the module's ``forward``, parameters, buffers, gradients and the RNG states are those of before the failing step, and
the same graphed training as before the failure gives the same numbers again, equal to eager training. On CUDA also:
no stream left capturing, the previous current stream restored, random draws on the GPU work (torch up to 2.11 left
the default generator in capture mode after an invalidated capture), the allocator routing no capture, and later
captures (asking for the same pool too, and a bf16 cuDNN attention after the failure) match eager.

Each engine-level case runs on the eager backend (CPU) and, with the ``cuda`` marker, on real CUDA graphs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import traceback

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tcp

import cg_lightning
from cg_lightning import GraphCaptureError, torch_compat
from cg_lightning.graphs.capture import capture_guard
from cg_lightning.graphs.recompute import checkpointing
from cg_lightning.phase import grad_ready_deferred, is_graph_capturing, is_graph_warmup
from tests import engine_models as em
from tests.engine_models import BACKENDS, assert_grads_equal, batches, eager_reference, graphed_engine, graphed_run


def _host_read(y: torch.Tensor, how: str) -> torch.Tensor:
    """``y`` unchanged after a host read: ``"item"`` (``.item()``, refused by the capture's host-sync check before CUDA
    sees it), ``"device_sync"`` (``torch.cuda.synchronize()``) or ``"cpu_copy"`` (``.cpu()``), both of which CUDA
    refuses during capture, invalidating it. Eager passes read the value, as eager training does."""
    if how == "device_sync":
        torch.cuda.synchronize()
        return y
    value = y.sum().cpu() if how == "cpu_copy" else y.sum()
    return y * (1.0 + 0.0 * value.item())


class _ReadInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, how):
        ctx.how = how
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return _host_read(grad, ctx.how), None


class _HostReadLayer(nn.Module):
    """Linear, BatchNorm (running statistics the warmup updates) and dropout (random numbers the warmup draws), then a
    host read (:func:`_host_read`) at ``where``: ``"forward"``, ``"backward"`` (a custom backward) or ``"reentrant"``
    (inside a reentrant ``torch.utils.checkpoint`` region, bypassed by a patch while graphs are built)."""

    def __init__(self, d: int = 16, recompute: bool = True, how: str = "item", where: str = "forward") -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.BatchNorm1d(d)
        self.drop = nn.Dropout(0.25)
        self.how, self.where = how, where

    def forward(self, x):
        y = self.drop(self.norm(self.lin(x)))
        if self.where == "backward":
            return _ReadInBackward.apply(y, self.how)
        if self.where == "reentrant":
            return tcp.checkpoint(functools.partial(_host_read, how=self.how), y, use_reentrant=True)
        return _host_read(y, self.how)


def _snapshot(module: nn.Module, device: str) -> dict:
    """What a failed capture must leave as it was."""
    cuda = device == "cuda"
    return dict(
        cpu_rng=torch.get_rng_state(), cuda_rng=torch.cuda.get_rng_state() if cuda else None,
        stream=torch.cuda.current_stream() if cuda else None,
        state={k: v.detach().clone() for k, v in module.state_dict().items()},
        grads={k: p.grad for k, p in module.named_parameters()},
        checkpoint_apply=inspect.getattr_static(tcp.CheckpointFunction, "apply"),
    )


def _assert_as_before(snap: dict, module: nn.Module, device: str) -> None:
    assert not is_graph_capturing() and not is_graph_warmup() and not grad_ready_deferred()
    assert inspect.getattr_static(tcp.CheckpointFunction, "apply") is snap["checkpoint_apply"]
    assert "apply" not in tcp.CheckpointFunction.__dict__
    assert checkpointing._anchor_override == [] and checkpointing._region_log == []
    assert gc.isenabled() and torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
    assert float(torch.ones(())) == 1.0 and repr(torch.zeros(1)) == "tensor([0.])"  # host-sync checks are gone
    for k, v in module.state_dict().items():
        assert torch.equal(v, snap["state"][k]), k
    assert all(p.grad is snap["grads"][k] for k, p in module.named_parameters())
    assert torch.equal(torch.get_rng_state(), snap["cpu_rng"])
    if device == "cuda":
        assert not torch.cuda.is_current_stream_capturing()
        assert torch.cuda.current_stream() == snap["stream"]
        assert torch.equal(torch.cuda.get_rng_state(), snap["cuda_rng"])
        # random draws outside capture (a generator left in capture mode raises "Offset increment outside graph
        # capture encountered unexpectedly" here)
        kept = F.dropout(torch.ones(8, device="cuda"), 0.5)
        drawn = torch.rand(4, device="cuda")
        torch.cuda.synchronize()
        assert set(kept.tolist()) <= {0.0, 2.0} and bool(((drawn >= 0) & (drawn < 1)).all())


@pytest.fixture
def deterministic(monkeypatch):
    """Deterministic kernel choices where torch has them (cuDNN; cuBLAS workspace configuration declared; a warning
    instead of an error for operations without a deterministic kernel)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[2], flags[3]


# ----------------------------------------------------------------------------- the capture guard itself
class _TorchAssert(RuntimeError):
    """One of torch's internal asserts (a crash when raised in a destructor, as in ``~MemPool``)."""


class _Allocator:
    """A caching allocator's graph-pool bookkeeping: counts, routing, and the internal asserts that guard them."""

    def __init__(self, rt, name: str) -> None:
        self.rt, self.name, self.counts, self.routed = rt, name, {}, set()

    def fail(self, what: str):
        self.rt.asserts.append(f"{self.name}: {what}")
        return _TorchAssert(f"{what} INTERNAL ASSERT FAILED ({self.name} allocator)")

    def begin(self, pool) -> None:  # create_or_incref_pool, then the routing check
        if pool in self.counts:
            if self.counts[pool] <= 0:
                raise self.fail("it->second->use_count > 0")
            self.counts[pool] += 1
        else:
            self.counts[pool] = 1
        if pool in self.routed:
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        self.routed.add(pool)

    def end(self, pool) -> None:
        if pool not in self.routed:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.routed.discard(pool)

    def release(self, pool) -> None:
        self.counts[pool] -= 1

    def empty_cache(self, assert_no_capture: bool) -> None:
        if assert_no_capture and self.routed:
            raise self.fail("captures_underway.empty()")  # synchronize_and_free_events
        self.counts = {k: v for k, v in self.counts.items() if v > 0}  # freeable pools without live blocks


class _Torch211:
    """torch 2.11's ``CUDAGraph`` and both caching allocators reduced to what a failed capture can leave in the
    process (``aten/src/ATen/cuda/CUDAGraph.cpp``, ``c10/cuda/CUDACachingAllocator.cpp``,
    ``aten/src/ATen/core/CachingHostAllocator.h``): ``capture_begin`` puts the default generator in capture mode,
    then each allocator takes a pool reference and starts routing (device, then pinned host), then the stream
    captures; ``capture_end`` stops at a failing ``cudaStreamEndCapture``, before either allocator stops routing and
    the generator leaves capture mode; ``reset`` gives both references back only after a capture that ended; a
    pool whose count fell to zero is refused until its allocator's cache is emptied (``torch.cuda.empty_cache``,
    ``torch._C._host_emptyCache``); emptying the device cache while it routes a capture is an internal assert. Only
    the device allocator has a Python entry to stop routing (``torch._C._cuda_endAllocateToPool``)."""

    def __init__(self, monkeypatch) -> None:
        self.capturing = self.invalid = self.generator_capturing = self.fail_instantiate = False
        self.stream, self.capture_stream, self.handles, self.asserts = "default", None, 0, []
        self.device, self.host = _Allocator(self, "device"), _Allocator(self, "host")
        rt = self

        class Graph:
            def __init__(self):
                self.handle, self.ended = None, False

            def capture_begin(self, pool=None):
                rt.generator_capturing = True
                if rt.stream == "default":
                    raise RuntimeError("CUDA graphs must be captured on a non-default stream.")
                self.handle = pool if pool is not None else rt.new_handle()
                rt.device.begin(self.handle)
                rt.host.begin(self.handle)
                rt.capturing, rt.invalid, rt.capture_stream = True, False, rt.stream

            def capture_end(self):
                if rt.stream != rt.capture_stream:
                    raise RuntimeError("Capture must end on the same stream it began on.")
                rt.capturing = False  # cudaStreamEndCapture ends the capture, also when it raises
                if rt.invalid:
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
                rt.device.end(self.handle)
                rt.host.end(self.handle)
                rt.generator_capturing = False
                if rt.fail_instantiate:  # once: cudaGraphInstantiateWithFlags
                    rt.fail_instantiate = False
                    raise RuntimeError("CUDA error: out of memory")
                self.ended = True

            def pool(self):
                if not self.ended:
                    raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
                return self.handle

            def reset(self):
                if self.ended:
                    rt.device.release(self.handle)
                    rt.host.release(self.handle)
                    self.ended = False

        class MemPool:
            def __init__(self):
                self.id = rt.new_handle()
                rt.device.counts[self.id] = 1  # the MemPool object's reference, in the device allocator only

            def use_count(self):
                return rt.device.counts[self.id]

        @contextlib.contextmanager
        def stream(s):
            saved, rt.stream = rt.stream, s
            try:
                yield
            finally:
                rt.stream = saved

        def end_allocate_to_pool(device, handle):
            try:
                rt.device.end(handle)
            except RuntimeError:
                return False
            return True

        for name, value in dict(CUDAGraph=Graph, MemPool=MemPool, graph_pool_handle=self.new_handle, stream=stream,
                                synchronize=lambda: None, current_device=lambda: 0,
                                empty_cache=lambda: rt.device.empty_cache(assert_no_capture=True),
                                is_current_stream_capturing=lambda: rt.capturing and rt.stream == rt.capture_stream,
                                ).items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(torch_compat, "end_allocate_to_pool", end_allocate_to_pool)
        monkeypatch.setattr(torch_compat, "empty_host_cache", lambda: rt.host.empty_cache(assert_no_capture=False))
        monkeypatch.setattr(capture_guard, "_replacements", {})
        monkeypatch.setattr(capture_guard, "_abandoned", [])

    def new_handle(self):
        self.handles += 1
        return (0, self.handles)


_HALF_WAY = ("invalidated", "invalidated-unnoticed", "stream-left-switched", "instantiate-failed")


@pytest.mark.parametrize("failure", ("refused",) + _HALF_WAY)
def test_guarded_capture_undoes_what_a_failed_capture_leaves(monkeypatch, failure):
    """The capture guard's bookkeeping, on a model of torch 2.11's capture (no GPU needed). The block raises before
    CUDA sees anything (``refused``), after CUDA invalidated the capture, or not at all while ``capture_end`` fails
    (CUDA's invalidation unnoticed, or a late failure in instantiation), also when the block leaves another stream
    current: the error propagates unchanged; nothing captures; the stream is the previous one; the generator is out
    of capture mode; the device allocator routes nothing; no internal assert fires. Two later captures into the same
    pool, each dropped before the next (its counts fall to zero in between), work: into the pool itself after a
    refused capture, into one replacement pool after a capture that stopped half-way (the host allocator, which
    nothing can stop, still routes the first pool), and the replacement goes with the pool object."""
    rt = _Torch211(monkeypatch)
    pool = torch.cuda.MemPool()
    graph = torch.cuda.CUDAGraph()
    rt.fail_instantiate = failure == "instantiate-failed"
    unnoticed = failure in ("invalidated-unnoticed", "instantiate-failed")
    with pytest.raises(RuntimeError, match="previous error during capture" if failure == "invalidated-unnoticed"
                       else "out of memory" if failure == "instantiate-failed" else "the block's error"):
        with capture_guard.guarded_capture(graph, "side", pool):
            rt.invalid = failure in ("invalidated", "invalidated-unnoticed", "stream-left-switched")
            if failure == "stream-left-switched":
                rt.stream = "other"
            if not unnoticed:
                raise RuntimeError("the block's error")
    assert not rt.capturing and rt.stream == "default" and not rt.generator_capturing
    assert not rt.device.routed and not rt.asserts
    stuck = failure in ("invalidated", "invalidated-unnoticed", "stream-left-switched")
    assert rt.host.routed == ({pool.id} if stuck else set())
    used = []
    for _ in range(2):
        again = torch.cuda.CUDAGraph()
        with capture_guard.guarded_capture(again, "side", pool):
            pass
        used.append(again.pool())
        again.reset()
    torch.cuda.empty_cache()
    assert not rt.device.routed and rt.host.routed == ({pool.id} if stuck else set()) and not rt.asserts
    assert used[0] == used[1] and (used[0] == pool.id) == (failure == "refused")
    del pool
    gc.collect()
    assert capture_guard._replacements == {}


def test_guarded_capture_refuses_a_stream_already_capturing(monkeypatch):
    """A capture stream left capturing is refused before anything begins: no routing, no pool count taken."""
    rt = _Torch211(monkeypatch)
    pool = torch.cuda.MemPool()
    rt.capturing, rt.capture_stream = True, "side"
    with pytest.raises(RuntimeError, match="already capturing"):
        with capture_guard.guarded_capture(torch.cuda.CUDAGraph(), "side", pool):
            pass
    assert not rt.device.routed and not rt.host.routed and pool.use_count() == 1


# ----------------------------------------------------------------------------- graph manager + DDP engine
@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("segments", [True, False], ids=["segments", "per-layer"])
@pytest.mark.parametrize("where", ["forward", "backward", "reentrant"])
def test_failed_capture_in_training_leaves_the_process_as_it_was(where, segments, backend, device, deterministic):
    """Training graphed with the manager before and after a capture that fails: the failing step changes nothing,
    and the graphed training after it equals the one before bit for bit, and eager training within 1e-6."""
    before, _, _, _, _ = graphed_run(em.SeedLayer, backend, device)
    torch.manual_seed(0)
    model = em.Stack(functools.partial(_HostReadLayer, where=where), 16, 2).to(device)
    manager, engine = graphed_engine(model, device, backend=backend, layers=["layers.*"], segments=segments)
    data = batches(2, 16, device)
    manager.begin_step(0)  # warmup step: eager, recorded
    engine(data[0]).backward()
    manager.end_step()
    engine.finish_grad_sync()
    engine.zero_grad_buffer()
    snap = _snapshot(model, device)
    main_grads = {k: p.main_grad.clone() for k, p in model.named_parameters()}
    manager.begin_step(1)  # captures every recorded call at the step's first graphed call
    with pytest.raises(GraphCaptureError, match=rf"{where if where == 'backward' else 'forward'} of layer "
                                                r"'layers\.[01]'.*host"):
        engine(data[1])
    _assert_as_before(snap, model, device)
    assert all(torch.equal(p.main_grad, main_grads[k]) for k, p in model.named_parameters())
    assert all("forward" in layer.__dict__ for layer in model.layers)  # still dispatched by the manager
    manager.remove()
    assert all("forward" not in layer.__dict__ for layer in model.layers)
    after, _, _, _, _ = graphed_run(em.SeedLayer, backend, device)
    assert_grads_equal(after, before, tol=0)
    assert_grads_equal(after, eager_reference(em.SeedLayer, device=device)[0])


def test_a_host_read_under_the_trainer_is_raised_once(deterministic):
    """``Trainer.fit`` raises the GraphCaptureError alone: the host read it quotes whole (operation and source line)
    is kept as its ``host_sync``, not chained below it as a second traceback with the same words."""
    from lightning.pytorch import seed_everything

    from cg_lightning.graphs.errors import HostSyncError
    from tests.helpers import cg_strategy, make_trainer
    from tests.helpers_config import HostReadRegressor, TinyData

    seed_everything(0)
    with pytest.raises(GraphCaptureError, match=r"forward of layer 'blocks\.0': host read of tensor data: \.item\(\) "
                                                r"at File .*helpers_config\.py") as info:
        make_trainer(cg_strategy(layers=["blocks.*"]), 6).fit(HostReadRegressor(3, 5), TinyData(3, 16))
    error = info.value
    assert error.__cause__ is None and error.__suppress_context__ and isinstance(error.host_sync, HostSyncError)
    shown = "".join(traceback.format_exception(error))
    assert shown.count("Traceback (most recent call last)") == 1
    assert shown.count("scale = y.abs().max().item()") == 1, shown[-3000:]


# ----------------------------------------------------------------------------- make_graphed_callables
def _mlp(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 32)).to(device)


def _train(model: nn.Module, device: str, graphed: bool, **options) -> dict:
    """Three SGD steps of ``model`` (graphed with ``make_graphed_callables`` if ``graphed``) on fixed data, the RNG
    seeded alike either way; returns the parameters after them."""
    if graphed:
        sample = torch.randn(8, 32, device=device, requires_grad=True)
        cg_lightning.make_graphed_callables(model, (sample,), **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    if device == "cuda":
        torch.cuda.manual_seed_all(1)
    for x, y in zip(batches(3, 32, device), batches(4, 32, device)[1:]):
        opt.zero_grad(set_to_none=True)
        ((model(x.requires_grad_()) - y) ** 2).mean().backward()
        opt.step()
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def _assert_params_equal(got: dict, ref: dict) -> None:
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_failed_make_graphed_callables_leaves_the_process_as_it_was(where, backend, device, deterministic):
    """A module whose capture fails keeps its own ``forward``; a model graphed afterwards trains bit for bit like
    the same model graphed before the failure and like eager training (deterministic settings)."""
    options = dict(backend=backend)
    before = _train(_mlp(device), device, True, **options)
    bad = _HostReadLayer(where=where).to(device)
    sample = torch.randn(8, 16, device=device, requires_grad=True)
    bad.lin.weight.grad = torch.ones_like(bad.lin.weight)  # a gradient the caller holds
    snap = _snapshot(bad, device)
    with pytest.raises(GraphCaptureError, match=rf"{where} of layer '_HostReadLayer#0'.*\.item\(\)"):
        cg_lightning.make_graphed_callables(bad, (sample,), **options)
    _assert_as_before(snap, bad, device)
    assert "forward" not in bad.__dict__
    _assert_params_equal(_train(_mlp(device), device, True, **options), before)
    _assert_params_equal(before, _train(_mlp(device), device, False))


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["item", "device_sync", "cpu_copy"])
def test_cuda_failed_capture_leaves_stream_generator_and_pool_usable(how, deterministic):
    """A capture that fails (refused by the host-sync check: ``item``; invalidated by CUDA: ``device_sync``,
    ``cpu_copy``) into a pool the test holds: afterwards nothing captures, the previous stream is current, the GPU
    draws random numbers, and models graphed into the same pool one after the other (each one's graphs dropped
    before the next, so the pool's counts fall to zero in between) train bit for bit like eager; the allocator's
    cache empties (it routes no capture)."""
    pool = torch.cuda.MemPool()
    bad = _HostReadLayer(how=how).cuda()
    sample = torch.randn(8, 16, device="cuda", requires_grad=True)
    snap = _snapshot(bad, "cuda")
    with pytest.raises(GraphCaptureError, match=r"forward of layer '_HostReadLayer#0'") as info:
        cg_lightning.make_graphed_callables(bad, (sample,), pool=pool)
    del info
    gc.collect()
    _assert_as_before(snap, bad, "cuda")
    eager = _train(_mlp("cuda"), "cuda", False)
    for _ in range(2):
        _assert_params_equal(_train(_mlp("cuda"), "cuda", True, pool=pool), eager)
        gc.collect()
    torch.cuda.empty_cache()
    assert not torch.cuda.is_current_stream_capturing()


# ----------------------------------------------------------------------------- many captures in one process
class _KeywordMLP(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Dropout(0.1)

    def forward(self, x, *, scale):
        return self.fc2(self.drop(F.gelu(self.fc1(x)))) * scale


class _CudnnAttention(nn.Module):
    """bf16 ``scaled_dot_product_attention`` through cuDNN, keyword inputs, attention dropout."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.p = p

    def forward(self, *, q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)


def _against_eager(module: nn.Module, args: dict, kwargs: dict, rtol: float, atol: float) -> None:
    """Graph ``module`` (a deep copy stays eager) on samples like ``args`` (positional, by name) and ``kwargs``; two
    calls on fresh values, the CUDA RNG seeded alike for both: outputs equal bit for bit, input and (accumulated)
    parameter gradients within ``rtol``/``atol``."""
    eager = copy.deepcopy(module)
    gen = torch.Generator().manual_seed(3)

    def fresh(specimen):
        return torch.randn(specimen.shape, generator=gen).to(specimen).requires_grad_(specimen.requires_grad)

    cg_lightning.make_graphed_callables(module, tuple(map(fresh, args.values())),
                                        sample_kwargs={n: fresh(t) for n, t in kwargs.items()})
    for call in range(2):
        a = [fresh(t) for t in args.values()]
        kw = {n: fresh(t) for n, t in kwargs.items()}
        a2 = [t.detach().clone().requires_grad_(t.requires_grad) for t in a]
        kw2 = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in kw.items()}
        torch.cuda.manual_seed(10 + call)
        ref = eager(*a2, **kw2)
        dy = torch.randn(ref.shape, generator=gen).to(ref)
        ref.backward(dy)
        torch.cuda.manual_seed(10 + call)
        out = module(*a, **kw)
        out.backward(dy)
        torch.testing.assert_close(out, ref, rtol=0, atol=0, msg=f"call {call}: output")
        for t, r in zip(a + list(kw.values()), a2 + list(kw2.values())):
            if r.requires_grad:
                torch.testing.assert_close(t.grad, r.grad, rtol=rtol, atol=atol, msg=f"call {call}: input grad")
        for (n, p), q in zip(module.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=f"call {call}: {n}")


@pytest.mark.cuda
def test_cuda_many_make_graphed_callables_in_one_process(deterministic):
    """fp32 MLP with a keyword input, a capture invalidated by CUDA, bf16 cuDNN attention (keyword q/k/v, dropout),
    a capture refused by the host-sync check, an MLP again: each graphed one against eager. Tolerances: outputs bit
    for bit; fp32 gradients bit for bit; bf16 attention gradients within torch's bf16 defaults (rtol 1.6e-2, atol
    1e-5: cuDNN's attention backward may accumulate in another order)."""
    dev = "cuda"
    x = torch.empty(8, 32, device=dev, requires_grad=True)
    scale = torch.empty(1, device=dev)
    _against_eager(_KeywordMLP().to(dev), {"x": x}, {"scale": scale}, rtol=0, atol=0)
    for how in ("device_sync", "item"):
        with pytest.raises(GraphCaptureError, match=r"forward of layer '_HostReadLayer#0'"):
            cg_lightning.make_graphed_callables(_HostReadLayer(how=how).to(dev),
                                                (torch.randn(8, 16, device=dev, requires_grad=True),))
        assert not torch.cuda.is_current_stream_capturing()
        qkv = {n: torch.empty(2, 4, 128, 64, device=dev, dtype=torch.bfloat16, requires_grad=True) for n in "qkv"}
        _against_eager(_CudnnAttention(), {}, qkv, rtol=1.6e-2, atol=1e-5)
    _against_eager(_KeywordMLP().to(dev), {"x": x}, {"scale": scale}, rtol=0, atol=0)
    gc.collect()
    torch.cuda.empty_cache()  # the allocator routes no capture (else its captures_underway.empty() assert fires)
