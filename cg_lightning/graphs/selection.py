"""Which modules of a model get graphs, and the record the graph manager keeps of each."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch.nn as nn


@dataclass
class GraphedLayer:
    """One selected layer: its qualified name, the module, and its own bound ``forward`` (which the graph
    manager's dispatch replaces until ``GraphManager.remove``)."""

    name: str
    module: nn.Module
    forward: Callable
    warned: bool = False  #: a call ran eagerly under shape_policy "eager" and was reported
    failure: Optional[str] = None  #: why its capture failed (it then runs eagerly)


def default_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The entries of the largest ``nn.ModuleList`` whose entries all share one class (the blocks)."""
    best: List[Tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            classes = {type(m) for m in module}
            if len(classes) == 1:
                best = [(f"{name}.{i}" if name else str(i), m) for i, m in enumerate(module)]
    return best


def select_layers(model: nn.Module, patterns: Optional[Sequence[str]]) -> List[Tuple[str, nn.Module]]:
    """Modules to graph, by glob patterns over qualified names (outermost match wins).

    Args:
        model: the root module.
        patterns: e.g. ``["model.blocks.*"]``; ``None`` means :func:`default_layers`.

    Raises:
        ValueError: if no module matches (the message lists a few candidate names).
    """
    if patterns is None:
        chosen = default_layers(model)
        if not chosen:
            raise ValueError(
                "graphs.layers is not set and the model has no nn.ModuleList of same-class layers to graph by "
                "default; set graphs.layers to glob patterns over module names, e.g. ['model.blocks.*']"
            )
        return chosen
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
