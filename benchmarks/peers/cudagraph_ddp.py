"""Peers ``cudagraph_ddp`` (the strategy's defaults: per-layer graphs on the blocks chained into segments,
direct grad-ready, the fused AdamW step on cached tensor lists), ``cudagraph_ddp_layers`` (per-layer graphs
only: ``segments``, ``direct_grad_ready`` and ``cached_optimizer_step`` off), ``cudagraph_ddp_nocache`` (the
defaults without ``cached_optimizer_step``: what the cached step saves), ``cudagraph_ddp_opt`` (the defaults
plus ``capture_optimizer``: the step replayed from a graph, opt-in because not bit-exact),
``cudagraph_ddp_glue`` (the defaults with the embeddings, final norm and head graphed too) and
``cudagraph_ddp_head`` (the defaults with the final norm and head graphed too: the blocks' segment continues into
the head, the embeddings stay eager)."""

from __future__ import annotations

import dataclasses

from benchmarks.common import PeerResult, RunSettings, loss_value
from benchmarks.peers import Peer


GLUE_LAYERS = ["model.tok_emb", "model.pos_emb", "model.blocks.*", "model.ln_f", "model.lm_head"]
HEAD_LAYERS = ["model.blocks.*", "model.ln_f", "model.lm_head"]

# the graphs options of each peer beyond the defaults (also what benchmarks.diagnostics.profile_step,
# host_phases and device_work build the strategy from)
_OFF = {"segments": False, "direct_grad_ready": False, "cached_optimizer_step": False}
GRAPHS_OF = {
    "cudagraph_ddp": {},
    "cudagraph_ddp_layers": _OFF,
    "cudagraph_ddp_nocache": {"cached_optimizer_step": False},
    "cudagraph_ddp_opt": {"capture_optimizer": True},
    "cudagraph_ddp_glue": {"layers": GLUE_LAYERS},
    "cudagraph_ddp_head": {"layers": HEAD_LAYERS},
}


def strategy_for(peer: str, warmup_steps: int = 2):
    """The Lightning strategy of a Lightning peer, by name, for the profiling tools: ``"ddp"`` for
    ``lightning_ddp``, else ``CUDAGraphDDPStrategy`` with ``peer``'s graphs options."""
    if peer == "lightning_ddp":
        return "ddp"
    import cg_lightning

    return cg_lightning.CUDAGraphDDPStrategy(graphs={"warmup_steps": warmup_steps, **GRAPHS_OF[peer]})


def run(s: RunSettings, capture_optimizer=None, segments=None, direct=None, cached=None, layers=None) -> PeerResult:
    """An option left ``None`` takes the strategy's default."""
    import cg_lightning
    from benchmarks.peers._lightning import fit_timed

    from benchmarks.common import PROCESS_GROUP_TIMEOUT

    chosen = {"capture_optimizer": capture_optimizer, "segments": segments, "direct_grad_ready": direct,
              "cached_optimizer_step": cached}
    strategy = cg_lightning.CUDAGraphDDPStrategy(
        graphs={"warmup_steps": s.cg_warmup_steps, "layers": layers,
                **{k: v for k, v in chosen.items() if v is not None}},
        timeout=PROCESS_GROUP_TIMEOUT,
    )
    timing, trainer = fit_timed(s, strategy)
    stats = getattr(trainer.strategy, "last_graph_stats", None)
    extra = {"graph_warmup_steps": s.cg_warmup_steps,
             "optimizer_replays": getattr(trainer.strategy, "last_optimizer_replays", 0),
             "cached_optimizer_steps": getattr(trainer.strategy, "last_cached_optimizer_steps", 0)}
    notes = []
    capture_s = None
    if stats is not None:
        extra["graph_stats"] = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else vars(stats)
        capture_s = float(stats.capture_seconds)
        if s.is_cuda and stats.backend != "cuda":
            notes.append(f"graph backend {stats.backend!r} on a GPU")
        if capture_optimizer and s.is_cuda and not extra["optimizer_replays"]:
            notes.append("the optimizer step was never replayed from a graph")
        if cached is not False and not capture_optimizer and s.is_cuda and not extra["cached_optimizer_steps"]:
            notes.append("the optimizer step never ran on cached lists")
        if getattr(stats, "fallback_calls", 0):
            notes.append(f"{stats.fallback_calls} layer calls fell back to eager")
    else:
        notes.append("the strategy kept no graph stats")
    # Capture happens at the start of step max(1, graphs.warmup_steps) (0-based); timing starts at step `warmup`.
    if max(1, s.cg_warmup_steps) >= s.warmup:
        notes.append("graph capture inside the first timed window (--warmup <= --graph-warmup-steps)")
    if notes:
        extra["note"] = "; ".join(notes)
    return PeerResult(
        timing.ms_per_step, timing.warmup_s, capture_s=capture_s,
        capture_what="graph capture (strategy.last_graph_stats.capture_seconds)",
        final_loss=loss_value(timing.last_loss), extra=extra,
    )


PEER = Peer("cudagraph_ddp", run, needs_cuda=False,
            description='Lightning Trainer(strategy=cg_lightning.CUDAGraphDDPStrategy(), devices=1, '
                        'precision="bf16-mixed") with its defaults: per-layer CUDA graphs on the blocks chained '
                        'into segments, direct grad-ready, the fused AdamW step on cached tensor lists (eager graph '
                        'backend on CPU)')


def run_layers(s: RunSettings) -> PeerResult:
    return run(s, segments=False, direct=False, cached=False)


PEER_LAYERS = Peer("cudagraph_ddp_layers", run_layers, needs_cuda=False,
                   description="cudagraph_ddp with graphs.segments, graphs.direct_grad_ready and "
                               "graphs.cached_optimizer_step off: one graph per block call and direction, "
                               "optimizer.step() as is")


def run_nocache(s: RunSettings) -> PeerResult:
    return run(s, cached=False)


PEER_NOCACHE = Peer("cudagraph_ddp_nocache", run_nocache, needs_cuda=False,
                    description="cudagraph_ddp with graphs.cached_optimizer_step off: optimizer.step() as is")


def run_with_optimizer(s: RunSettings) -> PeerResult:
    return run(s, capture_optimizer=True)


PEER_OPT = Peer("cudagraph_ddp_opt", run_with_optimizer, needs_cuda=False,
                description="cudagraph_ddp plus graphs.capture_optimizer=True: the AdamW step replayed from a graph "
                            "(capturable, learning rate as a device tensor; opt-in, not bit-exact)")


def run_glue(s: RunSettings) -> PeerResult:
    return run(s, layers=GLUE_LAYERS)


PEER_GLUE = Peer("cudagraph_ddp_glue", run_glue, needs_cuda=False,
                 description="cudagraph_ddp with the glue graphed too: graphs.layers = the embeddings, "
                             "the blocks, the final norm and the head (the loss stays eager)")


def run_head(s: RunSettings) -> PeerResult:
    return run(s, layers=HEAD_LAYERS)


PEER_HEAD = Peer("cudagraph_ddp_head", run_head, needs_cuda=False,
                 description="cudagraph_ddp with the final norm and head graphed too: graphs.layers = the blocks, "
                             "the final norm and the head, chained into one segment (the embeddings and the loss "
                             "stay eager)")
