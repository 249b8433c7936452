"""What a capture produced, as a value the front-ends print."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, List, Tuple

from ..graphs import GraphManager
from ..graphs.selection import eager_modules

_NUMBERED = re.compile(r"^(.*\.)?(\d+)$")
MAX_NAMES = 12  #: names (after collapsing runs) printed per list; the rest as "+N more"


def compact_names(names: Iterable[str], limit: int = MAX_NAMES) -> str:
    """``names`` joined by ", ", each run of three or more consecutive numbered siblings collapsed:
    ``blocks.0, ..., blocks.11`` -> ``blocks.0-11``; past ``limit`` items, ``+N more``."""
    items: List[str] = []
    run: List[Tuple[str, int]] = []  # (prefix, index) of the open run of numbered siblings

    def close() -> None:
        if len(run) >= 3:
            items.append(f"{run[0][0]}{run[0][1]}-{run[-1][1]}")
        else:
            items.extend(f"{prefix}{index}" for prefix, index in run)
        run.clear()

    for name in names:
        match = _NUMBERED.match(name)
        if match is None:
            close()
            items.append(name)
            continue
        prefix, index = match.group(1) or "", int(match.group(2))
        if run and (prefix != run[-1][0] or index != run[-1][1] + 1):
            close()
        run.append((prefix, index))
    close()
    shown = items[:limit]
    return ", ".join(shown + ([f"+{len(items) - limit} more"] if len(items) > limit else []))


@dataclass(frozen=True)
class CaptureSummary:
    """What a capture produced, for the front-ends to print (``str(summary)``), e.g. ``cg_lightning: captured
    12 layer calls (model.layers.0-11) with the cuda backend in 1.20 s; eager: model.embed_tokens, model.norm,
    lm_head``."""

    layer_calls: int  #: graphed layer calls captured so far, over every graph set
    layers: Tuple[str, ...]  #: qualified names of the graphed layers (those whose capture failed are in ``eager``)
    backend: str  #: graph backend, ``"cuda"`` or ``"eager"``
    seconds: float  #: time spent capturing so far
    graph_sets: int  #: graph sets captured (more than one under ``shape_policy="recapture"``)
    segments: int  #: chains of calls captured as one forward and one backward graph
    eager: Tuple[str, ...] = ()  #: what holds trainable parameters and runs eagerly (``selection.eager_modules``)
    compile_seconds: float = 0.0  #: graphs.compile: the first warmup step's excess over the last (compilation)

    @classmethod
    def of(cls, manager: GraphManager) -> "CaptureSummary":
        """The summary of everything ``manager`` captured so far."""
        stats = manager.stats
        graphed = tuple(layer.name for layer in manager.layers if layer.failure is None)
        return cls(stats.captured_runners, graphed, stats.backend, stats.capture_seconds, stats.graph_sets,
                   stats.segments, tuple(eager_modules(manager.model, graphed)), stats.compile_seconds)

    def __str__(self) -> str:
        return (
            f"cg_lightning: captured {self.layer_calls} layer calls ({compact_names(self.layers)}) with the "
            f"{self.backend} backend in {self.seconds:.2f} s"
            + (f" after compiling them in about {self.compile_seconds:.1f} s" if self.compile_seconds else "")
            + (f" ({self.graph_sets} graph sets)" if self.graph_sets > 1 else "")
            + (f", chained into {self.segments} segment(s)" if self.segments else "")
            + (f"; eager: {compact_names(self.eager)}" if self.eager else "")
        )
