"""Registering the strategy names with Lightning without importing Lightning first.

``import cg_lightning`` promises that ``Trainer(strategy="cudagraph_ddp")`` works afterwards. If Lightning is
already imported, the names are registered at once; otherwise a finder on ``sys.meta_path`` waits for the
Lightning package to finish importing and registers them then, so that ``import cg_lightning.graphs`` alone
never loads Lightning. The hook watches the top package (``lightning.pytorch``), not its ``strategies``
module: that module is imported while the package is still initialising, when the strategy's own imports of
Lightning (trainer states, the optimizer wrapper) are not safe yet; any import of ``strategies`` finishes the
package first. When it is :mod:`cg_lightning.strategy` that imports Lightning, the strategy class does not
exist yet when Lightning is done: the strategy module's own completion registers it then. Another namespace
(``pytorch_lightning``) is one more entry in :data:`_NAMESPACES`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading
from typing import Callable, Dict, Set

_STRATEGY = "cg_lightning.strategy"
_lock = threading.RLock()
_loading: Set[str] = set()  # watched modules being executed right now


def _register_lightning() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from .strategy import CUDAGraphDDPStrategy

    CUDAGraphDDPStrategy.register_strategies(StrategyRegistry)


#: Lightning package -> what registers the strategy names with it
_NAMESPACES: Dict[str, Callable[[], None]] = {"lightning.pytorch": _register_lightning}


def _namespace_loaded(name: str) -> None:
    if _STRATEGY not in _loading:  # else the strategy module registers itself when it is complete
        _NAMESPACES[name]()


def _strategy_loaded(_name: str) -> None:
    for name, register in _NAMESPACES.items():
        if name in sys.modules and name not in _loading:
            register()


class _RunAfterExec(importlib.abc.Loader):
    """Runs the real loader, then ``after(name)``; the module keeps the real loader."""

    def __init__(self, loader, name: str, after: Callable[[str], None]) -> None:
        self._loader = loader
        self._name = name
        self._after = after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__spec__.loader = module.__loader__ = self._loader
        _loading.add(self._name)
        try:
            self._loader.exec_module(module)
        finally:
            _loading.discard(self._name)
        self._after(self._name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module it takes the spec the other finders give and wraps its loader
    so that ``after(name)`` runs right after the module is executed."""

    def __init__(self) -> None:
        self.pending: Dict[str, Callable[[str], None]] = {}

    def find_spec(self, fullname, path, target=None):
        after = self.pending.get(fullname)
        if after is None:
            return None
        for finder in sys.meta_path:
            # other finders are foreign objects; old-style ones without find_spec are skipped
            find_spec = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        with _lock:
            self.pending.pop(fullname, None)
            if not self.pending and self in sys.meta_path:
                sys.meta_path.remove(self)
        spec.loader = _RunAfterExec(spec.loader, fullname, after)
        return spec


_finder = _PostImportFinder()


def register_with_lightning() -> None:
    """Register the strategy names with each Lightning namespace: now if it is imported, else once it is."""
    waiting = False
    for name, register in _NAMESPACES.items():
        if name in sys.modules:
            register()
            continue
        waiting = True
        with _lock:
            _finder.pending[name] = _namespace_loaded
    if waiting and _STRATEGY not in sys.modules:
        with _lock:
            _finder.pending[_STRATEGY] = _strategy_loaded
    with _lock:
        if _finder.pending and _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
