"""``cg_lightning.make_graphed_callables``: returned-gradient lifetime (pytorch/pytorch#181723).

Each case runs on the eager backend (CPU) and, with the ``cuda`` marker, on real CUDA graphs.
"""

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
