"""``CUDAGraphCallback``: the capture schedule of ``strategy="cudagraph_ddp"``, kept in checkpoints.

The body, :class:`CUDAGraphCallbackMixin`, serves both Lightning packages: :class:`CUDAGraphCallback` here is a
``lightning.pytorch`` callback, :class:`cg_lightning.trainer.pytorch_lightning.CUDAGraphCallback` a ``pytorch_lightning``
one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional

from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from ..graphs import GraphOptions

#: the GraphOptions fields this callback owns
SCHEDULE_FIELDS = ("warmup_steps", "shape_policy", "max_graph_sets", "on_capture_error", "capture_eval")


class CUDAGraphCallbackMixin:
    """Sets when and how the strategy captures graphs, and remembers it across checkpoints.

    Precedence, highest first: an argument given here; the value this callback saved in the checkpoint a
    run resumes from; the strategy's ``graphs`` options; :class:`~cg_lightning.graphs.GraphOptions`'
    defaults. The values are written into the strategy's options at ``setup`` (and when a checkpoint's
    state is loaded, which Lightning does before the strategy builds its graph manager).

    One owner for the per-step calls: the strategy (like the Accelerate integration) tells the graph
    manager where each training micro-batch starts and ends, since it knows exactly where
    ``training_step`` runs; this callback only configures the schedule and records its progress.

    Resuming: the manager counts ``warmup_steps`` from the first step it sees, so a resumed run trains
    ``warmup_steps`` eager steps and captures again; ``state_dict`` carries the number of captures done
    (over all runs), the signatures captured and the options.

    Args:
        warmup_steps, shape_policy, max_graph_sets, on_capture_error, capture_eval: as in
            ``GraphOptions`` (``capture_eval``: forward-only graphs for layers in eval mode: validation,
            test, predict, sanity check); ``None`` leaves the value to the checkpoint or the strategy.

    Raises:
        TypeError, ValueError: for a value of the wrong type or out of range, checked and worded as
            ``GraphOptions`` does (``graphs.warmup_steps: expected int >= 0, got -1``).
    """

    _rank_zero_warn: Callable[[str], None]  # set by each Lightning package's class

    def __init__(
        self,
        warmup_steps: Optional[int] = None,
        shape_policy: Optional[str] = None,
        capture_eval: Optional[bool] = None,
        max_graph_sets: Optional[int] = None,
        on_capture_error: Optional[str] = None,
    ) -> None:
        given = dict(warmup_steps=warmup_steps, shape_policy=shape_policy, max_graph_sets=max_graph_sets,
                     on_capture_error=on_capture_error, capture_eval=capture_eval)
        self.overrides: Dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        GraphOptions(**self.overrides)  # validates
        self.restored: Dict[str, Any] = {}  # options loaded from a checkpoint
        self.previous_captures = 0  # captures of the runs before the one resumed from a checkpoint
        self.previous_signatures: List[str] = []
        self._strategy = None

    # ----------------------------------------------------------------- options
    def _apply(self, values: Dict[str, Any]) -> None:
        options = getattr(self._strategy, "graph_options", None)
        if options is None or not values:
            return
        checked = dataclasses.replace(options, **values)  # runs GraphOptions' checks
        for name in values:
            setattr(options, name, getattr(checked, name))  # in place: a manager built already sees them

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        if not hasattr(trainer.strategy, "graph_options"):
            self._rank_zero_warn("CUDAGraphCallback has no effect: the strategy is not 'cudagraph_ddp'.")
            return
        self._strategy = trainer.strategy
        self._apply({**self.restored, **self.overrides})

    # ----------------------------------------------------------------- progress
    def _manager(self):
        return getattr(self._strategy, "graph_manager", None)

    @property
    def captures(self) -> int:
        """Captures over every run of this training (previous runs included)."""
        manager = self._manager()
        stats = manager.stats if manager is not None else getattr(self._strategy, "last_graph_stats", None)
        return self.previous_captures + (stats.captures if stats is not None else 0)

    @property
    def signatures(self) -> List[str]:
        manager = self._manager()
        now = manager.signatures() if manager is not None else getattr(self, "_last_signatures", [])
        return self.previous_signatures + [s for s in now if s not in self.previous_signatures]

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        manager = self._manager()
        if manager is not None:
            self._last_signatures = manager.signatures()

    # ----------------------------------------------------------------- checkpoints
    @override
    def state_dict(self) -> Dict[str, Any]:
        options = getattr(self._strategy, "graph_options", None)
        return {
            "captures": self.captures,
            "signatures": self.signatures,
            "options": {k: getattr(options, k) for k in SCHEDULE_FIELDS} if options is not None else {},
        }

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.previous_captures = int(state_dict.get("captures", 0))
        self.previous_signatures = list(state_dict.get("signatures", []))
        self.restored = {k: v for k, v in state_dict.get("options", {}).items() if k in SCHEDULE_FIELDS}
        if self._strategy is not None:
            self._apply({**self.restored, **self.overrides})


class CUDAGraphCallback(CUDAGraphCallbackMixin, Callback):
    __doc__ = CUDAGraphCallbackMixin.__doc__
    _rank_zero_warn = staticmethod(rank_zero_warn)
