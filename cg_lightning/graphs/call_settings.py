"""The settings a graphed call was captured under, besides its arguments: autocast, the train/eval mode of each
submodule and ``requires_grad`` of each parameter. A graph replays the kernels of its capture, so a call made
under other settings must not replay it (:meth:`CapturedSettings.match`, checked at every replay; the
arguments are :class:`~.signature.CallSignature`'s)."""

from __future__ import annotations

import operator
from typing import List, Optional

import torch

from .capture import guards
from .autocast import autocast_state

REQUIRES_GRAD = operator.attrgetter("requires_grad")  # C-level getters: checked at every replay
_TRAINING = operator.attrgetter("training")


class CapturedSettings:
    """Autocast (``None``: whatever is ambient), modes and ``requires_grad`` of ``module`` at capture."""

    def __init__(self, module: torch.nn.Module, autocast: Optional[tuple]) -> None:
        self.module = module
        self.autocast = autocast
        self.params = list(module.parameters())
        self._submodules = list(module.modules())
        self._modes = tuple(map(_TRAINING, self._submodules))
        self._grads_needed = tuple(map(REQUIRES_GRAD, self.params))

    def autocast_matches(self) -> bool:
        """The autocast settings in force now are the captured ones (a block whose autocast is switched on or
        off later must not replay)."""
        return self.autocast is None or autocast_state() == self.autocast

    def modes_match(self) -> bool:
        """Every submodule is in its captured train/eval mode (a dropout switched to eval alone would still
        drop). The layer itself in eval mode never reaches a training graph (:mod:`.eval_graphs`)."""
        return tuple(map(_TRAINING, self._submodules)) == self._modes

    def params_match(self) -> bool:
        """Every parameter requires grad as at capture (a layer frozen by ``toggle_optimizer`` must not replay
        a graph captured trainable, nor the other way round)."""
        return tuple(map(REQUIRES_GRAD, self.params)) == self._grads_needed

    def match(self) -> bool:
        return self.autocast_matches() and self.modes_match() and self.params_match()

    def mismatches(self, autocast: bool = True) -> List[str]:
        """How the autocast settings (unless ``autocast=False``), modes and ``requires_grad`` differ now."""
        out = []
        if autocast and not self.autocast_matches():
            out.append(f"autocast: captured {guards.describe_autocast(self.autocast)}, "
                       f"got {guards.describe_autocast(autocast_state())}")
        if not self.modes_match():
            changed = [name or "(the layer)" for (name, m), was in zip(self.module.named_modules(), self._modes)
                       if m.training != was]
            out.append(f"train/eval mode changed since capture for submodule(s) {changed}")
        if not self.params_match():
            changed = [name for (name, p), was in zip(self.module.named_parameters(), self._grads_needed)
                       if p.requires_grad != was]
            out.append(f"requires_grad changed since capture for parameter(s) {changed} (toggle_optimizer or "
                       "freezing)")
        return out
