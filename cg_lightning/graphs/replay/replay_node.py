"""The replay node: an ``autograd.Function`` standing for one graphed call in the autograd graph."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...torch_compat import will_engine_execute_node


class ReplayFunction(torch.autograd.Function):
    """Replays a :class:`~cg_lightning.graphs.replay.runner.LayerGraphRunner`'s forward and backward graphs.

    ``apply(runner, *runner.node_inputs(input_tensors))``: the inputs, the inputs of further gradient pieces
    (:mod:`~cg_lightning.graphs.replay.input_pieces`), the parameters. The parameters are extra inputs so that
    autograd keeps edges to their ``AccumulateGrad`` nodes: the hooks registered there (the DDP engine's)
    fire after every backward replay, as they do in eager execution. Forward returns the detached
    static outputs (views of graph memory, overwritten by the next forward replay).
    """

    @staticmethod
    def forward(ctx, runner, *tensors):
        ctx.runner = runner
        ctx.backward_ran = False
        outputs = runner.replay_forward(tensors[: runner.num_inputs])
        ctx.generation = runner.forward_generation
        non_diff = [o for o, g in zip(outputs, runner.output_requires_grad) if not g]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs):
        runner = ctx.runner
        runner.check_generation(ctx.generation)
        check_second_backward(ctx, runner)
        check_leaves_accumulate(ctx, (runner,), len(runner.apply_edges))
        return (None, *runner.replay_backward(grad_outputs))


def check_second_backward(ctx, runner) -> None:
    """Raise if this node's backward already ran (its captured backward reads what its forward left in the
    static buffers, once)."""
    if ctx.backward_ran:
        raise RuntimeError(
            f"graphed {runner.name!r}: a second backward pass reached the same call (backward or "
            "torch.autograd.grad with retain_graph=True, then another one). Its captured backward runs once "
            "per call: it reads the activations that call left in the graph's static buffers. "
            "Take such extra gradients (a gradient-norm probe on a hidden state) from a step without graphs, "
            "or leave the layer out of graphs.layers."
        )
    ctx.backward_ran = True


def check_leaves_accumulate(ctx, runners, n_edges: int) -> None:
    """Raise if a runner that adds into ``main_grad`` is reached by a backward that does not accumulate into
    its parameters (``torch.autograd.grad``, ``backward(inputs=...)`` without them)."""
    if any(r.adds_into_main_grad for r in runners) and not _leaves_accumulate(ctx, n_edges):
        raise RuntimeError(
            f"graphed {runners[0].name!r}: its backward was reached by torch.autograd.grad or by "
            "backward(inputs=...) that leaves its parameters out. Its captured backward adds the weight "
            "gradients into main_grad whatever the caller asked for, so eager results cannot be matched. "
            "Call loss.backward() (Lightning does) or accelerator.backward(loss), or leave the layer out of "
            "graphs.layers."
        )


def _leaves_accumulate(ctx, n_edges: int) -> bool:
    """Whether this backward pass accumulates into the parameters behind the node's last ``n_edges`` inputs
    (their ``AccumulateGrad`` nodes will run): false under ``torch.autograd.grad`` and under
    ``backward(inputs=...)`` without them. Without edges (``graphs.direct_grad_ready``) it cannot be told,
    and true is returned."""
    nodes = [node for node, _ in ctx.next_functions[len(ctx.next_functions) - n_edges:] if node is not None]
    if not nodes:
        return True
    try:
        return any(will_engine_execute_node(node) for node in nodes)
    except RuntimeError:  # "a leaf node was passed ... while running autograd.grad()": nothing accumulates
        return False
