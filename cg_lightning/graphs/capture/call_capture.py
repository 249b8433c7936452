"""The capture half of one graphed call: warmup and discovery, forward capture, the backward body and its capture.

:class:`CallCapture` is the base of :class:`~..replay.runner.LayerGraphRunner`; its steps, run by :mod:`.capture_order` in
replay order, produce the runner's captured state (its graphs, :class:`~..replay.routing.Routing` and
:class:`~..replay.replay_plan.ReplayPlan`):

1. :meth:`~CallCapture.warmup`: ``num_warmup_iters`` eager forward+backward passes on the recorded sample
   arguments, with recomputation bypassed, to find the parameters reachable only through recomputation;
   before them one probe forward as eager training runs it, for the eagerly visible parameters.
2. :meth:`~CallCapture.capture_forward` then, once all forwards of the step are captured,
   :meth:`~CallCapture.capture_backward` in reverse order: static inputs, outputs, grad-outputs and
   grad-inputs live in one shared pool.

Gradient routing in the captured backward (Megatron-LM PR #6373): for every parameter in
``params_to_backprop`` the outer weight gradient (``autograd.grad`` result) and the gradient a nested
recomputation backward left in ``param.grad`` are added, each once. With ``accumulate_into_main_grad`` the
sum goes into ``main_grad`` inside the graph and the replay returns ``None`` for that parameter (the
contract, and why a replay does not set ``grad_added_to_main_grad``, is :mod:`cg_lightning.protocol`).
Otherwise the sum is returned to autograd, cloned unless the caller opted out or the parameter is a
delayed-wgrad one (TransformerEngine PR #2937, pytorch/pytorch#181723). The policy is frozen at capture.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Set

import torch

from . import guards
from ..autocast import autocast_as, autocast_off
from ..recompute.checkpointing import bypass_reentrant_checkpoint, recording_bypassed_regions, using_anchor
from ..recompute.discovery import params_to_backprop, reachable_leaves
from ..errors import GraphCaptureError
from .host_sync import refuse_host_sync
from ..replay.input_pieces import InputPieces, piece_inputs
from ..errors import OutputStructureError
from ..module_state import ModuleState
from ..outputs import split_outputs
from ..replay.replay_plan import ReplayPlan, foreign_in
from ..replay.routing import Routing
from ..state import graph_capture, graph_warmup, recording_grad_ready
from ... import protocol


class CallCapture:
    """Warmup, discovery and capture of one graphed call (the base of :class:`~..replay.runner.LayerGraphRunner`,
    whose constructor sets the call's arguments and static inputs)."""

    def _init_capture(self) -> None:
        """The state warmup and capture fill in."""
        self._warmup_reachable: Set[int] = set()
        self._visible: Set[int] = set()
        self._eager_visible: Set[int] = set()
        self._bypassed_regions: List[Set[int]] = []
        self._autograd_outputs: Optional[list] = None
        #: set while this call is captured as a segment member (see :mod:`.segments`)
        self.defer_static_grad_outputs = False
        self._recording: Optional[list] = None
        self._anchors: List[torch.Tensor] = []
        self._anchor: Optional[torch.Tensor] = None
        #: per input, the keys of its gradient pieces in the order autograd adds them (:mod:`..replay.input_pieces`),
        #: fixed by the backward capture when ``input_pieces`` is on; the input of every extra piece slot
        self._piece_layout: Optional[list] = None
        self.piece_inputs: List[int] = []

    def _run_module(self, inputs: Sequence[torch.Tensor]):
        args, kwargs = self.signature.rebuild(inputs)
        with torch.enable_grad(), autocast_as(self.autocast):
            out = self._call(*args, **kwargs)
        try:
            return split_outputs(out)
        except OutputStructureError as exc:
            raise GraphCaptureError(f"layer {self.name!r} {exc}. Exclude it from graphs.layers, or "
                                    f"{guards.SPLIT_HINT}.") from None

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
        state = ModuleState(self.module)  # the attributes before the passes: a forward must leave them as they are
        try:
            self._warmup_passes()
        except GraphCaptureError:
            raise
        except Exception as exc:
            raise guards.capture_error(self.name, "warmup", exc) from guards.chained_cause(exc)
        guards.refuse_python_state_changes(self.name, state)

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
                outs, structure = self._run_module(self.static_inputs)
            self._autograd_outputs = outs
            self._outputs = structure
            return list(outs)

        guards.refuse_capture_only_hooks(self.name, self.module)
        try:
            with recording_bypassed_regions() as regions, refuse_host_sync(not self.compiled):
                self._fwd = self.backend.capture(body, self.pool)
        except GraphCaptureError:
            raise
        except Exception as exc:  # host syncs, CPU tensors, data-dependent control flow ...
            raise guards.capture_error(self.name, "forward", exc) from guards.chained_cause(exc)
        self._bypassed_regions = regions
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
        self._set_plan(ReplayPlan())  # the backward capture builds it
        if not self.defer_static_grad_outputs:
            self.make_static_grad_outputs()

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
        pieces = None
        if diff and (targets or self._anchors):
            if self.input_pieces:
                pieces = InputPieces([o for o, _ in diff], self.static_inputs, self._piece_layout)
            # The recomputation anchors make autograd.grad run every CheckpointWithoutOutput region's
            # backward, even one on no path to the inputs or owned parameters; their grads are dropped.
            try:
                with torch.enable_grad(), pieces if pieces is not None else contextlib.nullcontext():
                    grads = list(
                        torch.autograd.grad(
                            [o for o, _ in diff], targets + self._anchors, [g for _, g in diff], allow_unused=True
                        )
                    )[: len(targets)]
            except BaseException:  # a failed capture leaves the parameters' .grad as they were
                for p, old in zip(params, stashed):
                    p.grad = old
                raise
        n_in = len(targets) - len(params)
        input_grads, wgrads = grads[:n_in], grads[n_in:]
        if pieces is not None:  # each input's first piece, then the further ones (.input_pieces)
            self._piece_layout, self.piece_inputs = pieces.layout, piece_inputs(pieces.layout)
            it = iter(input_grads)
            firsts, extras = pieces.split([next(it) if t.requires_grad else None for t in self.static_inputs])
            input_grads = [g for g, t in zip(firsts, self.static_inputs) if t.requires_grad] + extras
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
        foreign = self.plan.foreign if self._recording is None else foreign_in(self._recording, routing)
        foreign_mains: List[torch.Tensor] = []
        foreign_addends: List[torch.Tensor] = []
        for p in foreign:
            nested, p.grad = p.grad, None
            if nested is not None and protocol.has_main_grad(p):
                foreign_mains.append(protocol.main_grad(p))
                foreign_addends.append(nested)
        self.main_grad_adds.add(foreign_mains, foreign_addends, defer=False)
        return input_grads + param_slots

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
            with graph_capture(), recording_grad_ready() as occurrences, refuse_host_sync(not self.compiled):
                self._recording = occurrences
                self._bwd = self.backend.capture(self._backward_body, self.pool)
        except GraphCaptureError:
            raise
        except Exception as exc:
            raise guards.capture_error(self.name, "backward", exc) from guards.chained_cause(exc)
        finally:
            self._recording = None
        self._set_plan(ReplayPlan.at_capture(occurrences, self.routing, self._bypassed_regions,
                                             self._eager_visible, self.grad_ready, self.plan.direct))

