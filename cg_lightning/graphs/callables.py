"""``make_graphed_callables``: a drop-in for ``torch.cuda.make_graphed_callables`` on this engine.

Differences from the torch function (torch 2.11), all deliberate:

* Returned parameter gradients are owned clones by default (``clone_param_grads_on_return=True``), so
  gradient accumulation over several backward passes and gradients kept by hooks behave as in eager
  code (pytorch/pytorch#181723, TransformerEngine PR #2937). Parameters marked
  ``skip_backward_post_hook=True`` (delayed weight gradients) keep aliasing. The policy is frozen at
  capture. ``False`` is faster (no copy) but gives up eager lifetime semantics: a gradient returned by
  one replay is overwritten by the next.
* Checkpoint-aware parameter discovery (parameters used only inside ``CheckpointWithoutOutput``),
  reentrant checkpointing bypassed during capture, autocast's cast cache disabled during capture.
* ``backend="eager"`` (or ``"auto"`` with CPU samples) runs the same bookkeeping without CUDA.
* RNG states and module buffers are restored after warmup and capture.
* A call whose tensors differ from the samples only in ``requires_grad`` or dtype is served where the replay
  gives eager's result, and refused with :class:`GraphSignatureError` naming the argument where torch's function
  would silently give another (:mod:`.replay.relaxed_calls`): an input sampled without ``requires_grad`` may come with it
  (a backward pass that needs its gradient, which the graph does not compute, raises); under autocast a
  float32-sampled input may come in autocast's dtype where the callable only casts it. Any other difference raises.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn as nn

from ..torch_compat import is_compiled
from .backends import make_backend
from .capture.capture_order import capture_in_order
from .replay.relaxed_calls import RelaxedCalls
from .replay.replay_node import ReplayFunction
from .replay.runner import LayerGraphRunner
from .signature import CallSignature


def _graphed(runner: LayerGraphRunner, relaxed: RelaxedCalls, fallback: Callable, module: Optional[nn.Module],
             training: bool):
    def call(*args, **kwargs):
        if module is not None and module.training != training:
            return fallback(*args, **kwargs)
        tensors = runner.signature.tensor_leaves(args, kwargs)
        if runner.signature.matches(args, kwargs):
            return runner.output_structure(ReplayFunction.apply(runner, *tensors, *runner.apply_edges))
        # another dtype or requires_grad: accepted where the replay gives eager's result (relaxed_calls)
        extra = relaxed.admit(args, kwargs)
        replayed = [t.detach() if k in extra else t for k, t in enumerate(tensors)]
        flat = ReplayFunction.apply(runner, *replayed, *runner.apply_edges)
        return runner.output_structure(relaxed.guard(flat, tensors, extra) if extra else flat)

    call.runner = runner
    return call


def make_graphed_callables(
    callables: Union[Callable, Tuple[Callable, ...]],
    sample_args: Union[tuple, Tuple[tuple, ...]],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool=None,
    *,
    clone_param_grads_on_return: bool = True,
    sample_kwargs: Optional[Union[dict, Tuple[dict, ...]]] = None,
    backend: str = "auto",
    reuse_graph_buffers: bool = False,
):
    """Capture callables' forward and backward into graphs; return graphed versions.

    Same calling convention as ``torch.cuda.make_graphed_callables``: one callable and a tuple of sample
    arguments, or a tuple of callables and a tuple of argument tuples (they share one memory pool and
    must then be replayed in the order given, backwards in reverse). Modules are graphed in place
    (their ``forward`` is replaced; in a training mode other than at capture they run eagerly) and
    returned; functions are returned as new callables.

    Args:
        callables: ``nn.Module`` or function, or a tuple of them.
        sample_args: tensors (shapes, dtypes, ``requires_grad`` as in real calls), or a tuple of tuples. Under
            autocast, give an input the dtype it has in the training step (a previous layer's output is in
            autocast's dtype).
        num_warmup_iters: eager warmup passes per callable before capture (>= 1).
        allow_unused_input: accepted for torch's signature; an input the outputs do not depend on always
            gets a ``None`` gradient here (torch raises for it unless this is true).
        pool: a memory pool to share with other graphs (CUDA backend): a handle (``torch.cuda.graph_pool_handle()``,
            ``graph.pool()``) or a ``torch.cuda.MemPool``; ``None``: a pool of their own.
        clone_param_grads_on_return: return owned clones of parameter gradients (see module docstring).
        sample_kwargs: keyword arguments (dict, or tuple of dicts) of the sample call.
        backend: ``"auto"``, ``"cuda"`` or ``"eager"``.
        reuse_graph_buffers: memory-saving mode for a tuple of callables called as a chain
            (``f1(f0(x))``) in the given order every time: callable ``i+1``'s static inputs are callable
            ``i``'s static outputs, static grad-outputs alias the next backward's grad-inputs, and cloned
            parameter-gradient buffers go back to the pool after capture
            (:mod:`cg_lightning.graphs.buffer_reuse`). Off by default.

    Returns:
        The graphed callable, or a tuple of them.

    Raises:
        GraphCaptureError: if a callable cannot be captured (message names it and the cause). The process is
            then as before the call: no capture left open, the callables' ``forward`` untouched, RNG states and
            buffers restored.
        GraphSignatureError: at call time, if the arguments differ from the samples other than in a way the
            replay still serves (see the module docstring); in backward, if it needs the gradient of an input
            sampled without ``requires_grad``.
        BufferReuseError: at call time, in memory-saving mode, if callable ``i+1`` is not given callable
            ``i``'s output.
        ValueError: on mismatched lengths of ``callables``/``sample_args``/``sample_kwargs``.
        TypeError: if ``sample_args`` is not a tuple of arguments (or of argument tuples).
    """
    single = not isinstance(callables, tuple)
    if single and not isinstance(sample_args, (tuple, list)):
        raise TypeError(
            f"sample_args must be a tuple of the callable's positional arguments, e.g. (x,), got "
            f"{type(sample_args).__name__}; for a tuple of callables, a tuple of such tuples"
        )
    if not single and any(not isinstance(a, (tuple, list)) for a in sample_args):
        raise TypeError("with a tuple of callables, sample_args must be a tuple of argument tuples, one per callable")
    if single:
        callables, sample_args = (callables,), (sample_args,)
        sample_kwargs = (sample_kwargs or {},)
    elif sample_kwargs is None:
        sample_kwargs = tuple({} for _ in callables)
    if not (len(callables) == len(sample_args) == len(sample_kwargs)):
        raise ValueError("callables, sample_args and sample_kwargs must have the same length")
    tensors = [t for args in sample_args for t in args if isinstance(t, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    engine_backend = make_backend(backend, device)
    if pool is None:
        pool = engine_backend.new_pool()
    runners, modules = [], []
    for i, (fn, args, kwargs) in enumerate(zip(callables, sample_args, sample_kwargs)):
        module = fn if isinstance(fn, nn.Module) else nn.Module()
        modules.append(fn if isinstance(fn, nn.Module) else None)
        call = fn.forward if isinstance(fn, nn.Module) else fn
        # a user callable: a functools.partial or a callable object has no __name__
        name = f"{type(fn).__name__}#{i}" if isinstance(fn, nn.Module) else getattr(fn, "__name__", f"callable#{i}")
        args = tuple(args)
        runners.append(
            LayerGraphRunner(
                name, module, call, CallSignature(args, kwargs), args, kwargs, engine_backend, pool,
                accumulate_into_main_grad=False, clone_param_grads_on_return=clone_param_grads_on_return,
                num_warmup_iters=num_warmup_iters, compiled=is_compiled(call),
            )
        )
    owners = [m for m in modules if m is not None]
    holder = nn.ModuleList(owners)
    capture_in_order(runners, holder, owners, restore_grads=False, reuse_buffers=reuse_graph_buffers)
    relaxed = [RelaxedCalls(runner) for runner in runners]
    for checks in relaxed:
        checks.probe()
    results = []
    for fn, module, runner, checks in zip(callables, modules, runners, relaxed):
        if module is not None:
            graphed = _graphed(runner, checks, module.forward, module, module.training)
            module.forward = graphed
            results.append(module)
        else:
            results.append(_graphed(runner, checks, fn, None, True))
    return results[0] if single else tuple(results)
