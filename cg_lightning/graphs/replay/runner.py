"""One graphed call: its static buffers, its captured graphs, matching and replay.

A :class:`LayerGraphRunner` belongs to one layer, one call index within a training step (a block
applied twice per step has two runners) and one :class:`CallSignature`. Its capture half (warmup and
discovery, forward and backward capture, the backward body) is :mod:`..capture.call_capture`; where each parameter
gradient goes is its :class:`~.routing.Routing`, and the grad-ready notifications every backward replay fires
are its :class:`~.replay_plan.ReplayPlan`, both fixed at capture as values (:mod:`.routed_call`). ``replay_forward`` /
``replay_backward`` (called by :class:`ReplayFunction`) run every step.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from ..buffer_reuse import check_shared_inputs, copy_into_static
from ..capture import guards
from ..capture.call_capture import CallCapture
from ..call_settings import REQUIRES_GRAD, CapturedSettings
from .grad_layouts import static_grad_output_buffer
from ..recompute.discovery import owned_parameters
from ...main_grad_adds import MainGradAdds
from ..outputs import OutputStructure
from .replay_plan import ReplayPlan
from .routed_call import RoutedCall
from .routing import Routing
from ..signature import CallSignature
from ... import torch_compat



class LayerGraphRunner(RoutedCall, CallCapture):
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
        autocast: the autocast settings the call was recorded under (:func:`.autocast.autocast_state`);
            warmup, capture and eager-backend replays of the body run under them. ``None``: the ambient ones.
        grad_output_layouts: per tensor output, the strides of the gradient eager backward handed it in the
            recorded step (:func:`watch_grad_layouts`), or ``None``: the layouts of the buffers the backward graph
            reads its output gradients from (:func:`static_grad_output_buffer`). ``None``: the outputs' own.
        input_pieces: return each input's gradient as the pieces eager autograd would add one by one
            (:mod:`.input_pieces`); not for a segment member.
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
        input_pieces: bool = False,
        compiled: bool = False,
    ) -> None:
        self.name = name
        #: ``call`` is a ``torch.compile`` wrapper: captured without the host-sync refusal (:mod:`..capture.host_sync`)
        self.compiled = compiled
        #: hand input gradients back piece by piece, in eager autograd's order (:mod:`.input_pieces`): for a
        #: call whose inputs are also used outside it (a part of a split layer)
        self.input_pieces = input_pieces
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
        #: autocast, train/eval modes and requires_grad at capture, checked at every replay (:mod:`.call_settings`)
        self.settings = CapturedSettings(module, autocast)
        #: the module's parameters, to see in-place changes between a segment's launch and this layer's call
        self.module_params = self.settings.params
        samples = signature.tensor_leaves(sample_args, sample_kwargs)
        self.static_inputs = [
            s.detach().clone().requires_grad_(m.requires_grad)
            for s, m in zip(samples, [m for m, t in zip(signature.metas, signature.is_tensor) if t])
        ]
        self.num_inputs = len(self.static_inputs)
        self._init_capture()
        #: where each parameter gradient goes (:mod:`.routing`), fixed by capture_forward
        self.routing = Routing((), (), (), (), ())
        #: static inputs that alias the previous runner's static outputs (memory-saving mode, segments), that
        #: runner; whether the next runner aliases this one's outputs, and then their version counters when
        #: last returned (an in-place change before the next call is caught)
        self.shared_inputs: List[int] = []
        self.shared_from = None
        self.outputs_shared = False
        self.returned_versions: List[int] = []
        self._set_plan(ReplayPlan())  # built by capture_backward
        self.output_requires_grad: List[bool] = []
        #: the structure of the layer's output and its constant leaves (:mod:`.outputs`), set by capture_forward
        self._outputs: Optional[OutputStructure] = None
        self._fwd = None
        self._bwd = None
        self.static_grad_outputs: List[Optional[torch.Tensor]] = []
        #: where the backward body's main_grad additions go: one per body (flush_bytes 0), or the segment's
        #: shared :class:`~.main_grad_adds.MainGradAdds` that launches several members' additions together
        self.main_grad_adds = MainGradAdds(flush_bytes=0)
        self.replays = 0
        first = self.static_inputs[0] if self.static_inputs else next(iter(self.owned), None)
        self._device = first.device if first is not None else torch.device("cpu")
        self._frozen_at_capture: List[torch.nn.Parameter] = []
        self._unseen_if_frozen: List[torch.nn.Parameter] = []
        self.forward_generation = 0

    # ----------------------------------------------------------------- matching
    def mismatches(self, args: tuple, kwargs: dict) -> List[str]:
        """How a call differs from the captured one: argument lines (``CallSignature.mismatches``), then the
        captured settings' (:meth:`.call_settings.CapturedSettings.mismatches`)."""
        return self.signature.mismatches(args, kwargs) + self.settings.mismatches()

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

    def make_static_grad_outputs(self) -> None:
        """Allocate the buffers the backward graph reads its output gradients from. Outside any capture
        region: inside one (a segment's forward) the allocation would be recorded as a memset on pool memory
        that later captures may be handed."""
        layouts = self.grad_output_layouts or []
        self.static_grad_outputs = [
            static_grad_output_buffer(o, layouts[k] if k < len(layouts) else None) if g else None
            for k, (o, g) in enumerate(zip(self._fwd.outputs, self.output_requires_grad))
        ]

    # ----------------------------------------------------------------- replay
    def replay_forward(self, inputs: Sequence[torch.Tensor]) -> tuple:
        if self.shared_inputs:
            check_shared_inputs(self, inputs)
        segment = self.segment
        if segment is not None and not self.segment_launcher:
            segment.consume(self)
        if self._frozen_at_capture:
            guards.check_still_frozen(self.name, self.module, self._frozen_at_capture)
        if self._unseen_if_frozen and not all(map(REQUIRES_GRAD, self._unseen_if_frozen)):
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

    def node_inputs(self, tensors: Sequence[torch.Tensor]) -> tuple:
        """What the replay node takes after the runner: the call's input tensors, the input of every extra
        gradient-piece slot again (:mod:`.input_pieces`), then ``apply_edges``."""
        return (*tensors, *[tensors[i] for i in self.piece_inputs], *self.apply_edges)

    def replay_backward(self, grad_outputs: Sequence[Optional[torch.Tensor]]) -> tuple:
        """Returns gradients for the input tensors, the extra gradient pieces, then for ``apply_edges``
        (:meth:`node_inputs`)."""
        if self._bwd is None:
            return (None,) * (self.num_inputs + len(self.piece_inputs) + len(self.apply_edges))
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
        pieces = list(it)  # the further gradient pieces of inputs (.input_pieces)
        param_grads = [
            None if g is None else (g.clone() if clone else g)
            for g, clone in ((grads[n_in + k], clone) for k, clone in routing.returned)
        ]
        # the recorded notifications, then the directly reported parameters (where their AccumulateGrad nodes
        # would have reported), in one call
        self._report_all()
        return (*input_grads, *pieces, *param_grads)

    def output_structure(self, flat: tuple):
        """The layer's output as an eager call returns it: ``flat`` (the replay's tensors) in its structure, with
        the constant leaves (``None``, flags) recorded at capture."""
        return self._outputs.rebuild(flat)
