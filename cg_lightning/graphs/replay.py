"""The replay node: an ``autograd.Function`` standing for one graphed call in the autograd graph."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


class ReplayFunction(torch.autograd.Function):
    """Replays a :class:`~cg_lightning.graphs.runner.LayerGraphRunner`'s forward and backward graphs.

    ``apply(runner, *input_tensors, *runner.apply_edges)``. The parameters are extra inputs so that
    autograd keeps edges to their ``AccumulateGrad`` nodes: the hooks registered there (the DDP engine's)
    fire after every backward replay, as they do in eager execution. Forward returns the detached
    static outputs (views of graph memory, overwritten by the next forward replay).
    """

    @staticmethod
    def forward(ctx, runner, *tensors):
        ctx.runner = runner
        outputs = runner.replay_forward(tensors[: runner.num_inputs])
        ctx.generation = runner.forward_generation
        non_diff = [o for o, g in zip(outputs, runner.output_requires_grad) if not g]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs):
        ctx.runner.check_generation(ctx.generation)
        return (None, *ctx.runner.replay_backward(grad_outputs))
