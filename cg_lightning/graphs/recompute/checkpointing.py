"""Activation recomputation that cooperates with per-layer graph capture.

Two utilities, both inert outside graph building except for their normal checkpointing:

* :class:`CheckpointWithoutOutput`: run a function without keeping its autograd graph, free its
  output's storage once a later tensor no longer needs it in the forward, and recompute it when the
  backward reaches that later tensor. During graph **warmup** it does not checkpoint (plain autograd, so
  parameters used only inside the function become visible to parameter discovery); during **capture**
  it checkpoints and the recomputation (with its nested backward) is captured into the backward graph.
  The nested backward writes parameter gradients into ``param.grad``; the graph code moves them into
  ``main_grad`` (Megatron-LM PR #6373).
* :func:`checkpoint`: reentrant recomputation (``torch.utils.checkpoint(use_reentrant=True)``) that is
  bypassed during warmup and capture (Megatron-LM PR #3919): a reentrant backward cannot run under
  ``torch.autograd.grad``. Inside a graphed layer the region is therefore *not* checkpointed: its
  activations stay alive between the forward and backward replays, costing the memory the checkpoint
  would have saved.

:func:`bypass_reentrant_checkpoint` applies the same bypass to a user's own
``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` while graphs are built.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
import torch.utils.checkpoint as torch_checkpoint

from ...torch_compat import reentrant_checkpoint_calls
from ..autocast import autocast_as, autocast_state
from .discovery import leaves_inside
from ..state import is_graph_capturing, is_graph_warmup


def _rng_states() -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """CPU and CUDA RNG states; CUDA's only outside capture (reading it there breaks the capture, and a
    captured region draws from the graph-safe generator, whose offsets advance on every replay)."""
    cuda_ok = torch.cuda.is_available() and torch.cuda.is_initialized() and not is_graph_capturing()
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if cuda_ok else [])


def _set_rng_states(states: Tuple[torch.Tensor, List[torch.Tensor]]) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


_EAGER_ANCHORS: dict = {}
_anchor_override: List[torch.Tensor] = []


def recompute_anchor(device: torch.device) -> torch.Tensor:
    """The leaf a :class:`CheckpointWithoutOutput` region takes as an extra input.

    It requires grad, so the region's backward (the nested recomputation backward) is always part of the
    autograd graph, even when no argument requires grad. A captured ``torch.autograd.grad`` only runs
    nodes on a path to its targets, so a graph runner installs its own anchor (:func:`using_anchor`) and
    adds it to them; being created on the capture stream, its ``AccumulateGrad`` node is bound to that
    stream (autograd binds a node to the stream current at its creation).
    """
    if _anchor_override:
        return _anchor_override[-1]
    key = str(device)
    anchor = _EAGER_ANCHORS.get(key)
    if anchor is None:
        anchor = _EAGER_ANCHORS[key] = torch.zeros((), device=device, requires_grad=True)
    return anchor


@contextlib.contextmanager
def using_anchor(anchor: torch.Tensor) -> Iterator[None]:
    """Make :func:`recompute_anchor` return ``anchor`` inside this context."""
    _anchor_override.append(anchor)
    try:
        yield
    finally:
        _anchor_override.pop()


class _NoOutputCheckpointFunction(torch.autograd.Function):
    """Forward without autograd; backward runs a nested backward through the recomputed outputs."""

    @staticmethod
    def forward(ctx, run_function, owner, _always_grad, *args):
        with torch.no_grad():
            outputs = run_function(*args)
        tensor_idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.tensor_idx = tensor_idx
        ctx.args = [None if i in tensor_idx else a for i, a in enumerate(args)]
        ctx.save_for_backward(*[args[i] for i in tensor_idx])
        owner._ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        outputs = ctx.recomputed_outputs
        if outputs is None:
            raise RuntimeError(
                "CheckpointWithoutOutput: the backward reached the checkpointed function before its "
                "output was recomputed; call discard_output_and_register_recompute(t) with a tensor t "
                "computed from the checkpoint's output."
            )
        ctx.recomputed_outputs = None
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = [None] * len(ctx.args)
        for i, detached in zip(ctx.tensor_idx, ctx.detached_inputs):
            grads[i] = detached.grad if detached.requires_grad else None
        ctx.detached_inputs = None
        return (None, None, None, *grads)


class CheckpointWithoutOutput:
    """Recompute a function's output in the backward, and free that output in between.

    Usage, inside a module's forward::

        ckpt = CheckpointWithoutOutput()
        hidden = ckpt.checkpoint(self.inner, x)        # no autograd graph kept for self.inner
        out = self.projection(hidden)                   # uses hidden
        ckpt.discard_output_and_register_recompute(out) # frees hidden's storage; recomputed in backward

    ``fn`` may return a tensor or a tuple of tensors; tensor and non-tensor arguments are accepted.
    RNG states (CPU and CUDA) are saved at :meth:`checkpoint` and restored for the recomputation, so
    dropout inside ``fn`` draws the same masks; the autocast settings in force at :meth:`checkpoint` are
    re-entered for the recomputation (the backward itself runs outside autocast), so the recomputed output
    has the forward's dtype and values, as with ``torch.utils.checkpoint``.

    During graph warmup (:func:`is_graph_warmup`) ``checkpoint`` just calls ``fn`` with autograd and
    ``discard_output_and_register_recompute`` does nothing. The idea and the warmup bypass come from
    Megatron-LM's ``CheckpointWithoutOutput`` (PRs #3919 and #6373).

    Raises:
        RuntimeError: if :meth:`discard_output_and_register_recompute` is called before
            :meth:`checkpoint`, or the backward reaches the function before the recomputation ran.
    """

    def __init__(self) -> None:
        self._run_function: Optional[Callable] = None
        self._ctx = None
        self._outputs: Optional[Tuple[torch.Tensor, ...]] = None
        self._rng = None
        self._autocast: Optional[tuple] = None
        self._bypassed = False

    def checkpoint(self, fn: Callable, *args: Any):
        """Run ``fn(*args)`` without keeping its autograd graph (plain call during graph warmup)."""
        if is_graph_warmup():
            self._bypassed = True
            return fn(*args)
        self._bypassed = False
        self._run_function = fn
        self._rng = _rng_states()
        self._autocast = autocast_state()  # recomputed under the forward's autocast, as torch.utils.checkpoint does
        # The extra input requiring grad keeps the backward reachable even when no argument requires grad
        # (parameters used inside ``fn`` still need their nested backward).
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        outputs = _NoOutputCheckpointFunction.apply(fn, self, recompute_anchor(device), *args)
        self._outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the checkpoint's output storage; recompute it when the backward reaches ``hook_tensor``.

        Args:
            hook_tensor: a tensor computed (directly or not) from the checkpoint's output, whose gradient
                is computed before the output is needed again in the backward.
        """
        if self._bypassed:
            return
        if self._outputs is None:
            raise RuntimeError("discard_output_and_register_recompute() called before checkpoint()")
        for out in self._outputs:
            out.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad: torch.Tensor) -> None:
        ctx = self._ctx
        saved = ctx.saved_tensors
        detached = [t.detach().requires_grad_(t.requires_grad) for t in saved]
        args = list(ctx.args)
        for i, t in zip(ctx.tensor_idx, detached):
            args[i] = t
        current_rng = _rng_states()
        _set_rng_states(self._rng)
        try:
            with torch.enable_grad(), autocast_as(self._autocast):
                recomputed = self._run_function(*args)
        finally:
            _set_rng_states(current_rng)
        recomputed = recomputed if isinstance(recomputed, tuple) else (recomputed,)
        with torch.no_grad():
            for out, new in zip(self._outputs, recomputed):
                out.untyped_storage().resize_(new.untyped_storage().size())
                out.untyped_storage().copy_(new.untyped_storage())
        ctx.recomputed_outputs = recomputed
        ctx.detached_inputs = detached
        self._run_function = None
        self._outputs = None
        self._ctx = None


def checkpoint(fn: Callable, *args: Any, **kwargs: Any):
    """Reentrant activation recomputation, bypassed while graphs are warmed up or captured.

    Outside graph building this is ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True,
    **kwargs)``. During warmup and capture it calls ``fn(*args)`` directly: a reentrant backward refuses
    to run under ``torch.autograd.grad`` and cannot run inside a captured graph (Megatron-LM PR #3919).
    Memory cost: in a graphed layer the region's activations are kept, as if it were not checkpointed.
    """
    if is_graph_warmup() or is_graph_capturing():
        return _bypassed_call(fn, args)
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=True, **kwargs)


#: While a forward is captured, one entry per bypassed reentrant region: the ``id`` of each leaf tensor
#: (parameter) used inside it. Eager execution would finalize each of them once in the region's own
#: nested backward; the graph runner replays those grad-ready notifications (see ``replay_plan.py``).
_region_log: List[List[set]] = []


@contextlib.contextmanager
def recording_bypassed_regions() -> Iterator[List[set]]:
    """Collect, for every reentrant region bypassed in this context, the leaves used inside it."""
    regions: List[set] = []
    _region_log.append(regions)
    try:
        yield regions
    finally:
        _region_log.pop()


def _bypassed_call(fn: Callable, args: tuple):
    outputs = fn(*args)
    # A reentrant region whose tensor inputs all lack requires_grad runs no nested backward in eager mode.
    if _region_log and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        flat = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        _region_log[-1].append(leaves_inside(flat, [a for a in args if isinstance(a, torch.Tensor)]))
    return outputs


@contextlib.contextmanager
def bypass_reentrant_checkpoint() -> Iterator[None]:
    """While graphs are built, make ``torch.utils.checkpoint``'s reentrant path call the function directly.

    ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)`` goes through
    ``CheckpointFunction.apply``; inside this context that call runs ``fn(*args)`` instead, the same
    bypass :func:`checkpoint` applies. Non-reentrant checkpointing is untouched (it works under capture).
    """

    def _direct(function, preserve_rng_state, *args):
        return _bypassed_call(function, args)

    with reentrant_checkpoint_calls(_direct):
        yield
