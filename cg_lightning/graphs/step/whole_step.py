"""The whole training step as one graph: forward, loss, backward and the gradient all-reduce, replayed per step.

Per-layer graphs leave the host to launch what lies between and around them: embeddings, masks, the loss,
autograd's walk over the graph nodes, the engine's bookkeeping. On a small model that host time is the step
(a transformers Llama at d=256: 2.6 ms of device work in a 4.5 ms step). Capturing the step as one graph leaves
the host a copy of the batch into static buffers, one launch and the optimizer step. The idea is Megatron-LM's
full-iteration graphs (``megatron/core/full_cuda_graph.py``: the forward and backward of a step in one graph,
the optimizer outside) and NeMo's CUDA-graph callback for Lightning. The optimizer step stays outside here too,
unless a front-end appends an update that is exact when recorded (``tail``: the fused Adam kernels with the
groups' values as arguments, :mod:`cg_lightning.trainer.step_update`); a ``capturable`` Adam computes its bias
corrections on the device, in another order, and would not be bit-exact.

A *step function* ``body(batch)`` runs the forward and the loss, then the backward (the engine's hooks add and
all-reduce the gradients as they do eagerly), and returns the step's output. It is captured for one batch
*signature* (the structure, shapes, dtypes, devices and layouts of the batch's tensors, and the values of its
other leaves) and replayed for every batch of that signature: the batch's tensors are copied into the static
buffers the graph reads, and the outputs are the graph's static tensors, overwritten by the next replay. Batch
tensors the step changes in place (found at capture by their version counters) are copied back into the caller's
batch after each step, so hooks that read the batch afterwards see what eager training leaves there. Python
in the step function runs at capture only, so it must do the same device work for every batch of a signature.

On the CUDA backend the step function runs once eagerly on the capture stream before capture (libraries bind
per-stream state lazily), with the module's buffers, the RNG states and the static batch restored afterwards
(a step that changes its batch in place must not find it changed twice), then once under
capture, and the graph is replayed for the step itself. ``main_grad`` is not copied: the step function zeroes it
before its backward (or leaves it unfilled and copies each first gradient share in: ``DataParallelEngine.
grad_adds_batched(fresh=True)``). With ``eager_path`` the eager run keeps the host reads of constant values and the capture answers
them, so that code which would take another path under capture takes the eager one (:mod:`.capture_reads`); the
eager backend then makes the same two runs. Otherwise code takes the path it takes under capture (on the eager
backend it is told a stream captures) and host reads are refused. On the eager backend a replay calls the step
function again (CPU tests of the bookkeeping).

What a replay relies on besides the batch is compared before it by :class:`StepGuards`: the submodules, parameters
and buffers the model holds, every submodule's train/eval mode and scalar attributes, every parameter's
``requires_grad``, as at capture (:mod:`..module_state`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch
import torch.nn as nn

from ... import torch_compat
from ..capture.capture_order import TrainingStateSnapshot
from .capture_reads import answer_reads, capture_seen_by_code, record_reads
from ..capture.host_sync import refuse_host_sync
from ..module_state import ModuleState
from ..signature import CallSignature


@dataclass
class StepGraph:
    """One captured step: the static batch it reads and the static outputs it writes.

    Attributes:
        signature: the batch signature it was captured for.
        graph: the backend's captured graph (``replay()``; ``outputs``: the flat static output tensors).
        inputs: the static tensors of the batch, in the signature's order.
        output_spec, output_leaves: the step output's tree structure and leaves (``None`` in tensor slots).
        extras: whatever the front-end kept from the capture call (the logged values).
        written: positions in ``inputs`` of the batch tensors the step changes in place; copied back into the
            caller's batch after each step, which eager training would have changed.
    """

    signature: CallSignature
    graph: Any
    inputs: List[torch.Tensor]
    output_spec: Any
    output_leaves: List[Any]
    extras: Any = None
    written: List[int] = field(default_factory=list)

    def output(self) -> Any:
        """The step's output: the captured structure, with the static tensors in its tensor slots."""
        outs = iter(self.graph.outputs)
        leaves = [next(outs) if leaf is None else leaf for leaf in self.output_leaves]
        return torch_compat.tree_unflatten(leaves, self.output_spec)


class StepGuards:
    """The :class:`~..module_state.ModuleState` of ``module`` (the LightningModule) as now, its own attributes left to
    the training step's code check; :meth:`changed` says what differs later (a callback that freezes a backbone,
    switches a dropout to eval, anneals a dropout's ``p`` or replaces a submodule)."""

    def __init__(self, module: nn.Module) -> None:
        self.state = ModuleState(module, root_attributes=False)

    def changed(self) -> Optional[str]:
        """``None`` when all are as at construction; else the first difference, in words."""
        return self.state.first_change()

    def restore_attributes(self) -> None:
        """The submodules' scalar attributes back to their values at construction (made before a capture: each run
        of the step function at capture starts from them)."""
        self.state.restore_attributes()

    def changed_by_step(self) -> Optional[str]:
        """After a capture, for guards made before it: the attributes the step's own Python changed (a counter a
        forward increments), which a replay would leave as they are, in words; ``None`` if none."""
        if self.state.attributes_match():
            return None
        line = next(c for c in self.state.changes() if c.startswith("attribute"))
        return "the step's forward changes " + line.split(": ", 1)[1] + " at every step"


@dataclass
class StepGraphStats:
    """Counters of the whole-step graphs of one training run."""

    captures: int = 0  #: step graphs captured (one per batch signature)
    replays: int = 0  #: steps replayed from a graph
    #: steps after warmup that ran eagerly (a batch of another signature; a step whose graph held an update that could
    #: not replay, while the update waits to be recorded again)
    eager_steps: int = 0
    updates: int = 0  #: optimizer updates run inside the step's graph (``graphs.capture_optimizer``)
    update_refusal: Optional[str] = None  #: why the optimizer's update is not part of the step's graph
    capture_seconds: float = 0.0  #: wall time of the captures, warmup runs included
    signatures: List[str] = field(default_factory=list)  #: the captured batch signatures, as text
    refusal: Optional[str] = None  #: why the step is not (or no longer) replayed from a graph
    #: the step leaves the ``main_grad`` buffer unfilled and copies each first gradient share in (a fill and an
    #: addition fewer per parameter, the same values: ``DataParallelEngine.grad_adds_batched(fresh=True)``)
    fresh_main_grads: bool = False


class StepGraphs:
    """The captured steps of one training run, one per batch signature, in one memory pool.

    Args:
        backend: a :mod:`.backends` backend; the DDP engine's hooks must have been made on its capture stream
            (:func:`cg_lightning.lifecycle.apply_data_parallel` does), so the backward's gradient accumulation runs
            on that stream during capture.
        max_graphs: most signatures captured; batches of another signature run eagerly after that.
    """

    def __init__(self, backend, max_graphs: int = 4) -> None:
        self.backend = backend
        self.max_graphs = max_graphs
        self.pool = backend.new_pool()
        self.graphs: List[StepGraph] = []
        self.stats = StepGraphStats()

    def find(self, batch: Any) -> Optional[StepGraph]:
        """The step graph captured for ``batch``'s signature, or ``None``."""
        for graph in self.graphs:
            if graph.signature.matches((batch,), {}):
                return graph
        return None

    def mismatches(self, batch: Any) -> List[str]:
        """How ``batch`` differs from the first captured signature (one line per leaf)."""
        if not self.graphs:
            return []
        return [line.replace("args[0]", "batch", 1) for line in self.graphs[0].signature.mismatches((batch,), {})]

    @property
    def full(self) -> bool:
        return len(self.graphs) >= self.max_graphs

    def capture(self, body: Callable[[Any], Any], batch: Any, module: nn.Module, extras: Any = None, *,
                eager_path: bool = False, compiled: bool = False,
                tail: Optional[Callable[[], None]] = None) -> StepGraph:
        """Capture ``body`` for ``batch``'s signature and run this step (the returned graph's :meth:`~StepGraph.output`
        holds its result).

        Args:
            body: the step function; called with a batch of static tensors (copies of ``batch``'s).
            batch: this step's batch (a tree of tensors and other values).
            module: the trained module, whose buffers (and parameters' ``main_grad``) the eager run restores.
            extras: kept on the step graph for the caller.
            eager_path: the eager run records the host reads of constant values and the capture answers them,
                with outside code told no stream captures (:mod:`.capture_reads`); host reads of other values are
                refused. Leave it off for compiled code (dispatch modes stop dynamo from running it). Off, code
                takes the path it takes under capture and a host read is refused naming its line, unless
                ``compiled`` (on the eager backend code is told a stream captures, as it would be on a GPU).
            compiled: the step runs compiled code: no dispatch mode at all (dynamo would run the uncompiled code).
            tail: work recorded after ``body`` that must run once a step (the optimizer's update): in the captured
                run (and at every replay of the eager backend), never in the eager run before it.

        Raises:
            ValueError: ``batch`` holds no tensor.
            Exception: whatever ``body`` or the capture raises (:class:`~..capture.host_sync.HostSyncError`,
                :class:`~.capture_reads.ReadsDiverged` under ``eager_path``); ``module``'s buffers and the RNG
                states are restored then, and a CUDA capture leaves the process as it was
                (:func:`..capture.capture_guard.guarded_capture`).
        """
        start = time.perf_counter()
        signature = CallSignature((batch,), {})
        inputs = [t.detach().clone() for t in signature.tensor_leaves((batch,), {})]
        if not inputs:
            raise ValueError("the batch holds no tensor, so a graph of the step would read nothing from it")
        (static_batch,), _ = signature.rebuild(inputs)
        holder: dict = {}

        def run() -> List[Optional[torch.Tensor]]:
            out = body(static_batch)
            leaves, spec = torch_compat.tree_flatten(out)
            holder["spec"] = spec
            holder["leaves"] = [None if isinstance(x, torch.Tensor) else x for x in leaves]
            return [x for x in leaves if isinstance(x, torch.Tensor)]

        cuda = self.backend.name == "cuda"
        recorded: Any = None
        runs = [0]

        def captured() -> List[Optional[torch.Tensor]]:
            runs[0] += 1
            if runs[0] > 1:  # an eager backend's replays run the step as it is
                outs = run()
            elif recorded is not None:
                with answer_reads(recorded):
                    outs = run()
            else:
                # a host read would fail the capture: named with its line; the eager backend's stand-in shows code
                # the capture it would see on a GPU
                seen = capture_seen_by_code() if not cuda and not compiled else contextlib.nullcontext()
                with refuse_host_sync(enabled=not compiled), seen:
                    outs = run()
            if tail is not None:
                tail()
            return outs

        # main_grad is not kept: the step function zeroes it first, and a failed capture is followed by a step that
        # zeroes it too; a copy would cost the gradients' size at the capture step's peak
        before = TrainingStateSnapshot(module, [module], restore_grads=False, main_grads=False)
        try:
            if cuda or eager_path:
                # the eager run: on the capture stream (libraries bind per-stream state lazily), constant reads kept
                with self.backend.warmup_stream(), (record_reads() if eager_path else contextlib.nullcontext()) as rec:
                    run()
                recorded = rec
                before.restore()  # buffers (batch-norm statistics) and RNG as before the eager run
                with torch.no_grad():  # and the batch: a step that changes it in place gets it unchanged again
                    for static, new in zip(inputs, signature.tensor_leaves((batch,), {})):
                        static.copy_(new)
            versions = [torch_compat.version(t) for t in inputs]  # the capture's in-place writes bump them
            graph = self.backend.capture(captured, self.pool)
        except BaseException:
            before.restore()  # the eager backend ran part of the step: nothing of it is kept
            raise
        if self.backend.name == "cuda":
            graph.replay()  # capture records the work; this runs it for the step
        written = [i for i, (t, v) in enumerate(zip(inputs, versions)) if torch_compat.version(t) != v]
        step = StepGraph(signature, graph, inputs, holder["spec"], holder["leaves"], extras, written)
        self._write_back(step, batch)
        self.graphs.append(step)
        self.stats.captures += 1
        self.stats.capture_seconds += time.perf_counter() - start
        self.stats.signatures.append(", ".join(str(m) for m in signature.metas))
        return step

    def replay(self, step: StepGraph, batch: Any) -> Any:
        """Copy ``batch``'s tensors into ``step``'s static inputs, replay it, return its output."""
        with torch.no_grad():
            for static, new in zip(step.inputs, step.signature.tensor_leaves((batch,), {})):
                if static.data_ptr() != new.data_ptr():
                    static.copy_(new)
        step.graph.replay()
        self._write_back(step, batch)
        self.stats.replays += 1
        return step.output()

    @staticmethod
    def _write_back(step: StepGraph, batch: Any) -> None:
        """The batch tensors the step changed in place get the step's values, as eager training leaves them."""
        if not step.written:
            return
        given = step.signature.tensor_leaves((batch,), {})
        with torch.no_grad():
            for i in step.written:
                if given[i].data_ptr() != step.inputs[i].data_ptr():
                    given[i].copy_(step.inputs[i])

    def clear(self) -> None:
        """Drop every captured step (and, with the last reference, the pool)."""
        self.graphs = []
        self.pool = None

    def reset(self) -> None:
        """Drop every captured step; later captures go into a new pool (the old one is freed with the last tensor
        made in it)."""
        self.graphs = []
        self.pool = self.backend.new_pool()
