"""Forward hooks that only observe, and do nothing unless a collector is active: transformers' output capturing.

A forward of a transformers model with ``output_hidden_states``, ``output_attentions`` or
``output_router_logits`` installs, once and for good, forward hooks on the modules whose outputs it collects
(``transformers/utils/output_capturing.py``: decoder layers, their ``self_attn``, an MoE layer's ``mlp.gate``).
Each hook returns at once unless the model's forward set a collector holding its key. Such a hook inside a
graphed layer changes nothing while it is inactive, so it does not block capture (:func:`observers_inside`
lists them apart from the hooks that do); a step in which one is active runs the graphed layers eagerly
(:func:`any_active`), so that the library collects what it asked for. Recognised by the hook's module and the names of its globals and closure, without
importing transformers.
"""

from __future__ import annotations

from typing import Callable, Iterable, List

import torch

from .. import torch_compat

_MODULE = "transformers.utils.output_capturing"


def is_observer(hook: Callable) -> bool:
    """Whether ``hook`` is one of transformers' output-capturing forward hooks."""
    code = getattr(hook, "__code__", None)
    return (getattr(hook, "__module__", None) == _MODULE and code is not None and "key" in code.co_freevars
            and "_active_collector" in getattr(hook, "__globals__", {}))


def is_active(hook: Callable) -> bool:
    """Whether the observer ``hook`` would collect now (its model's forward asked for its key)."""
    collected = hook.__globals__["_active_collector"].get()
    key = hook.__closure__[hook.__code__.co_freevars.index("key")].cell_contents
    return collected is not None and key in collected


def observers_inside(layer: torch.nn.Module) -> List[Callable]:
    """The observer forward hooks on submodules of ``layer``."""
    return [hook for module in layer.modules() if module is not layer
            for hook in torch_compat.module_hooks(module)["forward_hooks"].values() if is_observer(hook)]


def any_active(hooks: Iterable[Callable]) -> bool:
    return any(is_active(hook) for hook in hooks)
