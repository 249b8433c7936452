"""Peers ``cudagraph_ddp`` (the strategy's defaults: per-layer graphs on the blocks, the optimizer step, segments
and direct grad-ready), ``cudagraph_ddp_layers`` (per-layer graphs only: ``capture_optimizer``, ``segments`` and
``direct_grad_ready`` off), ``cudagraph_ddp_opt`` (that plus the optimizer step replayed from a graph),
``cudagraph_ddp_seg`` (that plus the chained blocks as one segment: one graph launch per direction),
``cudagraph_ddp_direct`` (that plus the replays reporting their own parameters ready: the defaults, set
explicitly) and ``cudagraph_ddp_glue`` (that with the embeddings, final norm and head graphed too)."""

from __future__ import annotations

import dataclasses

from benchmarks.common import PeerResult, RunSettings, loss_value
from benchmarks.peers import Peer


GLUE_LAYERS = ["model.tok_emb", "model.pos_emb", "model.blocks.*", "model.ln_f", "model.lm_head"]


def run(s: RunSettings, capture_optimizer=None, segments=None, direct=None, layers=None) -> PeerResult:
    """An option left ``None`` takes the strategy's default."""
    import cg_lightning
    from benchmarks.peers._lightning import fit_timed

    from benchmarks.common import PROCESS_GROUP_TIMEOUT

    chosen = {"capture_optimizer": capture_optimizer, "segments": segments, "direct_grad_ready": direct}
    strategy = cg_lightning.CUDAGraphDDPStrategy(
        graphs={"warmup_steps": s.cg_warmup_steps, "layers": layers,
                **{k: v for k, v in chosen.items() if v is not None}},
        timeout=PROCESS_GROUP_TIMEOUT,
    )
    timing, trainer = fit_timed(s, strategy)
    stats = getattr(trainer.strategy, "last_graph_stats", None)
    extra = {"graph_warmup_steps": s.cg_warmup_steps,
             "optimizer_replays": getattr(trainer.strategy, "last_optimizer_replays", 0)}
    notes = []
    capture_s = None
    if stats is not None:
        extra["graph_stats"] = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else vars(stats)
        capture_s = float(stats.capture_seconds)
        if s.is_cuda and stats.backend != "cuda":
            notes.append(f"graph backend {stats.backend!r} on a GPU")
        if capture_optimizer is not False and s.is_cuda and not extra["optimizer_replays"]:
            notes.append("the optimizer step was never replayed from a graph")
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
                        'into segments, the optimizer step replayed, direct grad-ready (eager graph backend on CPU)')


def run_layers(s: RunSettings) -> PeerResult:
    return run(s, capture_optimizer=False, segments=False, direct=False)


PEER_LAYERS = Peer("cudagraph_ddp_layers", run_layers, needs_cuda=False,
                   description="cudagraph_ddp with graphs.capture_optimizer, graphs.segments and "
                               "graphs.direct_grad_ready off: one graph per block call and direction")


def run_with_optimizer(s: RunSettings) -> PeerResult:
    return run(s, capture_optimizer=True, segments=False, direct=False)


PEER_OPT = Peer("cudagraph_ddp_opt", run_with_optimizer, needs_cuda=False,
                description="as cudagraph_ddp_layers, plus graphs.capture_optimizer=True: the AdamW step replayed "
                            "from a graph (learning rate as a device tensor)")


def run_with_segments(s: RunSettings) -> PeerResult:
    return run(s, capture_optimizer=True, segments=True, direct=False)


PEER_SEG = Peer("cudagraph_ddp_seg", run_with_segments, needs_cuda=False,
                description="as cudagraph_ddp_opt, plus graphs.segments=True: the chained blocks captured as one "
                            "forward and one backward graph")


def run_direct(s: RunSettings) -> PeerResult:
    return run(s, capture_optimizer=True, segments=True, direct=True)


PEER_DIRECT = Peer("cudagraph_ddp_direct", run_direct, needs_cuda=False,
                   description="as cudagraph_ddp_seg, plus graphs.direct_grad_ready=True: block parameters reported "
                               "ready by their replay, without autograd edges")


def run_glue(s: RunSettings) -> PeerResult:
    return run(s, capture_optimizer=True, segments=True, direct=True, layers=GLUE_LAYERS)


PEER_GLUE = Peer("cudagraph_ddp_glue", run_glue, needs_cuda=False,
                 description="as cudagraph_ddp_direct, plus the glue graphed too: graphs.layers = the embeddings, "
                             "the blocks, the final norm and the head (the loss stays eager)")
