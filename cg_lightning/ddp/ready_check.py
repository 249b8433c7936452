"""The check at the end of a backward: every parameter reported ready exactly as often as its golden count.

:meth:`DataParallelEngine.finish_grad_sync <cg_lightning.ddp.DataParallelEngine.finish_grad_sync>` asks
:class:`ReadyCheck` before it waits on a bucket. A parameter whose count differs from its golden count (in the
first iteration: one that never reported ready) is a :class:`GradSyncError` naming the parameters, their counts
and the usual causes. With more than one process and ``ddp.check_grad_ready``, the ranks first agree through
one tiny all-reduce on a gloo group (bounded by ``ddp.timeout_s``), so a miss on one rank is the same error on
every rank instead of a hang in a bucket's all-reduce; in the first iteration they also compare their golden
counts. A rank that does not take part in time is a :class:`~.peers.PeerLostError` (gone, silent or late, named).
"""

from __future__ import annotations

import datetime
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .bucket import Bucket
from .errors import GradSyncError
from .options import DDPOptions
from .peers import peer_error, peer_errors

_CAUSES = (
    "Usual causes: a parameter used only inside activation recomputation that the graph did not "
    "discover, a data-dependent branch that skips a module on this step or this rank, or a parameter "
    "that takes no part in the loss (freeze it with requires_grad=False before training). A count above "
    "the expected one with graphs.direct_grad_ready on: a graphed layer's parameter also used outside its "
    "graph, or a graphed layer called more often than when it was captured, on this step; set "
    "graphs.direct_grad_ready=false for such a model. Every count doubled: a second backward through the "
    "same forward (retain_graph=True, or two losses from one output) in one micro-batch; run one backward "
    "per forward, or add the losses first."
)


class ReadyCheck:
    """Checks one engine's grad-ready counts at the end of a backward, agreeing across ranks.

    Args:
        module: the engine's model (named in messages; its frozen parameters are remembered).
        params: its trainable parameters (their dtype and device now are remembered).
        names: parameter -> qualified name.
        options: :class:`DDPOptions` (``check_grad_ready``, ``timeout_s``).
        rank, world_size: this process in the engine's group.
        distributed: ``torch.distributed`` is initialized; with ``world_size > 1`` and ``check_grad_ready`` a
            gloo group is created here (a collective: every rank builds its engine at the same point).

    Raises:
        GradSyncError: from :meth:`refuse_unfrozen`, :meth:`agree`, :meth:`check_golden_across_ranks`.
    """

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter], names: Dict[nn.Parameter, str],
                 options: DDPOptions, rank: int, world_size: int, distributed: bool) -> None:
        self.module = module
        self.params = params
        self.names = names
        self.options = options
        self.rank = rank
        self.world_size = world_size
        self._frozen: List[nn.Parameter] = [p for p in module.parameters() if not p.requires_grad]
        # dtype and device of each parameter at setup: a later cast resets its AccumulateGrad node (and with
        # it the engine's hook), which a missing-gradient error then names (_cast_since_setup)
        self._setup_types = [(p.dtype, p.device) for p in params]
        self.control_group = None
        if distributed and world_size > 1 and options.check_grad_ready:
            timeout = datetime.timedelta(seconds=options.timeout_s)
            self.control_group = dist.new_group(backend="gloo", timeout=timeout)

    def refuse_unfrozen(self) -> None:
        """Raise if a parameter frozen at setup requires grad now (it has no buffer slot and no hook)."""
        unfrozen = [p for p in self._frozen if p.requires_grad]
        if unfrozen:
            names = ", ".join(n for n, p in self.module.named_parameters() if any(p is q for q in unfrozen))
            raise GradSyncError(
                f"rank {self.rank}: parameters frozen when training started now require grad ({names}). The "
                "engine sized its gradient buffers and hooks at setup, so their gradients would be neither "
                "reduced across ranks nor checked. Unfreeze before Trainer.fit (or start a new fit after "
                "unfreezing)."
            )

    def agree(self, missing: Sequence[Tuple[nn.Parameter, Bucket]], iteration: int) -> None:
        """Raise on every rank if any rank has ``missing`` parameters (``(param, bucket)`` whose count is not
        the expected one) in ``iteration``, or if another rank does not get here within ``timeout_s``."""
        local = self._describe(missing)
        if self.control_group is None:
            if local:
                raise GradSyncError(
                    f"rank {self.rank}: gradients of these parameters of {type(self.module).__name__} did not "
                    f"report ready as expected in iteration {iteration}: {', '.join(local)}. "
                    f"{self._none_reached(missing)}{self._known_cause_or_usual()}"
                )
            return
        flag = torch.tensor([len(local)], dtype=torch.int64)
        during = f"the end of the backward (the grad-ready agreement of iteration {iteration})"
        try:
            dist.all_reduce(flag, group=self.control_group)
        except Exception as exc:  # another rank died, hangs or is elsewhere: PeerLostError, cause first
            raise peer_error(exc, during, self.options.timeout_s) from exc
        if int(flag.item()) == 0:
            return
        reports: List[Optional[List[str]]] = [None] * self.world_size
        with peer_errors(during, self.options.timeout_s):
            dist.all_gather_object(reports, local, group=self.control_group)
        lines = [f"rank {r}: {', '.join(rep)}" for r, rep in enumerate(reports) if rep]
        raise GradSyncError(
            f"gradients of parameters of {type(self.module).__name__} did not report ready as expected in "
            f"iteration {iteration} (seen on rank {self.rank}):\n  " + "\n  ".join(lines)
            + f"\n{self._none_reached(missing)}{self._known_cause_or_usual()}"
        )

    def check_golden_across_ranks(self, buckets: Sequence[Bucket]) -> None:
        """Raise on every rank if the ranks' golden counts differ (checked once, when they are set)."""
        if self.control_group is None:
            return
        mine = [g for b in buckets for g in b.slot_golden]
        reports: List[Optional[List[int]]] = [None] * self.world_size
        with peer_errors("the comparison of golden counts", self.options.timeout_s):
            dist.all_gather_object(reports, mine, group=self.control_group)
        # ddp.find_unused_parameters: a parameter absent on a rank (0) agrees with any count
        absent = {0} if self.options.find_unused_parameters else set()
        seen = [{rep[i] for rep in reports} - absent for i in range(len(mine))]
        if any(len(s) > 1 for s in seen):
            names = [self.names.get(p, "?") for b in buckets for p in b.params]
            diffs = [
                f"{n}: " + ", ".join(f"rank {r}={rep[i]}" for r, rep in enumerate(reports))
                for i, n in enumerate(names)
                if len(seen[i]) > 1
            ]
            raise GradSyncError(
                "ranks disagree on how many times parameters report ready per iteration (golden counts): "
                + "; ".join(diffs[:10])
                + ". Every rank must run the same layers the same number of times."
            )

    def close(self) -> None:
        """Destroy the gloo group, if any."""
        if self.control_group is not None and dist.is_initialized():
            dist.destroy_process_group(self.control_group)
        self.control_group = None

    def _describe(self, missing) -> List[str]:
        out = []
        for p, b in missing:
            slot = b.slot_of[p]
            golden = "unknown (first iteration)" if b.slot_golden is None else b.slot_golden[slot]
            out.append(f"{self.names.get(p, '?')} (ready {b.slot_counts[slot]} times, expected {golden})")
        return out

    def _known_cause_or_usual(self) -> str:
        """The cast since setup when there was one (the usual causes would only bury it), else the usual causes."""
        return self._cast_since_setup().rstrip() or _CAUSES

    def _cast_since_setup(self) -> str:
        """A sentence naming parameters whose dtype or device changed after setup ('' if none)."""
        changed = [(p, was) for p, was in zip(self.params, self._setup_types) if (p.dtype, p.device) != was]
        if not changed:
            return ""
        what = ", ".join(f"{self.names.get(p, '?')} ({was[0]} on {was[1]} -> {p.dtype} on {p.device})"
                         for p, was in changed[:3])
        return (
            f"{len(changed)} parameter(s) changed dtype or device after the engine was set up ({what}"
            f"{', ...' if len(changed) > 3 else ''}): that replaces their gradient accumulators and drops the "
            "engine's grad-ready hooks. Cast or move the model before Trainer.fit (or use the Trainer's "
            "precision setting), not in a hook during training. "
        )

    def _none_reached(self, missing) -> str:
        """A sentence for a backward that reached no parameter of this model at all ('' otherwise)."""
        if len(missing) < len(self.params) or any(b.slot_counts[b.slot_of[p]] for p, b in missing):
            return ""
        return (
            f"No parameter of this model ({type(self.module).__name__}) got a gradient although it ran a forward "
            "for this backward: its output did not reach the loss (detached, or used only for another loss, as a "
            "GAN generator's output in the discriminator's step). Run such a forward under torch.no_grad(), or "
            "backward through it. "
        )
