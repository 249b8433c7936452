"""Which modules of a model get graphs, and the record the graph manager keeps of each.

By default, the blocks of every stack, each ``nn.ModuleList`` and ``nn.Sequential`` judged on its own, outermost
first (a selected block's own inner stacks are not judged). Only entries with trainable parameters count:

* ``nn.Sequential`` (a pipeline: stem, blocks, head): the entries of its most frequent class, when it occurs at
  least twice; a ResNet stage's blocks, not the ``nn.Linear`` or ``nn.Embedding`` around them.
* ``nn.ModuleList`` (a list the parent loops over): the entries of its most frequent class, and also every entry
  of a class defined outside ``torch`` (a layer class of the model's own), so that a hybrid stack of several
  decoder-layer classes (Jamba's attention and Mamba layers) is graphed whole; lone ``torch.nn`` built-ins
  (an ``nn.Linear`` or ``nn.LayerNorm`` among the layers) are not.

A model with no stack (one ``nn.Linear``, an MLP of separately named layers) gets no graphs:
:func:`default_layers` returns nothing and the front-ends train it eagerly under the data-parallel engine, with a
warning that names ``graphs.layers``. :func:`eager_modules` names what runs outside the graphs, for the capture
summary.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch.nn as nn

NO_DEFAULT_LAYERS = (
    "cg_lightning: {model} has no repeated layers to graph by default (no nn.ModuleList holds a module with "
    "trainable parameters, no nn.Sequential two of one class), so it trains without graphs, under "
    "the exact data-parallel engine. To graph chosen modules, set graphs.layers to glob patterns over module "
    "names, e.g. graphs={{'layers': [{example}]}}; some names: {names}"
)


@dataclass(eq=False)
class GraphedLayer:
    """One selected layer: its qualified name, the module, and its own bound ``forward`` (which the graph
    manager's dispatch replaces until ``GraphManager.remove``). Compared by identity."""

    name: str
    module: nn.Module
    forward: Callable
    warned: bool = False  #: a call ran eagerly under shape_policy "eager" and was reported
    failure: Optional[str] = None  #: why its capture failed (it then runs eagerly)
    #: graphs.on_capture_error="split": the layer this one is a part of (``None`` for a selected layer), how
    #: many splits below a selected layer it is, and its own parts once it was split (its forward then runs
    #: eagerly and calls them)
    parent: Optional["GraphedLayer"] = None
    depth: int = 0
    parts: Optional[List["GraphedLayer"]] = None
    #: the module's own instance attribute ``forward`` before the dispatch was installed (a forward the user
    #: compiled with ``layer.forward = torch.compile(layer.forward)``), put back by ``LayerSelection.remove``
    own_forward: Optional[Callable] = None
    #: its forward is a ``torch.compile`` wrapper (the user's or graphs.compile's): captured without the
    #: host-sync dispatch modes, under which dynamo would run the uncompiled code (:mod:`.capture.host_sync`)
    compiled: bool = False


def _own_class(module: nn.Module) -> bool:
    """Whether ``module``'s class is defined outside ``torch`` (a model's own layer, not a built-in)."""
    return not type(module).__module__.startswith("torch.")


def _stack_blocks(container: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The blocks of one ``nn.ModuleList`` or ``nn.Sequential``, by the rule of the module docstring."""
    entries = [(key, m) for key, m in container.named_children()
               if any(p.requires_grad for p in m.parameters())]
    counts = Counter(type(m) for _, m in entries)
    most = max(counts.values(), default=0)
    if isinstance(container, nn.ModuleList):
        return [(key, m) for key, m in entries if counts[type(m)] == most or _own_class(m)]
    return [(key, m) for key, m in entries if most >= 2 and counts[type(m)] == most]


def default_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The blocks of every ``nn.ModuleList`` and ``nn.Sequential`` in ``model`` (module docstring), outermost
    first: the stacks inside a chosen block are not judged.

    Returns:
        ``(qualified name, module)`` pairs in module order; empty when the model has no such stack.
    """
    chosen: List[Tuple[str, nn.Module]] = []
    taken: List[str] = []
    for name, module in model.named_modules():
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            for key, block in _stack_blocks(module):
                full = f"{name}.{key}" if name else key
                chosen.append((full, block))
                taken.append(full)
    return chosen


def eager_modules(model: nn.Module, graphed: Iterable[str]) -> List[str]:
    """What holds trainable parameters outside the ``graphed`` modules (qualified names), coarsest first.

    The walk goes down only through modules that contain a graphed one; every other child with trainable
    parameters is named whole (``"model.embed_tokens"``, ``"lm_head"``), once however many names it has (a tied
    embedding), and so is a trainable parameter held directly by a module on the way (``"pos_emb"``). Returns
    the names in module order; empty when every trainable parameter is inside a graphed module.
    """
    graphed = set(graphed)
    seen = {id(model.get_submodule(name)) for name in graphed}
    out: List[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        out.extend(prefix + key for key, p in module.named_parameters(recurse=False) if p.requires_grad)
        for key, child in module.named_children():
            full = prefix + key
            if full in graphed or id(child) in seen:
                continue
            seen.add(id(child))
            if any(g.startswith(full + ".") for g in graphed):
                visit(full + ".", child)
            elif any(p.requires_grad for p in child.parameters()):
                out.append(full)

    visit("", model)
    return out


def no_default_layers_message(model: nn.Module) -> str:
    """The warning for a model where :func:`default_layers` finds nothing: what happens and how to choose."""
    names = [n for n, m in model.named_modules() if n and any(True for _ in m.parameters(recurse=False))][:8]
    example = repr(names[0]) if names else "'model.layer'"
    return NO_DEFAULT_LAYERS.format(model=type(model).__name__, example=example, names=names)


def trainable_children(module: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The direct children of ``module`` that hold a trainable parameter, in module order: what a layer is
    split into (``graphs.on_capture_error="split"``, :mod:`.split.splitting`).

    Returns:
        ``(child name, child)`` pairs; empty when there are none.
    """
    return [(key, child) for key, child in module.named_children() if any(p.requires_grad for p in child.parameters())]


def select_layers(model: nn.Module, patterns: Optional[Sequence[str]]) -> List[Tuple[str, nn.Module]]:
    """Modules to graph, by glob patterns over qualified names (outermost match wins).

    Args:
        model: the root module.
        patterns: e.g. ``["model.blocks.*"]``; ``None`` means :func:`default_layers` (which may be empty).

    Raises:
        ValueError: if ``patterns`` are given and match no module (the message lists a few candidate names).
    """
    if patterns is None:
        return default_layers(model)
    chosen = []
    taken: List[str] = []
    for name, module in model.named_modules():
        if not name or any(name == t or name.startswith(t + ".") for t in taken):
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            chosen.append((name, module))
            taken.append(name)
    if not chosen:
        names = [n for n, _ in model.named_modules() if n][:12]
        raise ValueError(f"graphs.layers {list(patterns)} matched no module; some module names: {names}")
    return chosen
