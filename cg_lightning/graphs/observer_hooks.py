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

from typing import Callable, Iterable, List, Set

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


class ObserverWatch:
    """The observer hooks inside one graph manager's layers (:meth:`note`, :meth:`renote`), and whether any hook
    was added in the process since the last look (:meth:`hooks_added`: then the layers are looked at again)."""

    def __init__(self) -> None:
        self.hooks: Set[Callable] = set()
        self.warned = False  #: the manager's "runs eagerly in such steps" warning was given
        self._handles = torch_compat.hook_handles_created()

    def note(self, layer: torch.nn.Module) -> None:
        self.hooks.update(observers_inside(layer))

    def renote(self, layers: Iterable[torch.nn.Module]) -> None:
        """Forget the hooks noted so far and note those inside ``layers`` (after a split)."""
        self.hooks = {hook for layer in layers for hook in observers_inside(layer)}

    def hooks_added(self) -> bool:
        created = torch_compat.hook_handles_created()
        if created == self._handles:
            return False
        self._handles = created
        return True

    def active(self) -> bool:
        """Whether an observer inside the layers collects in this step."""
        return bool(self.hooks) and any_active(self.hooks)
