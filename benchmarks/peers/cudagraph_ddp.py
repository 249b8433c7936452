"""Peers ``cudagraph_ddp`` (the strategy's defaults: the training step as one graph where that is provably safe,
else per-layer graphs; the fused AdamW step on cached tensor lists), ``cudagraph_ddp_user_compile`` (the defaults
on a model the LightningModule compiled itself), ``cudagraph_ddp_per_layer`` (``graphs.whole_step=False``:
per-layer graphs on the blocks chained into segments, direct grad-ready; the variants below are per-layer too),
``cudagraph_ddp_layers`` (per-layer graphs
only: ``segments``, ``direct_grad_ready`` and ``cached_optimizer_step`` off), ``cudagraph_ddp_nocache`` (the
defaults without ``cached_optimizer_step``: what the cached step saves), ``cudagraph_ddp_opt`` (the defaults
plus ``capture_optimizer``: a fused AdamW step replayed from a graph while its values hold, opt-in),
``cudagraph_ddp_glue`` (the defaults with the embeddings, final norm and head graphed too) and
``cudagraph_ddp_head`` (the defaults with the final norm and head graphed too: the blocks' segment continues into
the head, the embeddings stay eager), ``cudagraph_ddp_whole`` (the whole model's forward as one graphed call:
``graphs.layers=["model"]``), ``cudagraph_ddp_compile`` (the defaults plus ``graphs.compile``: the blocks compiled
by Inductor, then captured) and ``cudagraph_ddp_whole_compile`` (the whole model compiled and captured as one
call), ``cudagraph_ddp_step`` (``graphs.whole_step``: forward, loss, backward and gradient sync of the step as one
graph) and ``cudagraph_ddp_step_compile`` (that, with the whole model compiled by Inductor first). The layer
patterns of each model are ``benchmarks.models.LAYERS``."""

from __future__ import annotations

import dataclasses

from benchmarks.common import PeerResult, RunSettings, loss_value
from benchmarks.models import LAYERS
from benchmarks.peers import Peer

# the graphs options of each peer beyond the defaults (also what benchmarks.diagnostics.profile_step,
# host_phases and device_work build the strategy from); "layers" names a variant of benchmarks.models.LAYERS
_PER_LAYER = {"whole_step": False}
_OFF = {**_PER_LAYER, "segments": False, "direct_grad_ready": False, "cached_optimizer_step": False}
GRAPHS_OF = {
    "cudagraph_ddp": {},
    "cudagraph_ddp_user_compile": {},
    "cudagraph_ddp_step_opt": {"capture_optimizer": True},
    "cudagraph_ddp_user_compile_opt": {"capture_optimizer": True},
    "cudagraph_ddp_per_layer": _PER_LAYER,
    "cudagraph_ddp_layers": _OFF,
    "cudagraph_ddp_nocache": {**_PER_LAYER, "cached_optimizer_step": False},
    "cudagraph_ddp_opt": {**_PER_LAYER, "capture_optimizer": True},
    "cudagraph_ddp_glue": {**_PER_LAYER, "layers": "glue"},
    "cudagraph_ddp_head": {**_PER_LAYER, "layers": "head"},
    "cudagraph_ddp_whole": {**_PER_LAYER, "layers": "whole", "on_capture_error": "split"},
    "cudagraph_ddp_compile": {**_PER_LAYER, "compile": True},
    "cudagraph_ddp_whole_compile": {**_PER_LAYER, "layers": "whole", "compile": True, "on_capture_error": "split"},
    "cudagraph_ddp_step": {"whole_step": True},
    "cudagraph_ddp_step_compile": {"whole_step": True, "layers": "whole", "compile": True},
}
#: peers whose LightningModule compiles its model itself (``self.model = torch.compile(self.model)``)
USER_COMPILED = {"cudagraph_ddp_user_compile", "cudagraph_ddp_user_compile_opt"}


#: the ddp options of each peer beyond the defaults
DDP_OF = {"cudagraph_ddp_distopt": {"distributed_optimizer": True}}
GRAPHS_OF["cudagraph_ddp_distopt"] = _PER_LAYER  # the distributed optimizer is refused by the whole step


def graphs_of(peer: str, model: str = "gpt") -> dict:
    """The graphs options of ``peer`` beyond the defaults, its layer variant resolved for ``model``."""
    graphs = dict(GRAPHS_OF[peer])
    if "layers" in graphs:
        graphs["layers"] = LAYERS[model][graphs["layers"]]
    return graphs


def strategy_for(peer: str, warmup_steps: int = 2, model: str = "gpt"):
    """The Lightning strategy of a Lightning peer, by name, for the profiling tools: ``"ddp"`` for
    ``lightning_ddp``, else ``CUDAGraphDDPStrategy`` with ``peer``'s graphs options."""
    if peer == "lightning_ddp":
        return "ddp"
    import cg_lightning

    return cg_lightning.CUDAGraphDDPStrategy(graphs={"warmup_steps": warmup_steps, **graphs_of(peer, model)},
                                             ddp=DDP_OF.get(peer))


def run(s: RunSettings, peer: str = "cudagraph_ddp") -> PeerResult:
    """``peer``'s options (:data:`GRAPHS_OF`) over the strategy's defaults."""
    import cg_lightning
    from benchmarks.peers._lightning import fit_timed

    from benchmarks.common import PROCESS_GROUP_TIMEOUT

    graphs = graphs_of(peer, s.model)
    capture_optimizer, cached = graphs.get("capture_optimizer"), graphs.get("cached_optimizer_step")
    strategy = cg_lightning.CUDAGraphDDPStrategy(
        graphs={"warmup_steps": s.cg_warmup_steps, **graphs}, ddp=DDP_OF.get(peer), timeout=PROCESS_GROUP_TIMEOUT,
    )
    try:
        timing, trainer = fit_timed(s, strategy, compile_model=peer in USER_COMPILED)
    finally:
        if graphs.get("compile") or peer in USER_COMPILED:
            from benchmarks.peers.compile_reduce_overhead import reset_compiler

            reset_compiler()
    stats = getattr(trainer.strategy, "last_graph_stats", None)
    extra = {"graph_warmup_steps": s.cg_warmup_steps,
             "optimizer_replays": getattr(trainer.strategy, "last_optimizer_replays", 0),
             "cached_optimizer_steps": getattr(trainer.strategy, "last_cached_optimizer_steps", 0)}
    notes = []
    capture_s = None
    if stats is not None:
        extra["graph_stats"] = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else vars(stats)
        capture_s = float(stats.capture_seconds)
        if graphs.get("compile"):
            capture_s += float(stats.compile_seconds)
        if s.is_cuda and stats.backend != "cuda":
            notes.append(f"graph backend {stats.backend!r} on a GPU")
        if capture_optimizer and s.is_cuda and not extra["optimizer_replays"]:
            notes.append("the optimizer step was never replayed from a graph")
        if cached is not False and not capture_optimizer and s.is_cuda and not extra["cached_optimizer_steps"]:
            notes.append("the optimizer step never ran on cached lists")
        if getattr(stats, "fallback_calls", 0):
            notes.append(f"{stats.fallback_calls} layer calls fell back to eager")
    step_stats = getattr(trainer.strategy, "last_step_graph_stats", None)
    if step_stats is not None and step_stats.refusal:
        extra["whole_step_refusal"] = step_stats.refusal
    if graphs.get("whole_step") is not False:
        if step_stats is not None and step_stats.captures:
            extra["step_graph_stats"] = dataclasses.asdict(step_stats)
            capture_s = (capture_s or 0.0) + float(step_stats.capture_seconds)
        if (step_stats is None or not step_stats.replays) and graphs.get("whole_step"):
            notes.append("the whole step was never replayed from a graph")
        if capture_optimizer and step_stats is not None and step_stats.replays and not step_stats.updates:
            notes.append("the optimizer update never ran inside the step's graph: "
                         f"{step_stats.update_refusal or 'its values changed'}")
    elif stats is None:
        notes.append("the strategy kept no graph stats")
    # Capture happens at the start of step max(1, graphs.warmup_steps) (0-based); timing starts at step `warmup`.
    if max(1, s.cg_warmup_steps) >= s.warmup:
        notes.append("graph capture inside the first timed window (--warmup <= --graph-warmup-steps)")
    if notes:
        extra["note"] = "; ".join(notes)
    return PeerResult(
        timing.ms_per_step, timing.warmup_s, capture_s=capture_s,
        capture_what="graph capture (strategy.last_graph_stats.capture_seconds, plus compile_seconds under "
                     "graphs.compile)",
        final_loss=loss_value(timing.last_loss), extra=extra,
    )


PEER = Peer("cudagraph_ddp", run, needs_cuda=False,
            description='Lightning Trainer(strategy=cg_lightning.CUDAGraphDDPStrategy(), devices=1, '
                        'precision="bf16-mixed") with its defaults: the training step as one CUDA graph where '
                        'provably safe (else per-layer graphs), the fused AdamW step on cached tensor lists (eager '
                        'graph backend on CPU)')


def _variant(name: str, needs_cuda: bool, description: str) -> Peer:
    return Peer(name, lambda s: run(s, name), needs_cuda=needs_cuda, description=description)


PEER_USER_COMPILE = _variant("cudagraph_ddp_user_compile", True,
                             "cudagraph_ddp's defaults on a model the LightningModule compiled itself "
                             "(self.model = torch.compile(self.model), default mode)")
PEER_STEP_OPT = _variant("cudagraph_ddp_step_opt", False,
                         "cudagraph_ddp's defaults plus graphs.capture_optimizer=True: the fused AdamW update "
                         "recorded at the end of the whole step's graph, one launch an iteration")
PEER_USER_COMPILE_OPT = _variant("cudagraph_ddp_user_compile_opt", True,
                                 "cudagraph_ddp_user_compile plus graphs.capture_optimizer=True")
PEER_PER_LAYER = _variant("cudagraph_ddp_per_layer", False,
                          "cudagraph_ddp with graphs.whole_step=False: per-layer graphs on the blocks chained into "
                          "segments, direct grad-ready, the cached fused AdamW step")
PEER_LAYERS = _variant("cudagraph_ddp_layers", False,
                       "cudagraph_ddp with graphs.segments, graphs.direct_grad_ready and graphs.cached_optimizer_step "
                       "off: one graph per block call and direction, optimizer.step() as is")
PEER_NOCACHE = _variant("cudagraph_ddp_nocache", False,
                        "cudagraph_ddp with graphs.cached_optimizer_step off: optimizer.step() as is")
PEER_OPT = _variant("cudagraph_ddp_opt", False,
                    "cudagraph_ddp plus graphs.capture_optimizer=True: the fused AdamW step replayed from a graph "
                    "while its values hold (bit-exact; opt-in)")
PEER_GLUE = _variant("cudagraph_ddp_glue", False,
                     "cudagraph_ddp with the glue graphed too: graphs.layers = the embeddings, the blocks, the final "
                     "norm and the head (the loss stays eager)")
PEER_HEAD = _variant("cudagraph_ddp_head", False,
                     "cudagraph_ddp with the final norm and head graphed too: graphs.layers = the blocks, the final "
                     "norm and the head, chained into one segment (the embeddings and the loss stay eager)")
PEER_WHOLE = _variant("cudagraph_ddp_whole", False,
                      'cudagraph_ddp with graphs.layers = ["model"]: the whole forward (embeddings, rotary tables, '
                      "mask, blocks, norm, head) one graphed call where it can be captured, else split into parts "
                      '(graphs.on_capture_error="split"); the loss stays eager')
PEER_COMPILE = _variant("cudagraph_ddp_compile", True,
                        "cudagraph_ddp plus graphs.compile=True: each block's forward compiled by Inductor (no CUDA "
                        "graphs of its own) during the warmup steps, then captured")
PEER_WHOLE_COMPILE = _variant("cudagraph_ddp_whole_compile", True,
                              'cudagraph_ddp_whole plus graphs.compile=True: the whole forward compiled by Inductor, '
                              "then captured as one graph")
PEER_STEP = _variant("cudagraph_ddp_step", False,
                     "cudagraph_ddp plus graphs.whole_step=True: forward, loss, backward and gradient sync of each "
                     "training step replayed from one graph; the optimizer step stays eager (the cached fused step)")
PEER_STEP_COMPILE = _variant("cudagraph_ddp_step_compile", True,
                             'cudagraph_ddp_step with graphs.layers = ["model"] and graphs.compile=True: the whole '
                             "model compiled by Inductor, then the step captured as one graph")
PEER_DISTOPT = _variant("cudagraph_ddp_distopt", False,
                        "cudagraph_ddp with ddp.distributed_optimizer=True: gradients reduce-scattered, the optimizer "
                        "state sharded over the ranks (one rank here: the whole model), parameters all-gathered")
