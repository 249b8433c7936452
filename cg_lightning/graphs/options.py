"""Options of the per-layer graph engine (one dataclass, also used as the YAML schema node)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

BACKENDS = ("auto", "cuda", "eager")
SHAPE_POLICIES = ("eager", "error", "recapture")
CAPTURE_ERROR_POLICIES = ("raise", "eager")


@dataclass
class GraphOptions:
    """How the strategy (or the Accelerate integration) graphs layers.

    One line per field below; ``docs/options.md`` is generated from those lines and ``docs/design.md`` tells
    how the pieces act together.

    Raises:
        ValueError: on an unknown backend or shape policy, a count below 1, or ``layers`` given as one string.
    """

    enabled: bool = True
    """Capture and replay graphs at all; ``False`` trains eagerly through the same DDP engine."""

    layers: Optional[List[str]] = None
    """Glob patterns over module names, outermost match wins; ``None``: every ``ModuleList``/``Sequential``'s repeated blocks."""

    warmup_steps: int = 2
    """Eager optimizer steps before capture (at least one is taken; a resumed run warms up again)."""

    num_warmup_iters: int = 1
    """Eager passes per layer inside capture (>= 1); they find parameters used only in recomputation."""

    backend: str = "auto"
    """``"cuda"`` (``torch.cuda.CUDAGraph``), ``"eager"`` (kernels run eagerly) or ``"auto"`` (``cuda`` on a GPU)."""

    shape_policy: str = "eager"
    """A call unlike the captured ones: ``"eager"`` (warn once), ``"error"``, or ``"recapture"`` (new graph set)."""

    max_graph_sets: int = 4
    """Most graph sets under ``"recapture"`` and eval-graph keys per layer (>= 1); later new ones run eagerly."""

    on_capture_error: str = "raise"
    """A layer whose capture fails: ``"raise"`` stops training, ``"eager"`` runs that layer eagerly from then on."""

    capture_optimizer: bool = False
    """Lightning only: replay ``optimizer.step()`` from a graph (``capturable`` optimizers); not bit-exact."""

    cached_optimizer_step: bool = True
    """Step a fused ``Adam``/``AdamW`` on tensor lists kept across steps: bit-identical, less host time."""

    segments: bool = True
    """Capture consecutive graphed calls that feed each other (``x = block(x)``) as one graph per direction."""

    capture_eval: bool = False
    """Forward-only graphs, in their own pool, for graphed layers called in eval mode without autograd."""

    direct_grad_ready: bool = True
    """Parameters only one graphed call reaches are reported ready by its replay, not by an autograd edge."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"graphs.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.shape_policy not in SHAPE_POLICIES:
            raise ValueError(f"graphs.shape_policy must be one of {SHAPE_POLICIES}, got {self.shape_policy!r}")
        if self.on_capture_error not in CAPTURE_ERROR_POLICIES:
            raise ValueError(
                f"graphs.on_capture_error must be one of {CAPTURE_ERROR_POLICIES}, got {self.on_capture_error!r}"
            )
        if self.max_graph_sets < 1:
            raise ValueError(f"graphs.max_graph_sets must be >= 1, got {self.max_graph_sets}")
        if self.warmup_steps < 0:
            raise ValueError(f"graphs.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.num_warmup_iters < 1:
            raise ValueError(
                f"graphs.num_warmup_iters must be >= 1 (parameter discovery needs one warmup), "
                f"got {self.num_warmup_iters}"
            )
        if isinstance(self.layers, str):  # list("blocks.*") would be one pattern per character
            raise ValueError(f"graphs.layers must be a list of glob patterns, e.g. [{self.layers!r}], "
                             f"got the string {self.layers!r}")
        if self.layers is not None:
            self.layers = list(self.layers)
