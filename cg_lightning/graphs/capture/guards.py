"""What a graphed call refuses, each with a message that names the layer, the cause and the remedy.

At warmup and capture: hooks that would run at capture only, an enclosing non-reentrant checkpoint (saved-tensor
hooks), outputs that depend on tensors the graph would return no gradient for, and failures of the captured
body (host syncs and the like, :mod:`.host_sync`). At replay: parameters frozen or unfrozen after capture where
nothing else would notice. How a call differs from its captured one is described by :func:`describe_autocast`
and the runner's ``mismatches``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ... import torch_compat
from ..recompute.discovery import leaf_tensors
from ..errors import GraphCaptureError, HostSyncError
from .host_sync import hooks_inside


def refuse_capture_only_hooks(name: str, module: torch.nn.Module) -> None:
    """Hooks that would run at warmup and capture only (``host_sync.hooks_inside``) are an error naming them."""
    hooks = hooks_inside(module)
    if hooks:
        raise GraphCaptureError(
            f"could not capture layer {name!r}: {', '.join(hooks)} would run once at capture and never "
            "at replay. Remove those hooks, register module hooks on the graphed layer itself, act on "
            "param.grad after the backward instead of in a parameter's gradient hook (Lightning's "
            "on_before_optimizer_step or on_after_backward, or after accelerator.backward), leave the layer "
            "out of graphs.layers, or set graphs.on_capture_error='split' (the hooked submodules are then graphed "
            "with their hooks around the replay, or run eagerly)."
        )


def refuse_python_state_changes(name: str, state) -> None:
    """A forward that changes a number, string or flag attribute of the layer or a submodule at every call (a
    counter: ``state``, a :class:`~..module_state.ModuleState` made before the warmup passes, differs now) would change
    it at capture only, since a replay runs no Python: the values are put back and the capture refused, naming
    them."""
    if state.attributes_match():
        return
    line = next(c for c in state.changes() if c.startswith("attribute"))
    state.restore_attributes()
    raise GraphCaptureError(
        f"could not capture layer {name!r}: its forward changes {line.split(': ', 1)[1]} at every call, which a "
        "replay would not do (it runs no Python). Keep such state outside the layer, leave the layer out of "
        "graphs.layers, or set graphs.on_capture_error='split' (the part that changes it then runs eagerly)."
    )


def refuse_saved_tensor_hooks(name: str) -> None:
    """A layer that runs under saved-tensor hooks (an enclosing non-reentrant ``torch.utils.checkpoint``) would
    have its graph replayed a second time by that recomputation."""
    if torch_compat.saved_tensor_hooks_active():
        raise GraphCaptureError(
            f"could not capture layer {name!r}: it runs under saved-tensor hooks, e.g. inside a "
            "non-reentrant torch.utils.checkpoint around the layer, whose recomputation would replay the "
            "graph a second time. Checkpoint inside the layer instead (cg_lightning.checkpoint or "
            "torch.utils.checkpoint within its forward), or leave the layer out of graphs.layers."
        )


def refuse_foreign_leaves(name: str, outs, owned: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                          anchor: Optional[torch.Tensor]) -> None:
    """A leaf that requires grad, is reachable from the outputs and is neither an input nor owned by the
    layer (a parameter of another module used directly, or closed over by a function) would get no
    gradient from the graph: refuse it by name rather than lose it."""
    known = set(map(id, owned)) | set(map(id, inputs))
    if anchor is not None:
        known.add(id(anchor))
    foreign = [t for t in leaf_tensors(outs) if t.requires_grad and id(t) not in known]
    if foreign:
        what = ", ".join(f"{type(t).__name__}{list(t.shape)}" for t in foreign[:5])
        raise GraphCaptureError(
            f"could not capture layer {name!r}: its outputs depend on {len(foreign)} tensor(s) that "
            f"require grad but are neither its inputs nor its own parameters ({what}); the graph would "
            "return no gradient for them. Register the module that holds them as a submodule of the "
            "layer, pass them as arguments, or leave the layer out of graphs.layers."
        )


def refuse_frozen_unseen(name: str, module: torch.nn.Module, direct: Sequence[torch.nn.Parameter],
                         hidden: Sequence[torch.nn.Parameter]) -> None:
    """A parameter frozen after capture whose freezing nothing else would notice: one the replay reports
    itself (graphs.direct_grad_ready: no autograd edge is left to go silent), or one used only inside a
    recomputation region (no edge; its recorded grad-ready notifications are replayed). The graph keeps
    computing its gradient and adding it into ``main_grad``, so the optimizer would still move it; the
    eager backend would fail inside autograd instead ("One of the differentiated Tensors does not require
    grad"), naming nothing. Call it when one of ``direct`` or ``hidden`` no longer requires grad."""
    direct = [p for p in direct if not p.requires_grad]
    hidden = [p for p in hidden if not p.requires_grad]
    named = {id(q): n for n, q in module.named_parameters()}
    parts = [f"{named.get(id(p), '?')!r} (reported ready by the layer's replay itself, graphs.direct_grad_ready)"
             for p in direct]
    parts += [f"{named.get(id(p), '?')!r} (used only inside its activation recomputation)" for p in hidden]
    raise GraphCaptureError(
        f"layer {name!r}: parameter(s) {', '.join(parts)} were frozen (requires_grad=False) after the "
        "layer's graphs were captured; its graph would keep adding their gradients into main_grad. Freeze "
        "parameters before training starts (or before the capture step, graphs.warmup_steps)"
        + (", or set graphs.direct_grad_ready=false." if direct else ".")
    )


def check_still_frozen(name: str, module: torch.nn.Module, frozen_at_capture: Sequence[torch.nn.Parameter]) -> None:
    """A parameter frozen at capture and trainable now would silently get no gradient from the graphs.

    Only those are checked (usually none, so replays pay nothing): the opposite change, a parameter
    frozen after capture, stops reporting ready and the DDP engine names it as a missing gradient.
    """
    for p in frozen_at_capture:
        if p.requires_grad:
            pname = next((n for n, q in module.named_parameters() if q is p), "?")
            raise GraphCaptureError(
                f"layer {name!r}: parameter {pname!r} changed requires_grad from False to True after the "
                "layer's graphs were captured; they would keep computing gradients for the old set. Freeze "
                "or unfreeze parameters before training starts (or before the capture step, "
                "graphs.warmup_steps), or leave the layer out of graphs.layers."
            )


def describe_autocast(state: tuple) -> str:
    on = [f"{dt} {str(dtype).replace('torch.', '')}" for dt, enabled, dtype in state if enabled]
    return "enabled for " + ", ".join(on) if on else "disabled"


#: the remedy every capture failure names (a mixture-of-experts layer's expert dispatch is the usual case)
SPLIT_HINT = ("set graphs.on_capture_error='split' to graph the layer's parts and run only the parts that fail "
              "eagerly ('eager' runs the whole layer eagerly)")


def failure_cause(exc: BaseException) -> str:
    """The first line of what made a capture fail: the host synchronization (operation and source line) when
    that was the cause, else ``exc``'s own first line."""
    inner = getattr(exc, "host_sync", None) or exc.__cause__
    inner = inner if isinstance(inner, HostSyncError) else exc
    text = str(inner).strip()
    return text.splitlines()[0] if text else type(inner).__name__


def capture_error(name: str, what: str, exc: BaseException) -> GraphCaptureError:
    """:func:`capture_failure` as the error to raise, ``from`` :func:`chained_cause`; a host synchronization that
    made the capture fail is kept as its ``host_sync``."""
    error = GraphCaptureError(capture_failure(name, what, exc))
    if isinstance(exc, HostSyncError):
        error.host_sync = exc
    return error


def chained_cause(exc: BaseException) -> Optional[BaseException]:
    """What a :func:`capture_error` is raised from: ``exc``, whose traceback shows where inside the layer it
    failed; ``None`` for a host synchronization that names its source line: the error quotes all it says, and
    chained, the same words and line would be shown twice."""
    text = str(exc).strip()
    return None if isinstance(exc, HostSyncError) and " at File " in text and "\n" not in text else exc


def capture_failure(name: str, what: str, exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, HostSyncError):
        return (
            f"could not capture the {what} of layer {name!r}: {text}. A graph replays device work only; the "
            "host would never see that value again. Compute it outside the layer (or keep it on the device), "
            f"leave the layer out of graphs.layers, or {SPLIT_HINT}."
        )
    hints = []
    low = text.lower()
    if "capture" in low and ("sync" in low or "not permitted" in low or "operation not permitted" in low):
        hints.append("a host synchronization (.item(), printing a tensor, a CPU copy, data-dependent Python "
                     "control flow) inside the layer")
    if "leaf variable that requires grad is being used in an in-place operation" in low:
        hints.append("the layer modifies one of its inputs in place (e.g. ReLU(inplace=True) applied to the "
                     "input); a graphed layer receives its inputs as static leaf tensors, so make that operation "
                     "out of place")
    if not hints:
        hints.append("a host synchronization, data-dependent control flow, a module hook or a CPU tensor")
    return (
        f"could not capture the {what} of layer {name!r}: {type(exc).__name__}: {text}. Likely cause: "
        f"{hints[0]}. Remove it from the layer's forward, leave the layer out of graphs.layers, or {SPLIT_HINT}."
    )


def nothing_graphed(names: Sequence[str], warmup_steps: int, no_grad_calls: int) -> str:
    """The warning given once when warmup is over and no call of the selected layers ``names`` could be graphed;
    ``no_grad_calls``: their training-mode calls without autograd in the last training forward."""
    listed = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    if no_grad_calls:
        why = (f"ran {no_grad_calls} times in training mode but without autograd: under torch.no_grad(), or inside "
               "an activation checkpoint around the layer (a reentrant torch.utils.checkpoint runs its forward "
               "without autograd). Checkpoint inside the layer instead (cg_lightning.checkpoint, or "
               "torch.utils.checkpoint within its forward)")
    else:
        why = ("were not called in training mode with autograd on. Check that the training step calls them "
               "(graphs.layers names the modules to graph)")
    return (f"cg_lightning: nothing is graphed: the {warmup_steps} warmup step(s) are over, but in this training "
            f"step the selected layers ({listed}) {why}. These calls run eagerly: training stays correct and gains "
            "no speed. This warning is given once.")


def observers_active() -> str:
    """The warning given once when a training step asks transformers to collect outputs from inside graphed
    layers (:mod:`.observer_hooks`)."""
    return ("cg_lightning: this training step asks transformers to collect outputs from inside the graphed layers "
            "(output_attentions, output_router_logits, or hidden states of a submodule): the graphed layers run "
            "eagerly in such steps, so that the library collects them; other steps replay the graphs. "
            "graphs.on_capture_error='split' graphs the layers' parts instead (the hooked submodules among them), "
            "or request those outputs only where you need them (a validation step). This warning is given once.")


def observer_inside(name: str) -> str:
    """Why a layer is split when transformers collects outputs from inside it (``on_capture_error="split"``)."""
    return (f"layer {name!r} holds submodules whose outputs transformers collects in this step (output_attentions, "
            "output_router_logits): their hooks would run once at capture and never at replay")


def unmatched_warmup(mismatches: Sequence[str]) -> str:
    """The warning given once when no step after warmup starts like the recorded one, so nothing is captured."""
    if any("Cache" in m for m in mismatches):
        hint = (" A new cache object in every forward (transformers with use_cache=True) never matches: pass "
                "use_cache=False to the model in training.")
    else:
        hint = (" Shapes that change every step (text padded to its longest row) never match: pad to a few lengths "
                "(cg_lightning.pad_to_multiple) with graphs.shape_policy='recapture', or use fixed shapes.")
    return ("cg_lightning: nothing is graphed: the first graphed call of this step differs from the one recorded in "
            "the warmup steps, so the recorded calls cannot be captured and the layers run eagerly:\n  "
            + "\n  ".join(mismatches) + f"\n{hint}".rstrip() + " This warning is given once.")


def cache_full(limit: int, signature: str) -> str:
    """The warning given once when ``graphs.max_graph_sets`` (``limit``) sets exist and a step with another
    argument ``signature`` (described) runs eagerly."""
    return (f"cg_lightning: graphs.max_graph_sets={limit} graph sets exist; steps with other argument signatures "
            f"(this one: {signature}) run eagerly. Further such steps are not reported.")
