"""What a graph was captured over that Python changes without a kernel, so a replay must check it first.

A captured graph replays the kernels of its capture on the tensors of its capture. Four things set by plain Python
decide those kernels and tensors, and none of them runs a kernel when it changes:

* the structure: which submodules, parameters and buffers each module holds (``block.mlp = NewMLP()``,
  ``layer.weight = nn.Parameter(...)``): a graph would go on running the old ones;
* the train/eval mode of each submodule (a dropout switched to eval alone would still drop);
* ``requires_grad`` of each parameter (``toggle_optimizer``, a frozen backbone);
* the numbers, strings and flags the submodules hold as attributes and hand kernels as constants (a dropout's
  ``p`` that a callback anneals, a norm's ``eps``).

:class:`ModuleState` records them for one module tree and says what differs later. The structure is only walked
again after some module in the process registered a submodule, parameter or buffer (torch's global registration
hooks count those), so a replay pays an integer comparison for it; modes, ``requires_grad`` and attributes are
compared at every check (C-level getters and one list comparison).
"""

from __future__ import annotations

import operator
from typing import Any, List, Optional, Tuple

import torch
from torch.nn.modules import module as _nn_module

REQUIRES_GRAD = operator.attrgetter("requires_grad")  # C-level getters: checked at every replay
TRAINING = operator.attrgetter("training")
_SCALARS = (bool, int, float, str, type(None))


class _Registrations:
    """A count of every submodule, parameter and buffer registration in the process (``module.x = ...`` included),
    kept by torch's global registration hooks, installed by :func:`watch_registrations` before the first step.

    Compiled code does not count: dynamo inlines the hooks into every traced registration (transformers' decoders
    slice their ``ModuleList`` at every forward, which registers each layer again), and a counter there breaks the
    graph at each one (a class attribute) or specializes the code on its value (a list item). The registrations the
    count guards, between steps (a callback, the loop's own code), run uncompiled."""

    count = 0
    installed = False

    @classmethod
    def bump(cls, *args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        cls.count += 1

    @classmethod
    def install(cls) -> None:
        if not cls.installed:
            cls.installed = True
            _nn_module.register_module_module_registration_hook(cls.bump)
            _nn_module.register_module_parameter_registration_hook(cls.bump)
            _nn_module.register_module_buffer_registration_hook(cls.bump)


def watch_registrations() -> None:
    """Install the registration count now (once per process). Call it before a model is compiled: torch.compile
    guards on whether global registration hooks exist, so installing them later recompiles the model once."""
    _Registrations.install()


def _attribute_slots(modules: List[torch.nn.Module]) -> List[Tuple[dict, str]]:
    """``(module.__dict__, name)`` of every public attribute holding a number, string, flag or ``None``."""
    return [(m.__dict__, k) for m in modules for k, v in m.__dict__.items()
            if type(v) in _SCALARS and not k.startswith("_") and k != "training"]


class ModuleState:
    """The structure, modes, ``requires_grad`` and scalar attributes of ``module`` and its submodules, as now.

    Args:
        module: the root of the tree.
        root_attributes: also record the root's own attributes (``False`` for a LightningModule, whose attributes
            its training step's code check watches where they are read).
    """

    def __init__(self, module: torch.nn.Module, root_attributes: bool = True) -> None:
        watch_registrations()
        self.module = module
        self.root_attributes = root_attributes
        self._registrations = _Registrations.count
        self.named_modules = list(module.named_modules())
        self.named_params = list(module.named_parameters())
        self.modules = [m for _, m in self.named_modules]
        self.params = [p for _, p in self.named_params]
        self._buffers = [b for _, b in module.named_buffers()]
        self._modes = tuple(map(TRAINING, self.modules))
        self._grads_needed = tuple(map(REQUIRES_GRAD, self.params))
        self.snapshot_attributes()

    def snapshot_attributes(self) -> None:
        """Record the attributes' values as they are now (after a capture, whose eager runs may set some)."""
        self._slots = _attribute_slots(self.modules if self.root_attributes else self.modules[1:])
        self._dicts = [d for d, _ in self._slots]
        self._keys = [k for _, k in self._slots]
        self._values = list(map(dict.get, self._dicts, self._keys))

    def restore_attributes(self) -> None:
        """Put the recorded values back (each run at a capture starts from the same Python state)."""
        for d, k, v in zip(self._dicts, self._keys, self._values):
            d[k] = v

    # ----------------------------------------------------------------- the checks, cheapest first
    def structure_matches(self) -> bool:
        """The tree holds the same submodules, parameters and buffers (walked again only after a registration)."""
        if _Registrations.count == self._registrations:
            return True
        same = (_same(self.module.modules(), self.modules) and _same(self.module.parameters(), self.params)
                and _same(self.module.buffers(), self._buffers))
        if same:
            self._registrations = _Registrations.count
        return same

    def modes_match(self) -> bool:
        return tuple(map(TRAINING, self.modules)) == self._modes

    def params_match(self) -> bool:
        return tuple(map(REQUIRES_GRAD, self.params)) == self._grads_needed

    def attributes_match(self) -> bool:
        return list(map(dict.get, self._dicts, self._keys)) == self._values  # C-level: checked at every replay

    def match(self) -> bool:
        return self.structure_matches() and self.modes_match() and self.params_match() and self.attributes_match()

    # ----------------------------------------------------------------- in words
    def changes(self) -> List[str]:
        """Every difference from the recorded state, one line each (empty when :meth:`match`)."""
        out = []
        if not self.structure_matches():
            now = dict(self.module.named_modules())
            replaced = [n or "(the module)" for n, m in self.named_modules if now.get(n) is not m]
            added = [n for n in now if n not in dict(self.named_modules)]
            params = dict(self.module.named_parameters())
            swapped = [n for n, p in self.named_params if params.get(n) is not p]
            what = ([f"submodule(s) {replaced} replaced or removed"] if replaced else []) + (
                [f"submodule(s) {added} added"] if added else []) + (
                [f"parameter(s) {swapped} replaced"] if swapped else []) or ["a buffer replaced"]
            out.append("since capture: " + "; ".join(what))
        if not self.modes_match():
            changed = [name or "(the layer)" for (name, m), was in zip(self.named_modules, self._modes)
                       if m.training != was]
            out.append(f"train/eval mode changed since capture for submodule(s) {changed}")
        if not self.params_match():
            changed = [name for (name, p), was in zip(self.named_params, self._grads_needed) if p.requires_grad != was]
            out.append(f"requires_grad changed since capture for parameter(s) {changed} (toggle_optimizer or "
                       "freezing)")
        if not self.attributes_match():
            names = {id(m.__dict__): n for n, m in self.named_modules}
            changed = [f"{names.get(id(d), '?')}.{k}: {was!r} -> {d.get(k, '(removed)')!r}".lstrip(".")
                       for (d, k), was in zip(self._slots, self._values) if not _equal(d.get(k), was)]
            out.append(f"attribute(s) changed since capture, which the captured kernels hold as constants: "
                       f"{', '.join(changed)}")
        return out

    def first_change(self) -> Optional[str]:
        """The first line of :meth:`changes`, or ``None``."""
        return None if self.match() else (self.changes() or [None])[0]


def _equal(a: Any, b: Any) -> bool:
    return a is b or a == b


def _same(now, recorded: list) -> bool:
    now = list(now)
    return len(now) == len(recorded) and all(a is b for a, b in zip(now, recorded))
