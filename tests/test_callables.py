"""``cg_lightning.make_graphed_callables``: returned-gradient lifetime (pytorch/pytorch#181723), and calls whose
tensors differ from the samples in ``requires_grad`` or dtype (accepted where the replay gives eager's result,
refused with a message otherwise; the cases of PyTorch's ``test_graph_make_graphed_callables*`` in
test/test_cuda.py among them).

Each case runs on the eager backend (CPU) and, with the ``cuda`` marker, on real CUDA graphs.
"""

import copy

import pytest
import torch
import torch.nn as nn

import cg_lightning
from tests.engine_models import BACKENDS


def _static_param_grad(graphed, index=0):
    runner = graphed.forward.runner
    n_in = runner.num_inputs
    return runner._bwd.outputs[n_in + index]


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_two_backward_passes_accumulate_and_kept_grad_survives(backend, device):
    torch.manual_seed(0)
    lin = nn.Linear(64, 64, bias=False).to(device)
    g = cg_lightning.make_graphed_callables(lin, (torch.randn(8, 64, device=device, requires_grad=True),), backend=backend)
    x1, x2, dy1, dy2 = (torch.randn(8, 64, device=device) for _ in range(4))
    lin.weight.grad = None
    g(x1.requires_grad_()).backward(dy1)
    kept = lin.weight.grad
    kept_value = kept.clone()
    g(x2.requires_grad_()).backward(dy2)
    expected = dy1.T @ x1 + dy2.T @ x2
    rel = float((lin.weight.grad - expected).norm() / expected.norm())
    assert rel < 1e-6
    # the tensor handed out after the first backward was not overwritten by the second replay
    assert torch.equal(kept_value, dy1.T @ x1) or torch.allclose(kept_value, dy1.T @ x1, rtol=1e-6, atol=1e-6)
    captured = {"g": None}
    h = lin.weight.register_hook(lambda grad: captured.__setitem__("g", grad))
    g(x1).backward(dy1)
    held = captured["g"].clone()
    g(x2).backward(dy2)
    h.remove()
    torch.testing.assert_close(held, dy1.T @ x1, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_accumulation_over_micro_batches_matches_eager(backend, device):
    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)]).to(device)

    data = [(torch.randn(4, 32, device=device), torch.randn(4, 32, device=device)) for _ in range(8)]

    def train(model, blocks):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            for x, y in data[4 * step : 4 * step + 4]:
                h = x
                for b in blocks:
                    h = b(h)
                ((h - y) ** 2).mean().backward()
            opt.step()
        return model

    ref = train(eager := mlp(), list(eager))
    model = mlp()
    graphed = cg_lightning.make_graphed_callables(
        tuple(model), tuple((torch.randn(4, 32, device=device, requires_grad=i > 0),) for i in range(3)),
        backend=backend,
    )
    train(model, list(graphed))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=n)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_opt_out_returns_aliases_of_static_buffer(backend, device):
    lin = nn.Linear(16, 16, bias=False).to(device)
    g = cg_lightning.make_graphed_callables(
        lin, (torch.randn(4, 16, device=device, requires_grad=True),), backend=backend,
        clone_param_grads_on_return=False,
    )
    seen = {}
    h = lin.weight.register_hook(lambda grad: seen.__setitem__("g", grad))
    g(torch.randn(4, 16, device=device, requires_grad=True)).sum().backward()
    h.remove()
    assert seen["g"].data_ptr() == _static_param_grad(g).data_ptr()


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_delayed_wgrad_keeps_aliasing_and_policy_is_frozen(backend, device):
    block = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)).to(device)
    block[0].weight.skip_backward_post_hook = True
    g = cg_lightning.make_graphed_callables(block, (torch.randn(4, 16, device=device, requires_grad=True),), backend=backend)
    runner = g.forward.runner
    assert runner.clone_slots == [False, True]
    block[0].weight.skip_backward_post_hook = False
    block[1].weight.skip_backward_post_hook = True
    assert runner.clone_slots == [False, True]
    seen = {}
    hooks = [p.register_hook(lambda grad, i=i: seen.__setitem__(i, grad)) for i, p in enumerate(block.parameters())]
    g(torch.randn(4, 16, device=device, requires_grad=True)).sum().backward()
    for h in hooks:
        h.remove()
    assert seen[0].data_ptr() == _static_param_grad(g, 0).data_ptr()  # delayed wgrad: aliases
    assert seen[1].data_ptr() != _static_param_grad(g, 1).data_ptr()  # cloned


def test_signature_mismatch_is_a_clear_error():
    lin = nn.Linear(8, 8)
    g = cg_lightning.make_graphed_callables(lin, (torch.randn(2, 8, requires_grad=True),), backend="eager")
    with pytest.raises(cg_lightning.GraphSignatureError, match=r"args\[0\]: captured Tensor\[2, 8\]"):
        g(torch.randn(3, 8, requires_grad=True))


def test_function_closing_over_a_tensor_that_requires_grad_is_refused():
    """The graph could return no gradient for it (torch's version silently drops it): a named error instead."""
    w = torch.randn(8, 8, requires_grad=True)

    def fn(x):
        return x @ w

    with pytest.raises(cg_lightning.GraphCaptureError, match=r"'fn'.*neither its inputs nor its own parameters \(Tensor\[8, 8\]\)"):
        cg_lightning.make_graphed_callables(fn, (torch.randn(2, 8, requires_grad=True),), backend="eager")


def test_same_callable_called_twice_before_backward_is_an_error():
    lin = nn.Linear(8, 8)
    g = cg_lightning.make_graphed_callables(lin, (torch.randn(2, 8, requires_grad=True),), backend="eager")
    y1 = g(torch.randn(2, 8, requires_grad=True))
    g(torch.randn(2, 8, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"called again before the backward of an earlier call"):
        y1.sum().backward()


def test_function_and_keyword_inputs():
    w = torch.randn(8, 8)  # a constant: tensors that require grad must be arguments

    def fn(x, *, scale):
        return (x @ w) * scale

    g = cg_lightning.make_graphed_callables(
        fn, (torch.randn(2, 8, requires_grad=True),), sample_kwargs={"scale": torch.tensor(2.0)}, backend="eager"
    )
    x = torch.randn(2, 8, requires_grad=True)
    out = g(x, scale=torch.tensor(3.0))
    torch.testing.assert_close(out, (x @ w) * 3.0)
    out.sum().backward()
    torch.testing.assert_close(x.grad, (torch.ones(2, 8) * 3.0) @ w.T)


def _four_layer_model(device):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)]).to(device)


def _train_chain(model, blocks, device, steps=5):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = torch.randn(4, 32, generator=g).to(device), torch.randn(4, 32, generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        h = x.requires_grad_()
        for b in blocks:
            h = b(h)
        ((h - y) ** 2).mean().backward()
        opt.step()
    return model


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_memory_saving_mode_trains_like_eager(backend, device):
    """reuse_graph_buffers=True: a 4-layer chain trains 5 steps to the same weights as eager (1e-6); the static
    inputs of layers 1..3 are the previous layers' static outputs and grad-outputs alias the next backward's
    grad-inputs."""
    ref = _train_chain(eager := _four_layer_model(device), list(eager), device)
    model = _four_layer_model(device)
    graphed = cg_lightning.make_graphed_callables(
        tuple(model), tuple((torch.randn(4, 32, device=device, requires_grad=True),) for _ in range(4)),
        backend=backend, reuse_graph_buffers=True,
    )
    runners = [m.forward.runner for m in graphed]
    for prev, nxt in zip(runners, runners[1:]):
        assert nxt.shared_inputs == [0]
        assert nxt.static_inputs[0].data_ptr() == prev._fwd.outputs[0].data_ptr()
        assert prev.static_grad_outputs[0].data_ptr() == nxt._bwd.outputs[0].data_ptr()
    _train_chain(model, list(graphed), device)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=n)


def test_memory_saving_mode_refuses_a_broken_chain():
    model = _four_layer_model("cpu")
    graphed = cg_lightning.make_graphed_callables(
        tuple(model), tuple((torch.randn(4, 32, requires_grad=True),) for _ in range(4)),
        backend="eager", reuse_graph_buffers=True,
    )
    h = graphed[0](torch.randn(4, 32, requires_grad=True))
    with pytest.raises(cg_lightning.BufferReuseError, match=r"was called with another tensor than the previous graphed call's output"):
        graphed[1](h.clone())


@pytest.mark.cuda
def test_memory_saving_mode_uses_less_graph_memory():
    """On CUDA the cloned parameter-gradient buffers go back to the pool: capturing the same chain takes less
    memory with reuse_graph_buffers=True."""

    def captured_bytes(reuse):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(8)]).cuda()
        params = sum(p.numel() * 4 for p in model.parameters())
        graphed = cg_lightning.make_graphed_callables(
            tuple(model), tuple((torch.randn(64, 512, device="cuda", requires_grad=True),) for _ in range(8)),
            reuse_graph_buffers=reuse,
        )
        torch.cuda.synchronize()
        used = torch.cuda.memory_allocated() - before - params
        del graphed, model
        return used

    plain, reuse = captured_bytes(False), captured_bytes(True)
    print(f"graph memory beyond parameters: plain {plain / 2**20:.1f} MiB, reuse {reuse / 2**20:.1f} MiB")
    assert reuse < plain


def test_sample_args_must_be_a_tuple():
    with pytest.raises(TypeError, match=r"sample_args must be a tuple of the callable's positional arguments, e\.g\. \(x,\), got Tensor"):
        cg_lightning.make_graphed_callables(nn.Linear(4, 4), torch.randn(2, 4, requires_grad=True), backend="eager")


def test_wrong_sample_shape_names_the_callable():
    with pytest.raises(cg_lightning.GraphCaptureError, match=r"warmup of layer 'Linear#0'"):
        cg_lightning.make_graphed_callables(nn.Linear(4, 4), (torch.randn(2, 5, requires_grad=True),), backend="eager")


def test_torch_positional_signature_is_accepted():
    """``make_graphed_callables(callables, sample_args, num_warmup_iters, allow_unused_input, pool)`` as torch
    spells it (positionally, not only by keyword); an unused input gets a ``None`` gradient."""
    torch.manual_seed(0)

    class IgnoresSecond(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x, unused):
            return self.lin(x)

    m = IgnoresSecond()
    sample = (torch.randn(2, 8, requires_grad=True), torch.randn(2, 8, requires_grad=True))
    g = cg_lightning.make_graphed_callables(m, sample, 2, True, None, backend="eager")
    x, u = torch.randn(2, 8, requires_grad=True), torch.randn(2, 8, requires_grad=True)
    g(x, u).sum().backward()
    expected = m.lin.weight.sum(0).expand(2, 8)
    torch.testing.assert_close(x.grad, expected, rtol=1e-6, atol=1e-6)
    assert u.grad is None


# ----------------------------------------------------------------- calls that differ in requires_grad or dtype
def _low(device):
    """The autocast dtype of the cases: bfloat16 on CPU, float16 on CUDA (as PyTorch's own test)."""
    return torch.bfloat16 if device == "cpu" else torch.float16


def _autocast(device, enabled=True):
    return torch.autocast(device, dtype=_low(device), enabled=enabled, cache_enabled=False)


class _GatherRows(nn.Module):
    """No parameters: picks row ``i`` of ``x`` for row ``i`` of the output (an exact operation in any dtype)."""

    def forward(self, inputs: dict):
        x = inputs["x"]
        idx = torch.arange(x.size(0), device=x.device).view(-1, 1).repeat(1, x.size(1))
        return {"output": torch.gather(x, 0, idx)}


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "autocast"])
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_parameterless_module_sampled_without_grad_called_with_grad_inputs(backend, device, amp):
    """Sampled with inputs that do not require grad, called with ones that do: the forward replays and matches the
    eager module bit for bit (outputs require grad, as eager ones do); the backward pass, which would need the
    gradient the graph never computes, raises naming the input."""
    x = torch.randn(64, 32, device=device)
    unused = torch.randn(64, 16, device=device)
    with _autocast(device, amp):
        graphed = cg_lightning.make_graphed_callables(_GatherRows(), ({"x": x, "unused_input": unused},),
                                                      allow_unused_input=True, backend=backend)
    control = _GatherRows()
    for _ in range(3):
        data = torch.rand_like(x, requires_grad=True)
        with _autocast(device, amp):
            got = graphed({"x": data, "unused_input": unused})["output"]
            ref = control({"x": data, "unused_input": unused})["output"]
        assert got.requires_grad and ref.requires_grad
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    with pytest.raises(cg_lightning.GraphSignatureError,
                       match=r"args\[0\]\['x'\] was sampled without requires_grad and given with it; this backward pass "
                             r"needs its gradient"):
        got.sum().backward()
    graphed.eval()  # captured in training mode: eval runs the module itself
    control.eval()
    torch.testing.assert_close(graphed({"x": x})["output"], control({"x": x})["output"], rtol=0, atol=0)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_module_sampled_on_data_called_on_activations(backend, device):
    """A Linear sampled with a data-like input (no grad), called on an activation: forward and parameter gradients
    as in eager code (1e-6); a backward pass that needs the activation's gradient raises naming ``args[0]`` (torch's
    function returns no gradient for it, silently); one that leaves the activation out (``inputs=``) or runs under
    ``no_grad`` is served."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 32).to(device)
    ref = copy.deepcopy(lin)
    cg_lightning.make_graphed_callables(lin, (torch.randn(8, 32, device=device),), backend=backend)
    h = torch.randn(8, 32, device=device, requires_grad=True)
    out, ref_out = lin(h * 2), ref(h * 2)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    params = list(lin.parameters())
    out.sum().backward(inputs=params)
    ref_out.sum().backward(inputs=list(ref.parameters()))
    assert h.grad is None
    for p, q in zip(params, ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(lin(h), ref(h), rtol=1e-6, atol=1e-6)
    with pytest.raises(cg_lightning.GraphSignatureError,
                       match=r"'Linear#0': args\[0\] was sampled without requires_grad.*Sample it with "
                             r"requires_grad=True, or pass it \.detach\(\)ed"):
        lin(h * 2).sum().backward()


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_module_sampled_with_grad_called_without_matches_eager(backend, device):
    """Sampled with ``requires_grad``, called on data: the graph's input gradient is dropped, the outputs and
    parameter gradients are eager's (1e-6)."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 32).to(device)
    ref = copy.deepcopy(lin)
    cg_lightning.make_graphed_callables(lin, (torch.randn(8, 32, device=device, requires_grad=True),), backend=backend)
    x = torch.randn(8, 32, device=device)
    out, ref_out = lin(x), ref(x)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    out.square().sum().backward()
    ref_out.square().sum().backward()
    for p, q in zip(lin.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


class _MLPOnDict(nn.Module):
    def __init__(self, d_in, hidden, d_out, drop):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Dropout(drop), nn.Linear(hidden, d_out), nn.Dropout(drop))

    def forward(self, inputs: dict):
        return self.net(inputs["x"])


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "autocast"])
@pytest.mark.parametrize("backend,device", BACKENDS)
def test_chain_of_modules_and_functions_trains_like_eager(backend, device, amp):
    """Two MLPs, a parameterless module and two functions (relu, mse loss) graphed together, trained 4 SGD steps
    under autocast or not: the same weights as eager training (bit for bit on the eager backend, 1e-6 on CUDA).
    Under autocast the second MLP, sampled float32, receives the first one's low-precision output: it is only cast
    (by its first Linear), so the call is accepted. The parameterless module and the functions read their input at
    its own precision, so they are sampled in the dtype they receive. On CUDA a replay draws its own dropout mask
    (graph-safe RNG), so there the dropout probability is 0."""
    drop = 0.1 if backend == "eager" else 0.0
    n, d_in, hidden, d_out = 32, 64, 48, 16

    def model():
        torch.manual_seed(5)
        return nn.Sequential(_MLPOnDict(d_in, hidden, hidden, drop), _MLPOnDict(hidden, hidden, d_out, drop),
                             _GatherRows()).to(device)

    graphed_model, control = model(), model()
    act = _low(device) if amp else torch.float32
    x = torch.randn(n, d_in, device=device)
    unused = torch.randn(n, hidden, device=device, requires_grad=True)
    h = torch.randn(n, hidden, device=device, requires_grad=True)
    h2 = torch.randn(n, d_out, device=device, dtype=act, requires_grad=True)
    y = torch.randn(n, d_out, device=device)
    relu, loss_fn = torch.nn.functional.relu, torch.nn.functional.mse_loss
    with _autocast(device, amp):
        *_, relu_graphed, loss_graphed = cg_lightning.make_graphed_callables(
            (graphed_model[0], graphed_model[1], graphed_model[2], relu, loss_fn),
            (({"x": x, "unused_input": unused},), ({"x": h},), ({"x": h2},), (h2.detach().requires_grad_(),),
             (h2.detach().requires_grad_(), y)),
            allow_unused_input=True, backend=backend,
        )
    data = [(torch.rand_like(x), torch.rand_like(y)) for _ in range(4)]
    for m, act_fn, loss_of in ((graphed_model, relu_graphed, loss_graphed), (control, relu, loss_fn)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        torch.manual_seed(5)
        for inp, target in data:
            opt.zero_grad(set_to_none=True)
            with _autocast(device, amp):
                hidden_out = m[1]({"x": m[0]({"x": inp, "unused_input": unused})})
                loss = loss_of(act_fn(m[2]({"x": hidden_out})["output"]), target)
            loss.backward()
            opt.step()
    tol = 0 if backend == "eager" else 1e-6
    for (name, p), q in zip(graphed_model.named_parameters(), control.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=name)
    assert unused.grad is None
    graphed_model.eval()
    control.eval()
    probe = {"x": data[0][0]}
    torch.testing.assert_close(graphed_model[1]({"x": graphed_model[0](probe)}),
                               control[1]({"x": control[0](probe)}), rtol=0, atol=0)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_autocast_input_only_cast_on_entry_matches_eager(backend, device):
    """A float32-sampled block whose input is read only by autocast's cast (its first Linear), called with the
    low-precision output of the layer before it: outputs, input gradient and parameter gradients are those of the
    eager block, bit for bit on the eager backend (1e-6 on CUDA)."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).to(device)
    ref = copy.deepcopy(block)
    with _autocast(device):
        cg_lightning.make_graphed_callables(block, (torch.randn(8, 32, device=device, requires_grad=True),),
                                            backend=backend)
    tol = 0 if backend == "eager" else 1e-6
    for _ in range(2):
        x = torch.randn(8, 32, device=device, dtype=_low(device), requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        dy = torch.randn(8, 32, device=device)
        with _autocast(device):
            out, ref_out = block(x), ref(x_ref)
        assert out.dtype == ref_out.dtype == _low(device)
        torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
        out.float().backward(dy)
        ref_out.float().backward(dy)
        assert x.grad.dtype == _low(device)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=tol, atol=tol)
    for p, q in zip(block.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol)


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.lin(x)


class _KeepsInputDtype(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x).to(x.dtype)


class _TwoProjections(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.q(x) * self.k(x)


@pytest.mark.parametrize("make,why", [
    (_GatherRows, r"the callable reads it with aten\.gather .*; output\['output'\] would be float32 \[8, 16\] where "
                  r"eager code returns bfloat16"),
    (_Residual, r"the callable reads it with aten\.add\.Tensor .*so the graph would compute in float32 where eager "
                r"code computes in bfloat16"),
    (_KeepsInputDtype, r"a capture-time run with a bfloat16 argument differs from eager code: output would be "
                       r"float32 \[8, 16\] where eager code returns bfloat16"),
    (_TwoProjections, r"it is cast 2 times: the graph sums the casts' gradients in float32, eager code in bfloat16"),
], ids=["gather", "residual", "reads-dtype", "two-casts-with-grad"])
def test_autocast_input_read_at_its_own_precision_is_refused(make, why):
    """Where a copy into the float32 buffer would not give eager's result, the call raises GraphSignatureError
    saying why and what to do, instead of computing in float32 (torch's function does, silently)."""
    module = make()
    wrap = (lambda t: ({"x": t},)) if isinstance(module, _GatherRows) else (lambda t: (t,))
    with _autocast("cpu"):
        graphed = cg_lightning.make_graphed_callables(module, wrap(torch.randn(8, 16, requires_grad=True)),
                                                      backend="eager")
        with pytest.raises(cg_lightning.GraphSignatureError,
                           match=r"sampled float32, called with bfloat16: " + why + r".*Sample it in bfloat16 \(the "
                                 r"dtype it has in the training step\)"):
            graphed(*wrap(torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)))


def test_autocast_input_cast_twice_without_gradient_matches_eager():
    """Two casts of an input that needs no gradient: both projections see eager's bfloat16 values, bit for bit."""
    torch.manual_seed(0)
    module = _TwoProjections()
    ref = copy.deepcopy(module)
    with _autocast("cpu"):
        cg_lightning.make_graphed_callables(module, (torch.randn(8, 16),), backend="eager")
        x = torch.randn(8, 16, dtype=torch.bfloat16)
        out, ref_out = module(x), ref(x)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    out.float().sum().backward()
    ref_out.float().sum().backward()
    for p, q in zip(module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_other_dtype_differences_are_refused():
    """Without autocast a bfloat16 call of a float32 graph would compute in float32 where eager code computes in
    bfloat16; a float32 call of a bfloat16 graph would round its input."""
    lin = nn.Linear(16, 16)
    cg_lightning.make_graphed_callables(lin, (torch.randn(4, 16, requires_grad=True),), backend="eager")
    with pytest.raises(cg_lightning.GraphSignatureError,
                       match=r"args\[0\]: sampled float32, called with bfloat16: the graph would compute on a float32 "
                             r"copy where eager code computes with the bfloat16 tensor"):
        lin(torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True))
    low = nn.Linear(16, 16).to(torch.bfloat16)
    cg_lightning.make_graphed_callables(low, (torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True),),
                                        backend="eager")
    with pytest.raises(cg_lightning.GraphSignatureError,
                       match=r"sampled bfloat16, called with float32: the copy into the bfloat16 static buffer would "
                             r"round it"):
        low(torch.randn(4, 16, requires_grad=True))
