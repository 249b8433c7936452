"""``cg_lightning.make_graphed_callables``: returned-gradient lifetime (pytorch/pytorch#181723).

Each case runs on the eager backend (CPU) and, with the ``cuda`` marker, on real CUDA graphs.
"""

import pytest
import torch
import torch.nn as nn

import cg_lightning

BACKENDS = [
    pytest.param("eager", "cpu", id="eager-cpu"),
    pytest.param("cuda", "cuda", id="cuda", marks=pytest.mark.cuda),
]


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


def test_function_and_keyword_inputs():
    w = torch.randn(8, 8, requires_grad=True)

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
