"""Options of the per-layer graph engine (one dataclass, also used as the YAML schema node)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

BACKENDS = ("auto", "cuda", "eager")
SHAPE_POLICIES = ("eager", "error", "recapture")
CAPTURE_ERROR_POLICIES = ("raise", "eager")


@dataclass
class GraphOptions:
    """How the strategy graphs layers.

    Attributes:
        enabled: capture and replay graphs at all; ``False`` trains eagerly through the same DDP engine.
        layers: glob patterns over qualified module names (``"model.blocks.*"``); a module matches if its
            name matches any pattern and none of its ancestors matched. ``None`` picks the entries of the
            largest ``nn.ModuleList`` whose entries share one class.
        warmup_steps: eager training steps (optimizer steps) before graphs are captured, counted from the
            first step the graph manager sees (a run resumed from a checkpoint warms up again). The last eager
            step records which layers run, in which order and with which arguments, so at least one is
            always taken: 0 and 1 both capture at the start of step 1.
        num_warmup_iters: eager forward+backward passes per layer inside capture, >= 1; they discover the
            parameters hidden behind activation recomputation (Megatron-LM PR #6373).
        backend: ``"cuda"`` (``torch.cuda.CUDAGraph``), ``"eager"`` (same static buffers and bookkeeping,
            kernels run eagerly; for CPU and debugging) or ``"auto"`` (``cuda`` on a CUDA device).
        shape_policy: what a call whose arguments differ from the captured ones does: ``"eager"`` runs
            that call eagerly (warns once per layer), ``"error"`` raises a ``GraphSignatureError``,
            ``"recapture"`` captures another graph set for a training step whose first graphed call has a
            new signature (that step runs eagerly and is recorded; the next step with the same signature
            captures it), up to ``max_graph_sets`` sets.
        max_graph_sets: most graph sets (captured or recorded for capture) under ``"recapture"``, >= 1;
            further new signatures run eagerly, with one warning.
        on_capture_error: a layer whose capture raises ``GraphCaptureError``: ``"raise"`` stops training
            (the message names the layer), ``"eager"`` runs that layer eagerly from then on (one warning
            naming the layer and the cause) and captures the other layers without it.
        capture_optimizer: also capture ``optimizer.step()`` (Lightning strategy): once the layers replay,
            one eager step with ``capturable=True`` (CUDA), then the step is captured and replayed every step.
            Needs an optimizer with a ``capturable`` option (Adam, AdamW, NAdam, RAdam, Adamax, RMSprop, ...;
            not SGD). ``group["lr"]`` stays a float that LR schedulers change as usual; it is copied into the
            graph's device tensor before each replay. Refused, with one warning and eager steps, under
            16-mixed's GradScaler, with optimizer step hooks or a ``ddp.grad_dtype`` other than the
            parameters', and from the first step whose gradients, param groups or non-``lr``
            hyperparameters differ from the captured ones. Off by default because it is not bit-exact:
            the capturable code path computes the bias corrections (foreach) or reads the learning rate
            (fused) in float32 on the device, where ``optimizer.step()`` uses Python floats; a parameter
            whose true gradient is zero (a key bias under softmax) then takes AdamW steps of either sign,
            and weights drift from eager training (measured 2e-5 to 1e-2 relative over 50 steps).
        cached_optimizer_step: for a ``torch.optim.Adam``/``AdamW`` built with ``fused=True`` (Lightning
            strategy), call its fused kernels on tensor lists kept from the previous step instead of
            ``optimizer.step()`` rebuilding them over every parameter (:mod:`.fused_adam_step`): the same
            kernels with the same arguments, so bit-identical, with a fraction of the host time. Any change
            to the groups, gradients, state, hooks or a GradScaler makes that step an ordinary one. Other
            optimizers step as usual. Ignored when ``capture_optimizer`` captures the step.
        segments: capture consecutive graphed calls that feed each other (call k+1's only argument is call
            k's output, as in ``for block in blocks: x = block(x)``) as one forward and one backward graph:
            one graph launch per direction instead of one per layer, and no input copies between them.
            Which calls chain is decided from the recorded warmup steps: an intermediate output the backward
            also reached from elsewhere, a gradient hook added on it, a random draw or module hooks between
            two calls end the segment there. Every replay checks that each call is handed exactly the chained
            tensor and gradient; such a use that appears only after capture raises ``SegmentError`` naming
            the layer (then leave this off).
        direct_grad_ready: parameters that only one graphed call reaches (confirmed on the autograd graph
            of the first step replaying a graph set, :mod:`.direct_ready`) lose their autograd edge to the
            replay node; the replay reports them ready itself. Saves an autograd input, an
            ``AccumulateGrad`` node and a Python hook per parameter and step. A later step that reaches such
            a parameter from elsewhere (a weight used outside the graphed layers only on some steps) stops
            with the DDP engine's error naming it: leave this off for such models. DDP strategy and
            Accelerate integration only.
        capture_eval: also graph calls of the selected layers made in eval mode without autograd
            (validation, test, predict, the sanity check; :mod:`.eval_graphs`): forward-only graphs in their
            own memory pool, keyed per layer by argument signature, autocast settings and inference mode,
            so training graphs are never touched or recaptured. A key's first call runs eagerly, its second
            is captured; outputs are returned as copies. At most ``max_graph_sets`` keys per layer; a layer
            whose eval capture fails runs eagerly in eval (one warning). ``False`` (default): eval calls
            run eagerly.

    Raises:
        ValueError: on an unknown backend or shape policy, a count below 1, or ``layers`` given as one string.
    """

    enabled: bool = True
    layers: Optional[List[str]] = None
    warmup_steps: int = 2
    num_warmup_iters: int = 1
    backend: str = "auto"
    shape_policy: str = "eager"
    max_graph_sets: int = 4
    on_capture_error: str = "raise"
    capture_optimizer: bool = False
    cached_optimizer_step: bool = True
    segments: bool = True
    capture_eval: bool = False
    direct_grad_ready: bool = True

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
