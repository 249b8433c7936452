"""Registering the strategy with each Lightning package and with Lightning Fabric without importing any first.

There are two Lightning packages with the same code under two names, ``lightning.pytorch`` and the standalone
``pytorch_lightning``; a Trainer of one accepts only strategies built on its own ``Strategy``. So each has its
own strategy class, the same body on its own ``DDPStrategy``, defined in the module :data:`_NAMESPACES` names
for it, and registered as ``"cudagraph_ddp"`` in that package's registry.

``import cg_lightning`` promises that ``Trainer(strategy="cudagraph_ddp")`` works afterwards. If a package is
already imported, the name is registered with it at once; otherwise a finder on ``sys.meta_path`` waits for the
package to finish importing and registers it then, so that ``import cg_lightning.graphs`` alone never loads
Lightning. The hook watches the top package (``lightning.pytorch``), not its ``strategies`` module: that module
is imported while the package is still initialising, when the strategy's own imports of Lightning (trainer
states, the optimizer wrapper) are not safe yet; any import of ``strategies`` finishes the package first. When
it is the strategy module that imports its package, the class does not exist yet when the package is done: the
strategy module's own completion registers it then.

Once the classes of both packages exist, each is also registered as a virtual subclass of the other package's
``Strategy`` (:meth:`abc.ABCMeta.register`). A Trainer handed the other package's class then passes its type
check and sets the strategy's accelerator, where the class raises :func:`wrong_trainer_error`, naming the import
that fits, instead of Lightning's "invalid strategy".

Fabric (``lightning.fabric``) is watched the same way; its strategy (:mod:`cg_lightning.fabric.strategy`) is a
Fabric ``Strategy``, registered in Fabric's own registry under the same names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Set

#: Lightning package -> the module that defines its ``CUDAGraphDDPStrategy``
_NAMESPACES: Dict[str, str] = {
    "lightning.pytorch": "cg_lightning.trainer.strategy",
    "pytorch_lightning": "cg_lightning.trainer.pytorch_lightning",
}
_MODULES = {module: namespace for namespace, module in _NAMESPACES.items()}
#: Lightning package -> the documented import path of its ``CUDAGraphDDPStrategy``
_PUBLIC: Dict[str, str] = {"lightning.pytorch": "cg_lightning", "pytorch_lightning": "cg_lightning.pytorch_lightning"}
_lock = threading.RLock()
_loading: Set[str] = set()  # watched modules being executed right now
_registered: Dict[str, type] = {}  # Lightning package -> its strategy class, once registered


@dataclass(frozen=True)
class LightningNamespace:
    """The pieces the strategy body takes from one Lightning package.

    Attributes:
        name: the package, ``"lightning.pytorch"`` or ``"pytorch_lightning"``.
        accelerator: its ``Accelerator`` base class (a Trainer of this package hands the strategy one).
        optimizer_wrapper: its ``LightningOptimizer``.
        fitting: its ``TrainerFn.FITTING``.
        rank_zero_info: its ``rank_zero_info``.
    """

    name: str
    accelerator: type
    optimizer_wrapper: type
    fitting: Any
    rank_zero_info: Callable[[str], None]


def wrong_trainer_error(cls: type, accelerator: Any) -> TypeError:
    """The error for the strategy class ``cls`` of one Lightning package handed to the Trainer of another (whose
    ``accelerator`` it was given), naming the import of the class that fits that Trainer."""
    mine = cls._lightning_ns.name
    theirs = next((ns for klass in type(accelerator).__mro__ for ns in _NAMESPACES
                   if ns != mine and (klass.__module__ == ns or klass.__module__.startswith(ns + "."))), None)
    use = [f"from {_PUBLIC[ns]} import CUDAGraphDDPStrategy" for ns in _NAMESPACES
           if ns == theirs or (theirs is None and ns != mine)]
    return TypeError(
        f"{_PUBLIC.get(mine, cls.__module__)}.CUDAGraphDDPStrategy is built on {mine}, but the Trainer it was given "
        f"to is "
        f"{theirs or 'another package'}'s (its accelerator is a {type(accelerator).__module__}."
        f"{type(accelerator).__qualname__}): use `{'` or `'.join(use)}`, or strategy=\"cudagraph_ddp\""
    )


def _register(namespace: str) -> None:
    """Register the strategy name with ``namespace``'s registry (once), and make its class and those of the
    packages registered before it virtual subclasses of each other's ``Strategy``."""
    if namespace in _registered:
        return
    strategies = importlib.import_module(f"{namespace}.strategies")
    cls = importlib.import_module(_NAMESPACES[namespace]).CUDAGraphDDPStrategy
    cls.register_strategies(strategies.StrategyRegistry)
    with _lock:
        for other, other_cls in list(_registered.items()):
            strategies.Strategy.register(other_cls)
            importlib.import_module(f"{other}.strategies").Strategy.register(cls)
        _registered[namespace] = cls


def _namespace_loaded(name: str) -> None:
    if _NAMESPACES[name] not in _loading:  # else that strategy module registers itself when it is complete
        _register(name)


def _module_loaded(name: str) -> None:
    namespace = _MODULES[name]
    if namespace in sys.modules and namespace not in _loading:
        _register(namespace)


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


#: Lightning Fabric and the module of its strategy class (a Fabric ``Strategy``: no virtual subclassing with the
#: Trainer strategies, whose base class is another)
FABRIC, FABRIC_MODULE = "lightning.fabric", "cg_lightning.fabric.strategy"


def register_with_fabric(_name: str = FABRIC) -> None:
    """Register ``"cudagraph_ddp"`` (and its ``find_unused_parameters`` alias) with Fabric's strategy registry, once.
    While the strategy module itself is being imported, its last line calls this instead."""
    module = sys.modules.get(FABRIC_MODULE)
    if module is not None and not hasattr(module, "CUDAGraphDDPStrategy"):
        return  # the strategy module imports Fabric and registers itself when it is complete
    registry = importlib.import_module(f"{FABRIC}.strategies").STRATEGY_REGISTRY
    strategy_module = importlib.import_module(FABRIC_MODULE)  # a first import registers at its last line
    with _lock:
        if "cudagraph_ddp" not in registry:
            strategy_module.CUDAGraphDDPStrategy.register_strategies(registry)


def register_with_lightning() -> None:
    """Register the strategy name with each Lightning package and with Fabric: now if it is imported, else once it
    is (a package that is not installed is never imported, and its watch costs one dictionary look-up per
    import)."""
    with _lock:  # watch first: registering one package may import the other
        for namespace, module in _NAMESPACES.items():
            if namespace not in sys.modules:
                _finder.pending[namespace] = _namespace_loaded
                if module not in sys.modules:
                    _finder.pending[module] = _module_loaded
        if FABRIC not in sys.modules:
            _finder.pending[FABRIC] = register_with_fabric
        if _finder.pending and _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    for namespace in _NAMESPACES:
        if namespace in sys.modules:
            _register(namespace)
    if FABRIC in sys.modules:
        register_with_fabric()
