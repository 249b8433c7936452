"""What a capture produced, as a value the front-ends print."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from ..graphs import GraphManager


@dataclass(frozen=True)
class CaptureSummary:
    """What a capture produced, for the front-ends to print (``str(summary)``)."""

    layer_calls: int  #: graphed layer calls captured so far, over every graph set
    layers: Tuple[str, ...]  #: qualified names of the graphed layers
    backend: str  #: graph backend, ``"cuda"`` or ``"eager"``
    seconds: float  #: time spent capturing so far
    graph_sets: int  #: graph sets captured (more than one under ``shape_policy="recapture"``)
    segments: int  #: chains of calls captured as one forward and one backward graph

    @classmethod
    def of(cls, manager: GraphManager) -> "CaptureSummary":
        """The summary of everything ``manager`` captured so far."""
        stats = manager.stats
        graphed = tuple(layer.name for layer in manager.layers if layer.failure is None)  # not split, not failed
        return cls(stats.captured_runners, graphed, stats.backend, stats.capture_seconds, stats.graph_sets,
                   stats.segments)

    def __str__(self) -> str:
        return (
            f"cg_lightning: captured {self.layer_calls} layer calls ({', '.join(self.layers)}) with the "
            f"{self.backend} backend in {self.seconds:.2f} s"
            + (f" ({self.graph_sets} graph sets)" if self.graph_sets > 1 else "")
            + (f", chained into {self.segments} segment(s)" if self.segments else "")
        )
