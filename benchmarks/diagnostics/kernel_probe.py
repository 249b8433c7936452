"""Which kernels does one attention call and one linear layer launch eagerly, and which when captured in a
CUDA graph the way cg_lightning captures (side-stream warmup, then capture, then replay)?

Why it exists: at the small GPT size in bf16-mixed on 2 GPUs, cudagraph_ddp leaves Lightning "ddp" by ~1e-2
while it equals it bit for bit with deterministic kernels, so some kernel choice may differ under capture.
Prints, per case, the kernel names of an eager forward+backward and of a graph replay of the same work,
and whether the two lists differ. GPU only:

    python -m benchmarks.diagnostics.kernel_probe [--batch 8 --seq 512 --heads 12 --head-dim 64 --d-model 768]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile


def _kernels(fn) -> list:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [n for n in names if not n.startswith(("Memset", "Memcpy"))]


def _case(name: str, make_inputs, body) -> None:
    inputs = make_inputs()

    def eager():
        for t in inputs:
            t.grad = None
        body(*inputs)

    eager()  # warm up the eager path (plans, workspaces)
    eager_names = _kernels(eager)

    static = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            body(*static)
    torch.cuda.current_stream().wait_stream(side)
    for t in static:  # as eager() does: the captured backward writes fresh gradients, it does not add
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        body(*static)
    graph_names = _kernels(graph.replay)
    same = sorted(eager_names) == sorted(graph_names)
    print(f"## {name}: {'same kernels' if same else 'DIFFERENT kernels'}")
    print("eager:", *sorted(set(eager_names)), sep="\n  ")
    print("graph:", *sorted(set(graph_names)), sep="\n  ")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=768)
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}")

    def attn_inputs():
        shape = (a.batch, a.heads, a.seq, a.head_dim)
        return [torch.randn(shape, device=dev, dtype=dt, requires_grad=True) for _ in range(3)]

    def attn(q, k, v):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).float().square().sum().backward()

    _case(f"scaled_dot_product_attention bf16 {a.batch}x{a.heads}x{a.seq}x{a.head_dim} causal", attn_inputs, attn)

    weight = torch.randn(3 * a.d_model, a.d_model, device=dev, requires_grad=True)
    bias = torch.zeros(3 * a.d_model, device=dev, requires_grad=True)

    def lin_inputs():
        return [torch.randn(a.batch, a.seq, a.d_model, device=dev, requires_grad=True)]

    def lin(x):
        with torch.autocast("cuda", dtype=dt):
            y = F.linear(x, weight, bias)
        y.float().square().sum().backward()

    _case(f"linear {a.d_model}->{3 * a.d_model} under bf16 autocast, input {a.batch}x{a.seq}", lin_inputs, lin)


if __name__ == "__main__":
    main()
