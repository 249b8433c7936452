"""Options of the per-layer graph engine (one dataclass, also used as the YAML schema node)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from ..option_checks import at_least, check_options, one_of

BACKENDS = ("auto", "cuda", "eager")
SHAPE_POLICIES = ("eager", "error", "recapture")
CAPTURE_ERROR_POLICIES = ("raise", "eager", "split")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")  # Inductor modes without CUDA graphs of their own


@dataclass
class GraphOptions:
    """How the strategy (or the Accelerate integration) graphs layers.

    One line per field below; ``docs/options.md`` is generated from those lines and ``docs/design.md`` tells
    how the pieces act together.

    Raises:
        TypeError: a value of the wrong type (``layers`` given as one string included).
        ValueError: an unknown backend or policy, a count out of range. Both name the option
            (``graphs.warmup_steps``), the value given and what is accepted.
    """

    enabled: bool = True
    """Capture and replay graphs at all; ``False`` trains eagerly through the same DDP engine."""

    layers: Optional[List[str]] = None
    """Glob patterns over module names, outermost match wins; ``None``: every ``ModuleList``/``Sequential``'s repeated blocks."""

    warmup_steps: int = field(default=2, metadata=at_least(0))
    """Eager optimizer steps before capture (at least one is taken; a resumed run warms up again)."""

    num_warmup_iters: int = field(default=1, metadata=at_least(1))
    """Eager passes per layer inside capture (>= 1); they find parameters used only in recomputation."""

    backend: str = field(default="auto", metadata=one_of(BACKENDS))
    """``"cuda"`` (``torch.cuda.CUDAGraph``), ``"eager"`` (kernels run eagerly) or ``"auto"`` (``cuda`` on a GPU)."""

    shape_policy: str = field(default="eager", metadata=one_of(SHAPE_POLICIES))
    """A call unlike the captured ones: ``"eager"`` (warn once), ``"error"``, or ``"recapture"`` (new graph set)."""

    max_graph_sets: int = field(default=4, metadata=at_least(1))
    """Most graph sets under ``"recapture"`` and eval-graph keys per layer (>= 1); later new ones run eagerly."""

    on_capture_error: Optional[str] = field(default=None, metadata=one_of(CAPTURE_ERROR_POLICIES + (None,)))
    """A layer whose capture fails: ``"raise"``, ``"eager"`` or ``"split"`` (graph its parts); ``None``: split if chosen by default, else raise."""

    capture_optimizer: bool = False
    """Lightning only: replay a fused ``Adam``/``AdamW`` step from a graph while its values hold (inside the whole step's graph where nothing runs between backward and update); bit-exact; opt-in: no measured speed-up, a capture per rate change, a per-step agreement between ranks."""

    cached_optimizer_step: bool = True
    """Step a fused ``Adam``/``AdamW`` on tensor lists kept across steps: bit-identical, less host time."""

    segments: bool = True
    """Capture consecutive graphed calls that feed each other (``x = block(x)``) as one graph per direction."""

    capture_eval: bool = False
    """Forward-only graphs, in their own pool, for graphed layers called in eval mode without autograd."""

    direct_grad_ready: bool = True
    """Parameters only one graphed call reaches are reported ready by its replay, not by an autograd edge."""

    whole_step: Optional[bool] = None
    """Lightning only: forward, loss, backward and gradient sync as one graph; ``None``: where provably safe."""

    compile: bool = False
    """Compile each graphed layer's forward with ``torch.compile`` (no CUDA graphs of its own) before capture; opt-in."""

    compile_mode: str = field(default="default", metadata=one_of(COMPILE_MODES))
    """``torch.compile`` mode under ``compile``: ``"default"`` or ``"max-autotune-no-cudagraphs"``."""

    compile_backend: str = "inductor"
    """``torch.compile`` backend under ``compile``: ``"inductor"`` (fused kernels) or another registered one."""

    def __post_init__(self) -> None:
        check_options(self, "graphs")
        if self.layers is not None:
            self.layers = list(self.layers)

    @property
    def capture_error_policy(self) -> str:
        """``on_capture_error`` as it applies: unset, ``"split"`` for the layers chosen by default (a layer that
        cannot be captured whole, an MoE decoder layer, gets its parts graphed) and ``"raise"`` for the layers
        named in ``layers`` (the user asked for exactly those)."""
        if self.on_capture_error is not None:
            return self.on_capture_error
        return "split" if self.layers is None else "raise"
