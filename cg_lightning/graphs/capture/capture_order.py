"""Capturing a set of runners that replay in a fixed order, without changing any training state."""

from __future__ import annotations

import collections
import contextlib
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn as nn

from ... import protocol
from ..autocast import uncached_autocast
from ..buffer_reuse import (
    release_param_grad_outputs,
    share_grad_outputs_with_next_grad_inputs,
    share_inputs_with_previous_outputs,
)
from ...main_grad_adds import MainGradAdds
from ..errors import GraphCaptureError
from ..segments import SharedContext, has_context, members_capturing, segment_capture, share_context_inputs


def capture_in_order(
    runners: Sequence,
    model: nn.Module,
    layers: List[nn.Module],
    restore_grads: bool = True,
    reuse_buffers: bool = False,
    segments: Optional[List[List[int]]] = None,
    on_failure: Optional[Callable[[object], None]] = None,
) -> None:
    """Warm up every runner, capture the forwards in order and the backwards in reverse order.

    That is the order in which they replay, so one shared memory pool is safe. ``main_grad``,
    ``param.grad`` (unless ``restore_grads`` is false), the layers' buffers and RNG states are restored
    afterwards, and autocast's weight-cast cache is off throughout. ``reuse_buffers``: the runners form a
    chain and share static buffers (:mod:`cg_lightning.graphs.buffer_reuse`). ``segments``: runs of runner
    indices whose calls chain; each run of two or more shares buffers and is captured as one forward and
    one backward graph (:mod:`cg_lightning.graphs.segments`). ``on_failure(runner)``: called with the runner whose
    warmup or capture raised :class:`GraphCaptureError`, before it propagates.
    """
    real = list(runners)

    def run(runner, step) -> None:
        try:
            step()
        except GraphCaptureError:
            if on_failure is not None:
                on_failure(runner)
            raise

    groups = segments if segments is not None else [[i] for i in range(len(runners))]
    for r in real:  # each backward body adds its own (a segment's capture below shares one MainGradAdds)
        r.set_main_grad_adds(MainGradAdds(flush_bytes=0))
    with preserved_training_state(model, layers, restore_grads), uncached_autocast():
        for runner in runners:
            with runner.backend.warmup_stream():
                run(runner, runner.warmup)
        for group in groups:
            if len(group) > 1:
                _capture_segment_forward([real[i] for i in group], run)
                continue
            i = group[0]
            if reuse_buffers and i > 0:
                share_inputs_with_previous_outputs(real[i - 1], real[i])
            run(real[i], real[i].capture_forward)
        _sum_shared_params_through_autograd(real)
        for group in reversed(groups):
            members = [real[i] for i in group]
            if len(group) > 1 and all(any(r.output_requires_grad) for r in members):
                _capture_segment_backward(members, run)
                members[0].segment.node_runners = members  # one autograd node for the whole segment
                continue
            for i in reversed(group):
                if reuse_buffers and i + 1 < len(runners):
                    share_grad_outputs_with_next_grad_inputs(real[i], real[i + 1])
                run(real[i], real[i].capture_backward)
                if reuse_buffers:
                    release_param_grad_outputs(real[i])
    for r in real:  # attributes the warmup and capture runs set (a lazily made flag) are the captured ones
        r.settings.snapshot_attributes()


def _sum_shared_params_through_autograd(runners: Sequence) -> None:
    """Parameters that two or more graphed calls of the step reach on the outer autograd path (a block applied
    twice, a weight shared by two graphed layers) get their shares summed by autograd, as in eager training,
    instead of each backward graph adding its own share into ``main_grad``
    (:meth:`~..replay.runner.LayerGraphRunner.sum_through_autograd`)."""
    count = collections.Counter(id(p) for r in runners for p in r.visible_main_grad_params())
    shared = {pid for pid, n in count.items() if n > 1}
    if shared:
        for r in runners:
            r.sum_through_autograd(shared)


def _capture_segment_forward(members: Sequence, run) -> None:
    """The members' forward bodies in one capture region, each member's input the previous one's output and its
    other inputs (a shared context: :mod:`.segments.context`) the first member's."""
    for r in members[1:]:
        if has_context(r):  # before the capture region: the members' own buffers for them are freed here
            share_context_inputs(members[0], r)
    with segment_capture(members[0].backend, members[0].pool) as seg, members_capturing(members, seg):
        for j, r in enumerate(members):
            if j > 0:
                share_inputs_with_previous_outputs(members[j - 1], r)
            with r.deferring_static_grad_outputs():
                run(r, r.capture_forward)
    for r in members:
        r.make_static_grad_outputs()
    segment = members[0].segment
    segment.member_runners = list(members)
    if any(map(has_context, members[1:])):
        segment.context = SharedContext()  # what the first call was given, checked at the others' calls


def _capture_segment_backward(members: Sequence, run) -> None:
    """The members' backward bodies, last member first, in one capture region; each member's gradient
    output buffer is the next member's gradient-input buffer."""
    adds = MainGradAdds()  # the members' main_grad additions, launched together (main_grad_adds)
    with segment_capture(members[0].backend, members[0].pool) as seg, members_capturing(members, seg):
        for r in members:
            r.set_main_grad_adds(adds)
        for j in reversed(range(len(members))):
            if j + 1 < len(members):
                share_grad_outputs_with_next_grad_inputs(members[j], members[j + 1])
            run(members[j], members[j].capture_backward)
        seg.add(adds.flush)  # the last body of the segment's backward: what is still pending


class TrainingStateSnapshot:
    """``main_grad`` (unless ``main_grads`` is false: a copy the size of the gradients), ``param.grad`` (unless
    ``restore_grads`` is false), the buffers of ``layers`` and the RNG states as they are now; :meth:`restore` puts
    them back."""

    def __init__(self, model: nn.Module, layers: List[nn.Module], restore_grads: bool = True,
                 main_grads: bool = True) -> None:
        self.params = list(model.parameters())
        self.main_grads = [protocol.main_grad(p).clone() if main_grads and protocol.has_main_grad(p) else None
                           for p in self.params]
        self.grads = [p.grad for p in self.params]
        self.restore_grads = restore_grads
        self.buffers = [b for layer in layers for b in layer.buffers()]
        self.buffer_copies = [b.clone() for b in self.buffers]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = (torch.cuda.get_rng_state_all()
                         if torch.cuda.is_available() and torch.cuda.is_initialized() else None)

    def restore(self) -> None:
        with torch.no_grad():
            for p, mg, g in zip(self.params, self.main_grads, self.grads):
                if mg is not None:
                    protocol.main_grad(p).copy_(mg)
                if self.restore_grads:
                    p.grad = g
            for b, c in zip(self.buffers, self.buffer_copies):
                b.copy_(c)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


@contextlib.contextmanager
def preserved_training_state(model: nn.Module, layers: List[nn.Module], restore_grads: bool = True):
    """Restore ``main_grad``, ``param.grad``, layer buffers and RNG states after warmup and capture."""
    snapshot = TrainingStateSnapshot(model, layers, restore_grads)
    try:
        yield
    finally:
        snapshot.restore()
