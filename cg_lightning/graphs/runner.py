"""One graphed call: warmup, parameter discovery, forward and backward capture, replay.

A :class:`LayerGraphRunner` belongs to one layer, one call index within a training step (a block
applied twice per step has two runners) and one :class:`CallSignature`. Its life:

1. ``warmup()``: ``num_warmup_iters`` eager forward+backward passes on the recorded sample arguments,
   with recomputation bypassed, to find the parameters reachable only through recomputation.
2. ``capture_forward()`` then, once all forwards of the step are captured, ``capture_backward()`` in
   reverse order: static inputs, outputs, grad-outputs and grad-inputs live in one shared pool.
3. ``replay_forward`` / ``replay_backward`` (called by :class:`ReplayFunction`).

Gradient routing in the captured backward (Megatron-LM PR #6373): for every parameter in
``params_to_backprop`` the outer weight gradient (``autograd.grad`` result) and the gradient a nested
recomputation backward left in ``param.grad`` are added, each once. With ``accumulate_into_main_grad`` the
sum goes into ``main_grad`` inside the graph and the replay returns ``None`` for that parameter (the
contract, and why a replay does not set ``grad_added_to_main_grad``, is :mod:`cg_lightning.protocol`).
Otherwise the sum is returned to autograd, cloned unless the caller opted out or the parameter is a
delayed-wgrad one (TransformerEngine PR #2937, pytorch/pytorch#181723). The policy is frozen at capture.

Grad-ready counts equal eager execution's, call by call (Megatron-LM PR #6242). In eager execution a
parameter reports ready once in the outer backward if that backward reaches it at all (autograd sums
every use before its ``AccumulateGrad`` node runs), plus once per nested recomputation backward that
uses it. A runner therefore

* gives the replay node an autograd edge only to the *eagerly visible* parameters (those an eager,
  un-bypassed forward of this call reaches from its outputs; found by one probe forward during warmup),
  so the outer backward reports them exactly as eager does, however many calls share them;
* records every notification fired during the backward capture (``CheckpointWithoutOutput``'s nested
  backwards), duplicates and order kept, filtered to nothing, and replays the list after each backward
  replay;
* adds one notification per parameter used inside each reentrant region that capture bypassed (eager
  execution would have run that region's nested backward).

Without ``accumulate_into_main_grad`` (``make_graphed_callables``) every parameter in
``params_to_backprop`` keeps its edge, since autograd must deliver its gradient; one recorded occurrence
of each hidden parameter is then absorbed by that edge.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Callable, Iterator, List, Optional, Sequence, Set

import torch

from .buffer_reuse import check_shared_inputs, copy_into_static
from .autocast import autocast_as, autocast_off, autocast_state
from .checkpointing import bypass_reentrant_checkpoint, recording_bypassed_regions, using_anchor
from . import guards
from .grad_layouts import static_grad_output_buffer
from .guards import GraphCaptureError
from .host_sync import refuse_host_sync
from .discovery import owned_parameters, params_to_backprop, reachable_leaves
from .main_grad_adds import MainGradAdds
from .routing import Routing
from .signature import CallSignature
from .state import graph_capture, graph_warmup, recording_grad_ready
from .. import protocol
from .. import torch_compat

_REQUIRES_GRAD = operator.attrgetter("requires_grad")  # C-level getter for the per-replay frozen check
_TRAINING = operator.attrgetter("training")


def _flat_outputs(out) -> tuple:
    leaves, spec = torch_compat.tree_flatten(out)
    return leaves, spec


class LayerGraphRunner:
    """Forward and backward graph of one call of one layer.

    Args:
        name: qualified module name, for messages.
        module: the layer; its original ``forward`` is called through ``call``.
        call: the layer's un-graphed call, ``call(*args, **kwargs)``.
        signature: the call signature this runner serves.
        sample_args, sample_kwargs: arguments of a recorded eager call (values are used for warmup and
            capture only; shapes, dtypes and ``requires_grad`` define the static inputs).
        backend: a :mod:`~cg_lightning.graphs.backends` backend; ``pool`` its shared memory pool.
        accumulate_into_main_grad: add parameter gradients into ``param.main_grad`` inside the graph.
        clone_param_grads_on_return: when not accumulating, return owned clones of parameter gradients.
        num_warmup_iters: eager warmup passes (>= 1).
        autocast: the autocast settings the call was recorded under (:func:`.capture.autocast_state`);
            warmup, capture and eager-backend replays of the body run under them. ``None``: the ambient ones.
        grad_output_layouts: per flattened output, the strides of the gradient eager backward handed it in the
            recorded step (:func:`watch_grad_layouts`), or ``None``: the layouts of the buffers the backward graph
            reads its output gradients from (:func:`static_grad_output_buffer`). ``None``: the outputs' own.
    """

    def __init__(
        self,
        name: str,
        module: torch.nn.Module,
        call: Callable,
        signature: CallSignature,
        sample_args: tuple,
        sample_kwargs: dict,
        backend,
        pool,
        *,
        accumulate_into_main_grad: bool,
        clone_param_grads_on_return: bool = True,
        num_warmup_iters: int = 1,
        autocast: Optional[tuple] = None,
        grad_output_layouts: Optional[list] = None,
        grad_ready=None,
    ) -> None:
        self.name = name
        #: the data-parallel engine's grad-ready reporter (:mod:`cg_lightning.protocol`), ``None`` without one
        self.grad_ready = grad_ready
        self.grad_output_layouts = grad_output_layouts
        self.autocast = autocast  # the call's own autocast settings (capture.autocast_state), None: ambient
        self.module = module
        self._call = call
        self.signature = signature
        self.backend = backend
        self.pool = pool
        self.accumulate_into_main_grad = accumulate_into_main_grad
        self.clone_param_grads_on_return = clone_param_grads_on_return
        self.num_warmup_iters = max(1, num_warmup_iters)
        self.owned = owned_parameters(module)
        #: the module's parameters, to see in-place changes between a segment's launch and this layer's call
        self.module_params = list(module.parameters())
        self._submodules = list(module.modules())
        self._modes = tuple(map(_TRAINING, self._submodules))  # train/eval of each submodule at capture
        samples = signature.tensor_leaves(sample_args, sample_kwargs)
        self.static_inputs = [
            s.detach().clone().requires_grad_(m.requires_grad)
            for s, m in zip(samples, [m for m, t in zip(signature.metas, signature.is_tensor) if t])
        ]
        self.num_inputs = len(self.static_inputs)
        self._warmup_reachable: Set[int] = set()
        self._visible: Set[int] = set()
        self._eager_visible: Set[int] = set()
        self._bypassed_regions: List[Set[int]] = []
        #: where each parameter gradient goes (:mod:`.routing`), fixed by capture_forward
        self.routing = Routing((), (), (), (), ())
        #: static inputs that alias the previous runner's static outputs (memory-saving mode, segments), that
        #: runner; whether the next runner aliases this one's outputs, and then their version counters when
        #: last returned (an in-place change before the next call is caught)
        self.shared_inputs: List[int] = []
        self.shared_from = None
        self.outputs_shared = False
        self.returned_versions: List[int] = []
        self.replay_plan: List[Callable[[], None]] = []
        self._report_all: Callable[[], None] = protocol.report_each(())  # replay_plan + direct, in one call
        self.output_requires_grad: List[bool] = []
        self._out_spec = None
        self._single_output = False  # the layer returns one tensor (no pytree at replay)
        self._autograd_outputs: Optional[list] = None
        self._fwd = None
        self._bwd = None
        self.static_grad_outputs: List[Optional[torch.Tensor]] = []
        #: set while this runner is captured as a segment member (see :mod:`.segments`)
        self.defer_static_grad_outputs = False
        #: where the backward body's main_grad additions go: one per body (flush_bytes 0), or the segment's
        #: shared :class:`~.main_grad_adds.MainGradAdds` that launches several members' additions together
        self.main_grad_adds = MainGradAdds(flush_bytes=0)
        self.replays = 0
        self._recording: Optional[list] = None
        self._anchors: List[torch.Tensor] = []
        self._anchor: Optional[torch.Tensor] = None
        first = self.static_inputs[0] if self.static_inputs else next(iter(self.owned), None)
        self._device = first.device if first is not None else torch.device("cpu")
        self._foreign_params: List[torch.nn.Parameter] = []
        self.recorded_occurrences: List[torch.nn.Parameter] = []
        self._frozen_at_capture: List[torch.nn.Parameter] = []
        self._unseen_if_frozen: List[torch.nn.Parameter] = []
        self.forward_generation = 0

    # ----------------------------------------------------------------- matching
    def autocast_matches(self) -> bool:
        """The autocast settings in force now are the ones this call was captured under (a graph replays
        the kernels of its capture: a block whose autocast is switched on or off later must not replay)."""
        return self.autocast is None or autocast_state() == self.autocast

    def modes_match(self) -> bool:
        """Every submodule of the layer is in the train/eval mode it was captured in (a graph replays its
        capture's kernels: a dropout switched to eval alone would still drop). The layer itself in eval mode
        never reaches a training graph (it runs eagerly or through :mod:`.eval_graphs`)."""
        return tuple(map(_TRAINING, self._submodules)) == self._modes

    def settings_match(self) -> bool:
        """The autocast settings and the submodules' train/eval modes are the captured ones."""
        return self.autocast_matches() and self.modes_match()

    def mismatches(self, args: tuple, kwargs: dict) -> List[str]:
        """How a call differs from the captured one: argument lines (``CallSignature.mismatches``), the
        autocast settings and the submodules' train/eval modes."""
        out = self.signature.mismatches(args, kwargs)
        if not self.autocast_matches():
            out.append(f"autocast: captured {guards.describe_autocast(self.autocast)}, "
                       f"got {guards.describe_autocast(autocast_state())}")
        if not self.modes_match():
            changed = [name or "(the layer)" for (name, m), was in zip(self.module.named_modules(), self._modes)
                       if m.training != was]
            out.append(f"train/eval mode changed since capture for submodule(s) {changed}")
        return out

    # ----------------------------------------------------------------- building
    def _run_module(self, inputs: Sequence[torch.Tensor]):
        args, kwargs = self.signature.rebuild(inputs)
        with torch.enable_grad(), autocast_as(self.autocast):
            out = self._call(*args, **kwargs)
        leaves, spec = _flat_outputs(out)
        bad = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
        if bad:
            raise GraphCaptureError(
                f"layer {self.name!r} returns non-tensor outputs ({', '.join(bad)}); a graphed layer must return "
                "tensors (or nested tuples/lists/dicts of tensors). Exclude it from graphs.layers."
            )
        return leaves, spec

    def _grad_targets(self, params: Sequence[torch.nn.Parameter], inputs: Sequence[torch.Tensor]):
        return [t for t in inputs if t.requires_grad] + list(params)

    def warmup(self) -> None:
        """Eager passes with recomputation bypassed; records the parameters they reach.

        First one probe forward exactly as eager training runs it (recomputation on): the parameters it
        reaches from the outputs are the ones eager execution reports ready in the outer backward.

        Raises:
            GraphCaptureError: naming the layer, if a pass fails or the layer runs under saved-tensor
                hooks (an enclosing non-reentrant ``torch.utils.checkpoint``).
        """
        guards.refuse_capture_only_hooks(self.name, self.module)
        guards.refuse_saved_tensor_hooks(self.name)
        try:
            self._warmup_passes()
        except GraphCaptureError:
            raise
        except Exception as exc:
            raise GraphCaptureError(guards.capture_failure(self.name, "warmup", exc)) from exc

    def _warmup_passes(self) -> None:
        inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in self.static_inputs]
        outs, _ = self._run_module(inputs)
        self._eager_visible = reachable_leaves(outs)
        del outs, inputs
        grad_params = [p for p in self.owned if p.requires_grad]
        with graph_warmup(), bypass_reentrant_checkpoint():
            for _ in range(self.num_warmup_iters):
                inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in self.static_inputs]
                outs, _ = self._run_module(inputs)
                self._warmup_reachable |= reachable_leaves(outs)
                diff = [o for o in outs if o.requires_grad]
                targets = self._grad_targets(
                    [p for p in grad_params if id(p) in self._warmup_reachable], inputs
                )
                if diff and targets:
                    with autocast_off():
                        torch.autograd.grad(
                            diff, targets, [torch.ones_like(o) for o in diff], allow_unused=True
                        )
                del outs, diff, inputs

    def capture_forward(self) -> None:
        """Capture the forward into the shared pool; fixes ``params_to_backprop``."""

        def body():
            # The eager backend re-runs this body at every replay: same context as the capture.
            if self._anchor is None:  # created inside the capture, on the capture stream
                self._anchor = torch.empty((), device=self._device, requires_grad=True)
            with graph_capture(), bypass_reentrant_checkpoint(), using_anchor(self._anchor):
                outs, spec = self._run_module(self.static_inputs)
            self._autograd_outputs = outs
            self._out_spec = spec
            return list(outs)

        guards.refuse_capture_only_hooks(self.name, self.module)
        try:
            with recording_bypassed_regions() as regions, refuse_host_sync():
                self._fwd = self.backend.capture(body, self.pool)
        except GraphCaptureError:
            raise
        except Exception as exc:  # host syncs, CPU tensors, data-dependent control flow ...
            raise GraphCaptureError(guards.capture_failure(self.name, "forward", exc)) from exc
        self._bypassed_regions = regions
        marker = object()
        single = len(self._autograd_outputs) == 1
        self._single_output = single and torch_compat.tree_unflatten([marker], self._out_spec) is marker
        outs = self._autograd_outputs
        self.output_requires_grad = [o.requires_grad for o in outs]
        self._visible = reachable_leaves(outs)
        guards.refuse_foreign_leaves(self.name, outs, self.owned, self.static_inputs, self._anchor)
        self._frozen_at_capture = [p for p in self.owned if not p.requires_grad]
        self.routing = Routing.at_capture(
            params_to_backprop(self.owned, self._visible, self._warmup_reachable), self._visible,
            self._eager_visible, self.accumulate_into_main_grad, self.clone_param_grads_on_return)
        #: parameters whose freezing after capture only the replay can notice (hidden ones; direct ones later)
        self._unseen_if_frozen = list(self.routing.hidden)
        self._anchors = [self._anchor] if id(self._anchor) in self._visible else []
        self._direct_notifiers: List[Callable[[], None]] = []
        if not self.defer_static_grad_outputs:
            self.make_static_grad_outputs()

    @property
    def adds_into_main_grad(self) -> bool:
        """The captured backward adds some parameter gradient into ``main_grad`` (checked at every backward
        replay, so no list copy)."""
        return bool(self.routing.into_main_grad)

    @property
    def params_to_backprop(self) -> List[torch.nn.Parameter]:
        """The parameters the captured backward differentiates."""
        return list(self.routing.backprop)

    @property
    def hidden_params(self) -> List[torch.nn.Parameter]:
        """Those of :attr:`params_to_backprop` reached only inside recomputation regions."""
        return list(self.routing.hidden)

    @property
    def edge_params(self) -> List[torch.nn.Parameter]:
        """The parameters whose gradient slot the backward graph has (returned, or notification only)."""
        return list(self.routing.edges)

    @property
    def clone_slots(self) -> List[bool]:
        """Per edge parameter, whether its returned gradient is cloned."""
        return list(self.routing.clone)

    @property
    def apply_edges(self) -> tuple:
        """The parameters the replay node takes as inputs (autograd edges to their ``AccumulateGrad`` nodes)."""
        return self.routing.apply_edges

    @property
    def direct_params(self) -> List[torch.nn.Parameter]:
        """The parameters the replay reports ready itself (:mod:`.direct_ready`)."""
        return list(self.routing.direct)

    def sum_through_autograd(self, param_ids: Set[int]) -> None:
        """The parameters of ``param_ids`` (eagerly visible ones, reached by other graphed calls of the same
        step too) are not added into ``main_grad`` by this layer's backward graph: their gradients are returned
        through the replay node's edge instead, so autograd sums every call's share before the parameter's
        ``AccumulateGrad`` hook adds the sum into ``main_grad`` once, ``main + (a + b)`` as in eager training,
        where a graph adding its share itself would give ``(main + a) + b`` (other float32 rounding once
        ``main_grad`` is not zero: gradient accumulation). Call after ``capture_forward``, before the backward
        is captured; a parameter also finalized inside a recomputation region here is left as it is."""
        nested = set().union(*self._bypassed_regions)
        drop = {pid for pid in param_ids if pid in self._eager_visible and pid not in nested}
        if not drop:
            return
        self.routing = self.routing.summed_through_autograd(drop)

    def visible_main_grad_params(self) -> List[torch.nn.Parameter]:
        """Parameters the captured backward adds into ``main_grad`` and that eager autograd reaches from this
        call's outputs (the outer path, not only a recomputation region)."""
        return [p for p in self.routing.into_main_grad if id(p) in self._eager_visible]

    @property
    def main_grad_params(self) -> List[torch.nn.Parameter]:
        """Parameters whose gradient the captured backward adds into ``main_grad`` itself."""
        return list(self.routing.into_main_grad)

    def report_directly(self, params: Sequence[torch.nn.Parameter]) -> None:
        """From the next replay on, ``params`` (edge parameters of this runner whose gradient goes into
        ``main_grad`` in the graph) are no inputs of the replay node; the replay reports them ready itself
        (:mod:`.direct_ready`, which chooses them).

        Raises:
            ValueError: for a parameter that is not such an edge parameter or has no grad-ready reporter.
        """
        try:
            routing = self.routing.reporting_directly(params)
        except ValueError as exc:
            raise ValueError(f"graphed {self.name!r}: {exc}") from exc
        direct = list(routing.direct)
        notifiers = [protocol.notifier_of(self.grad_ready, p) for p in direct]
        if any(n is None for n in notifiers):
            raise ValueError(f"graphed {self.name!r}: a parameter without a grad-ready reporter (no DDP engine)")
        self.routing = routing
        self._unseen_if_frozen = self.hidden_params + direct  # disjoint: direct ones are eagerly visible
        self._direct_notifiers = notifiers
        self._report_all = protocol.batch_notifiers(self.grad_ready, self.replay_plan + notifiers)

    # ----------------------------------------------------------------- buffers shared with other runners
    @property
    def forward_outputs(self) -> list:
        """The forward graph's static outputs."""
        return self._fwd.outputs

    @property
    def backward_outputs(self) -> Optional[list]:
        """The backward graph's static outputs (input gradients, then one slot per edge parameter), or ``None``
        when no output needs a gradient."""
        return None if self._bwd is None else self._bwd.outputs

    def share_inputs(self, prev: "LayerGraphRunner", shared: dict) -> None:
        """Make static input ``j`` the tensor ``shared[j]`` (a view of ``prev``'s static output ``j``), for every
        ``j`` in ``shared`` (:mod:`.buffer_reuse`, segments)."""
        for j, t in shared.items():
            self.static_inputs[j] = t
        self.shared_inputs = list(shared)
        self.shared_from = prev
        prev.outputs_shared = bool(shared)  # prev then records its outputs' version counters at every replay

    def share_grad_output(self, k: int, buffer: torch.Tensor) -> None:
        """Read output ``k``'s gradient from ``buffer`` (the next runner's gradient-input buffer)."""
        self.static_grad_outputs[k] = buffer

    def replace_param_grad_output(self, k: int, tensor: torch.Tensor) -> None:
        """Make the backward graph's output slot of edge parameter ``k`` ``tensor`` (a non-owning alias)."""
        outputs = self._bwd.outputs
        outputs[len(outputs) - len(self.routing.edges) + k] = tensor

    def set_main_grad_adds(self, adds: MainGradAdds) -> None:
        """Where the backward body's ``main_grad`` additions go (a segment's members share one)."""
        self.main_grad_adds = adds

    @contextlib.contextmanager
    def deferring_static_grad_outputs(self) -> Iterator[None]:
        """Within the block, ``capture_forward`` leaves the gradient-output buffers to a later
        :meth:`make_static_grad_outputs` (a segment's forward capture region must not allocate them)."""
        self.defer_static_grad_outputs = True
        try:
            yield
        finally:
            self.defer_static_grad_outputs = False

    @contextlib.contextmanager
    def using_backend(self, backend) -> Iterator[None]:
        """Within the block, capture through ``backend`` (a segment's member backend)."""
        saved, self.backend = self.backend, backend
        try:
            yield
        finally:
            self.backend = saved

    def make_static_grad_outputs(self) -> None:
        """Allocate the buffers the backward graph reads its output gradients from. Outside any capture
        region: inside one (a segment's forward) the allocation would be recorded as a memset on pool memory
        that later captures may be handed."""
        layouts = self.grad_output_layouts or []
        self.static_grad_outputs = [
            static_grad_output_buffer(o, layouts[k] if k < len(layouts) else None) if g else None
            for k, (o, g) in enumerate(zip(self._fwd.outputs, self.output_requires_grad))
        ]

    def _backward_body(self) -> List[Optional[torch.Tensor]]:
        with graph_capture(), autocast_off():  # backward runs outside autocast (capture.autocast_off)
            return self._backward_body_inner()

    def _backward_body_inner(self) -> List[Optional[torch.Tensor]]:
        outs = self._autograd_outputs
        self._autograd_outputs = None
        routing = self.routing
        params = routing.backprop
        stashed = [p.grad for p in params]
        for p in params:
            p.grad = None
        diff = [(o, g) for o, g in zip(outs, self.static_grad_outputs) if g is not None]
        targets = self._grad_targets(params, self.static_inputs)
        grads: List[Optional[torch.Tensor]] = [None] * len(targets)
        if diff and (targets or self._anchors):
            # The recomputation anchors make autograd.grad run every CheckpointWithoutOutput region's
            # backward, even one on no path to the inputs or owned parameters; their grads are dropped.
            with torch.enable_grad():
                grads = list(
                    torch.autograd.grad(
                        [o for o, _ in diff], targets + self._anchors, [g for _, g in diff], allow_unused=True
                    )
                )[: len(targets)]
        n_in = len(targets) - len(params)
        input_grads, wgrads = grads[:n_in], grads[n_in:]
        param_slots: List[Optional[torch.Tensor]] = []
        into_main_grad = set(map(id, routing.into_main_grad))
        edges = set(map(id, routing.edges))
        # (main_grad, gradient) pairs, added by multi-tensor kernels (main_grad_adds): the same elementwise
        # additions as one main_grad.add_ per parameter, in order (bit-identical), in a few kernels instead of
        # one per parameter (at the tiny benchmark size: 149 add kernels, about 0.3 ms per step)
        mains: List[torch.Tensor] = []
        addends: List[torch.Tensor] = []
        for p, wgrad, old in zip(params, wgrads, stashed):
            nested = p.grad
            p.grad = old
            total = wgrad if nested is None else (nested if wgrad is None else wgrad + nested)
            if id(p) in into_main_grad:
                if total is not None:
                    mains.append(protocol.main_grad(p))
                    addends.append(total)
                total = None
            if id(p) in edges:
                param_slots.append(total)
        self.main_grad_adds.add(mains, addends)
        # shares for other modules' parameters go in now: an earlier layer may write their main_grad itself
        foreign = self._foreign_params if self._recording is None else self._foreign_in(self._recording)
        foreign_mains: List[torch.Tensor] = []
        foreign_addends: List[torch.Tensor] = []
        for p in foreign:
            nested, p.grad = p.grad, None
            if nested is not None and protocol.has_main_grad(p):
                foreign_mains.append(protocol.main_grad(p))
                foreign_addends.append(nested)
        self.main_grad_adds.add(foreign_mains, foreign_addends, defer=False)
        return input_grads + param_slots

    def _foreign_in(self, occurrences) -> List[torch.nn.Parameter]:
        """Parameters a nested recomputation finalized that this layer does not own, once each."""
        mine = set(map(id, self.routing.backprop))
        seen: Set[int] = set()
        out = []
        for p, _ in occurrences:
            if id(p) not in mine and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def capture_backward(self) -> None:
        """Capture the backward (after every forward of the step was captured); builds the replay plan.

        Parameters of other modules that a nested recomputation finalizes (it closes over them) are not
        added to this layer's inputs; their nested gradient goes into their ``main_grad`` inside the
        graph and their recorded notifications are replayed, so nothing is lost.
        """
        if not any(self.output_requires_grad):
            self._bwd = None
            self._autograd_outputs = None
            return
        try:
            with graph_capture(), recording_grad_ready() as occurrences, refuse_host_sync():
                self._recording = occurrences
                self._bwd = self.backend.capture(self._backward_body, self.pool)
        except GraphCaptureError:
            raise
        except Exception as exc:
            raise GraphCaptureError(guards.capture_failure(self.name, "backward", exc)) from exc
        finally:
            self._recording = None
        self._foreign_params = self._foreign_in(occurrences)
        self.replay_plan = self._build_replay_plan(occurrences)
        self._report_all = protocol.batch_notifiers(self.grad_ready, self.replay_plan + self._direct_notifiers)
        self.recorded_occurrences = [p for p, _ in occurrences]

    def _build_replay_plan(self, occurrences) -> List[Callable[[], None]]:
        """The notifications to fire after every backward replay (see the module docstring)."""
        events = list(occurrences)
        by_id = {id(p): p for p in self.routing.backprop}
        for region in reversed(self._bypassed_regions):  # nested backwards run in reverse region order
            for pid in region:
                param = by_id.get(pid)
                notify = protocol.notifier_of(self.grad_ready, param) if param is not None else None
                if notify is not None:
                    events.append((param, notify))
        edges = set(map(id, self.routing.edges))
        absorbed: Set[int] = set()
        plan = []
        for param, notify in events:
            # A parameter that eager's outer backward does not reach but that has an edge here (no
            # main_grad accumulation: autograd must deliver its gradient) reports once through the edge.
            if id(param) in edges and id(param) not in self._eager_visible and id(param) not in absorbed:
                absorbed.add(id(param))
                continue
            plan.append(notify)
        return plan

    # ----------------------------------------------------------------- replay
    def replay_forward(self, inputs: Sequence[torch.Tensor]) -> tuple:
        if self.shared_inputs:
            check_shared_inputs(self, inputs)
        segment = self.segment
        if segment is not None and not self.segment_launcher:
            segment.consume(self)
        if self._frozen_at_capture:
            guards.check_still_frozen(self.name, self.module, self._frozen_at_capture)
        if self._unseen_if_frozen and not all(map(_REQUIRES_GRAD, self._unseen_if_frozen)):
            guards.refuse_frozen_unseen(self.name, self.module, self.direct_params, self.hidden_params)
        self.forward_generation += 1
        copy_into_static(self.static_inputs, inputs)
        self._fwd.replay()
        self.replays += 1
        outputs = self._fwd.outputs
        if self.outputs_shared:
            self.returned_versions = list(map(torch_compat.VERSION, outputs))
        return tuple(o.detach() for o in outputs)

    @property
    def segment(self):
        """The :mod:`.segments` state this runner's forward belongs to, or ``None``."""
        return None if self._fwd is None else self._fwd.segment

    @property
    def segment_launcher(self) -> bool:
        return self._fwd is None or self._fwd.segment is None or self._fwd.launcher

    def check_generation(self, generation: int) -> None:
        """Raise if the forward replay whose backward is due was followed by another forward replay."""
        if generation != self.forward_generation:
            raise RuntimeError(
                f"graphed {self.name!r} was called again before the backward of an earlier call reached it: its "
                "static buffers hold only the latest call, so that backward would be wrong. Run the backward "
                "before calling the same graphed layer again, or graph each call separately (one entry per "
                "call in make_graphed_callables' tuple)."
            )

    def replay_backward(self, grad_outputs: Sequence[Optional[torch.Tensor]]) -> tuple:
        """Returns gradients for the input tensors, then for ``apply_edges``."""
        if self._bwd is None:
            return (None,) * (self.num_inputs + len(self.apply_edges))
        if self._bwd.segment is None or self._bwd.launcher:  # else a segment member: the segment's graph filled the buffers
            with torch.no_grad():
                for static, g in zip(self.static_grad_outputs, grad_outputs):
                    if static is None:
                        continue
                    if g is None:
                        static.zero_()
                    elif static.data_ptr() != g.data_ptr():
                        static.copy_(g)
        self._bwd.replay()
        grads = self._bwd.outputs
        routing = self.routing
        n_in = len(grads) - len(routing.edges)
        it = iter(grads[:n_in])
        input_grads = [next(it) if t.requires_grad else None for t in self.static_inputs]
        param_grads = [
            None if g is None else (g.clone() if clone else g)
            for g, clone in ((grads[n_in + k], clone) for k, clone in routing.returned)
        ]
        # the recorded notifications, then the directly reported parameters (where their AccumulateGrad nodes
        # would have reported), in one call
        self._report_all()
        return (*input_grads, *param_grads)

    def output_structure(self, flat: tuple):
        if self._single_output:
            return flat[0]
        return torch_compat.tree_unflatten(list(flat), self._out_spec)

