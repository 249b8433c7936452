"""Calls of a graphed callable whose tensors differ from the samples in ``requires_grad`` or dtype only.

``torch.cuda.make_graphed_callables`` copies every argument into its static input buffer and replays, whatever
its ``requires_grad`` and dtype. :class:`RelaxedCalls` accepts such a call where the replay gives eager results and
raises :class:`GraphSignatureError` where it would not:

* **requires_grad**, sampled without and called with (a module sampled on data, called on activations; a
  parameterless module): the captured backward computes no gradient for that input. Torch returns ``None`` for it
  without a word, so earlier layers get none. Here the forward replays, the outputs that depend on the input
  require grad as in eager code, and a backward pass that needs the input's gradient raises, naming it. Sampled
  with and called without: accepted (the gradient the graph computes is dropped), as torch does.
* **dtype under autocast**: a float32 sample called with the autocast dtype (the previous layer's output). The
  graph computes on a float32 copy of the same values. That is eager's result when every aten operation reading
  the input is a cast (autocast's or an explicit ``.to``) to a dtype float32 holds: each then sees the values
  eager code gives it. Otherwise the graph computes in float32, or returns float32, where eager code computes in
  bfloat16: refused, naming the operation. A capture-time probe records the operations (:class:`_InputReads`)
  and runs the callable once more with the argument in the autocast dtype; its outputs must match bit for bit
  (which also catches code reading ``x.dtype``). Any other dtype difference is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, List, Optional, Sequence, Set

import torch
from torch.autograd.function import once_differentiable

from ..autocast import autocast_state, uncached_autocast
from ..capture.capture_order import preserved_training_state
from ..recompute.discovery import reachable_leaves
from ..errors import GraphSignatureError
from ..signature import TensorMeta, _same_value
from ...torch_compat import (
    TO_COPY,
    TorchDispatchMode,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    version,
    will_engine_execute_node,
)

#: the dtypes a floating dtype holds exactly: a copy into it and back, or a cast from it, loses nothing
_HOLDS = {
    torch.float32: (torch.float16, torch.bfloat16, torch.float32),
    torch.float64: (torch.float16, torch.bfloat16, torch.float32, torch.float64),
}
_TO_COPY = TO_COPY


def _storage(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr() if t.numel() else None
    except (RuntimeError, NotImplementedError):  # no storage (a tensor subclass, a meta tensor)
        return None


class _InputReads(TorchDispatchMode):
    """Records the aten operations that read each watched tensor: the dtypes it is cast to (``casts``) and the
    names of the other operations (``others``). A view of it is followed, not counted."""

    def __init__(self, watched: Dict[int, torch.Tensor]) -> None:
        super().__init__()
        self._by_storage = {_storage(t): (k, t) for k, t in watched.items()}
        self.casts: Dict[int, list] = {k: [] for k in watched}
        self.others: Dict[int, list] = {k: [] for k in watched}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        hits = dict(self._by_storage[p] for p in (_storage(x) for x in leaves if isinstance(x, torch.Tensor))
                    if p is not None and p in self._by_storage)
        before = {k: version(t) for k, t in hits.items()}
        out = func(*args, **kwargs)
        for k, t in hits.items():
            if func is _TO_COPY and kwargs.get("dtype") is not None and kwargs.get("device") in (None, t.device):
                self.casts[k].append(kwargs["dtype"])
            elif not (version(t) == before[k] and _aliases(out, _storage(t))):
                self.others[k].append(str(func).replace(".default", ""))
        return out


def _aliases(out, storage: Optional[int]) -> bool:
    tensors = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
    return bool(tensors) and all(_storage(x) == storage for x in tensors)


def _difference(graph_outs: Sequence[torch.Tensor], eager_outs: Sequence[torch.Tensor], structure) -> Optional[str]:
    """How the outputs of a run on the wide copy differ from those of a run on the low-precision tensor
    (``structure``: the outputs' :class:`~.outputs.OutputStructure`)."""
    paths = [(path, x) for path, x in tree_flatten_with_path(structure.rebuild(list(graph_outs)))[0]
             if isinstance(x, torch.Tensor)]
    for (path, _), a, b in zip(paths, graph_outs, eager_outs):
        name = f"output{keystr(path)}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return (f"{name} would be {_short(a.dtype)} {list(a.shape)} where eager code returns {_short(b.dtype)} "
                    f"{list(b.shape)}")
        a, b = a.detach(), b.detach()
        if not (torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all())):
            return f"{name} differs from eager's by up to {float((a.double() - b.double()).abs().max()):.1e}"
    return None


class RelaxedCalls:
    """The relaxed call check of one graphed callable; :meth:`probe` once after capture, under the capture's
    autocast settings."""

    def __init__(self, runner) -> None:
        self.runner = runner
        sig = runner.signature
        self.names = [n for n, t in zip(sig.names, sig.is_tensor) if t]
        self.metas: List[TensorMeta] = [m for m, t in zip(sig.metas, sig.is_tensor) if t]
        self.low: Dict[int, torch.dtype] = {}  # input -> the autocast dtype it was probed in
        self.casts: Dict[int, list] = {}
        self.others: Dict[int, list] = {}
        self.difference: Optional[str] = None  # how outputs differ with the inputs of ``low`` in that dtype
        self.failure: Optional[str] = None  # the probe raised: no dtype difference is vouched for
        #: per output, the float inputs sampled without requires_grad it depends on (``None``: not probed)
        self.depends: Optional[List[Set[int]]] = None

    def probe(self) -> None:
        """Run the callable eagerly (RNG, buffers restored) to learn which outputs depend on the inputs sampled
        without ``requires_grad`` and, for float inputs wider than the autocast dtype, what reads them."""
        statics = self.runner.static_inputs
        lowp = {dt: dtype for dt, on, dtype in autocast_state() if on}
        self.low = {k: lowp[s.device.type] for k, s in enumerate(statics)
                    if s.device.type in lowp and s.dtype != lowp[s.device.type]
                    and lowp[s.device.type] in _HOLDS.get(s.dtype, ())}
        if not self.low and all(s.requires_grad or not s.is_floating_point() for s in statics):
            return
        nograd = [k for k, s in enumerate(statics) if s.is_floating_point() and not s.requires_grad]
        gen = torch.Generator().manual_seed(0)
        values = {k: torch.empty_like(statics[k], dtype=d).copy_(torch.randn(statics[k].shape, generator=gen))
                  for k, d in self.low.items()}

        def inputs(copies: bool) -> List[torch.Tensor]:
            out = [(values[k].to(s.dtype) if copies else values[k].clone()) if k in values else s.detach().clone()
                   for k, s in enumerate(statics)]
            return [t.requires_grad_(s.requires_grad or k in nograd) for k, (t, s) in enumerate(zip(out, statics))]

        try:
            with self._isolated():
                graph_in = inputs(copies=True)
                with _InputReads({k: graph_in[k] for k in self.low}) as reads:
                    graph_outs, structure = self.runner._run_module(graph_in)
            self.casts, self.others = reads.casts, reads.others
            self.depends = [{k for k in nograd if id(graph_in[k]) in reachable_leaves([o])} for o in graph_outs]
            if self.low:
                with self._isolated():
                    eager_outs, _ = self.runner._run_module(inputs(copies=False))
                self.difference = _difference(graph_outs, eager_outs, structure)
        except Exception as exc:  # the callable refuses the probe's values or dtypes
            self.depends, self.failure = None, f"the capture-time check of it failed ({type(exc).__name__}: {exc})"

    @contextlib.contextmanager
    def _isolated(self):
        """The layer's buffers and the RNG states restored afterwards; autocast's cast cache off, as at capture."""
        module = self.runner.module
        with preserved_training_state(module, [module], restore_grads=False), uncached_autocast():
            yield

    # ----------------------------------------------------------------- call time
    def admit(self, args: tuple, kwargs: dict) -> List[int]:
        """The tensor positions sampled without ``requires_grad`` that this call gives with it (under grad mode).

        Raises:
            GraphSignatureError: if the call differs otherwise, or in a dtype the graph would not compute as eager
                code does (one line per argument: why, and what to do).
        """
        sig = self.runner.signature
        leaves, spec = tree_flatten((args, kwargs))
        if not self._relaxable(leaves, spec):
            raise _signature_error(self.runner.name, sig.mismatches(args, kwargs))
        grad_mode = torch.is_grad_enabled()
        tensors = [x for x, t in zip(leaves, sig.is_tensor) if t]
        lines, extra = [], []
        for k, (x, m) in enumerate(zip(tensors, self.metas)):
            if x.dtype != m.dtype:
                why = self._dtype_refusal(k, x.dtype, grad_mode and x.requires_grad and m.requires_grad)
                if why is not None:
                    lines.append(f"{self.names[k]}: sampled {_short(m.dtype)}, called with {_short(x.dtype)}: {why}. "
                                 f"Sample it in {_short(x.dtype)} (the dtype it has in the training step), or convert "
                                 f"it before the call (.to(torch.{_short(m.dtype)})) if {_short(m.dtype)} is meant")
            if grad_mode and x.requires_grad and not m.requires_grad:
                extra.append(k)
        if lines:
            raise _signature_error(self.runner.name, lines)
        return extra

    def _relaxable(self, leaves: list, spec) -> bool:
        """The call differs from the samples in tensors' dtype and ``requires_grad`` only."""
        sig = self.runner.signature
        if spec != sig.spec:
            return False
        for x, m, is_tensor in zip(leaves, sig.metas, sig.is_tensor):
            if not is_tensor:
                if isinstance(x, torch.Tensor) or not _same_value(x, m):
                    return False
            elif not isinstance(x, torch.Tensor) or TensorMeta.of(x) != dataclasses.replace(
                    m, dtype=x.dtype, requires_grad=x.requires_grad):
                return False
        return True

    def _dtype_refusal(self, k: int, dtype: torch.dtype, needs_grad: bool) -> Optional[str]:
        held = self.metas[k].dtype
        wide, low = _short(held), _short(dtype)
        if held.is_floating_point and dtype.is_floating_point and dtype not in _HOLDS.get(held, ()):
            return f"the copy into the {wide} static buffer would round it"
        if self.low.get(k) != dtype:
            return (f"the graph would compute on a {wide} copy where eager code computes with the {low} tensor "
                    "(only a float32 sample under autocast, called with autocast's dtype, is checked at capture)")
        if self.failure:
            return self.failure
        if self.others.get(k):
            ops = ", ".join(sorted(set(self.others[k])))
            return (f"the callable reads it with {ops} (not only through a cast such as autocast's), so the graph "
                    f"would compute in {wide} where eager code computes in {low}"
                    + (f"; {self.difference}" if self.difference else ""))
        casts = self.casts.get(k, [])
        if not casts:
            return ("no operation the capture-time check sees reads it (an unused argument, or a kernel launched "
                    f"outside torch's dispatcher), so a {low} call is not vouched for")
        if any(t not in _HOLDS[held] for t in casts):
            return f"it is cast to {_short(next(t for t in casts if t not in _HOLDS[held]))}, wider than {wide}"
        if needs_grad and len(casts) > 1:
            return (f"it is cast {len(casts)} times: the graph sums the casts' gradients in {wide}, eager code in "
                    f"{low} (other rounding)")
        if self.difference:
            return f"a capture-time run with a {low} argument differs from eager code: {self.difference}"
        return None

    def guard(self, flat: tuple, tensors: Sequence[torch.Tensor], extra: List[int]) -> tuple:
        """``flat`` (the replay's outputs), with the outputs that depend on the ``extra`` inputs requiring grad
        through a node that raises if the backward pass needs those inputs' gradients."""
        extra_set = set(extra)
        if self.depends is None:  # not probed: every float output may depend on them
            deps = [extra_set if o.is_floating_point() else set() for o in flat]
        else:
            deps = [d & extra_set for d in self.depends]
        if not any(deps):
            return flat
        info = (self.runner.name, {k: self.names[k] for k in extra}, deps)
        return _InputGradGuard.apply(info, *flat, *(tensors[k] for k in extra))


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _signature_error(name: str, lines: List[str]) -> GraphSignatureError:
    return GraphSignatureError(f"graphed callable {name!r} called with arguments it was not captured for:\n  "
                               + "\n  ".join(lines))


class _InputGradGuard(torch.autograd.Function):
    """``apply(info, *outputs, *inputs)``: the outputs, those depending on ``inputs`` (sampled without
    ``requires_grad``, given with it) requiring grad; its backward raises if the pass needs the gradient of an
    input an output with a gradient depends on. ``info``: name, ``{input position: argument name}`` and, per
    output, the input positions it depends on."""

    @staticmethod
    def forward(ctx, info, *tensors):
        _, _, deps = info
        ctx.info = info
        ctx.set_materialize_grads(False)
        outs = tensors[: len(deps)]
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, deps) if not d and not o.requires_grad])
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        name, names, deps = ctx.info
        nodes = dict(zip(names, ctx.next_functions[len(ctx.next_functions) - len(names):]))
        reached = sorted({k for g, d in zip(grads, deps) if g is not None for k in d})
        needed = [names[k] for k in reached if nodes[k][0] is not None and _will_run(nodes[k][0])]
        if needed:
            raise GraphSignatureError(
                f"graphed callable {name!r}: {', '.join(needed)} was sampled without requires_grad and given with "
                "it; this backward pass needs its gradient, which the captured backward does not compute "
                "(torch.cuda.make_graphed_callables returns none for it, silently). Sample it with "
                "requires_grad=True, or pass it .detach()ed where no gradient should reach it."
            )
        return (None, *grads, *([None] * len(names)))


def _will_run(node) -> bool:
    try:
        return will_engine_execute_node(node)
    except RuntimeError:  # a leaf among torch.autograd.grad's inputs: it needs the gradient
        return True
