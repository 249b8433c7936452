"""The settings a graphed call was captured under, besides its arguments: autocast, and the state of its module
that Python changes without a kernel (structure, train/eval modes, ``requires_grad``, scalar attributes:
:mod:`.module_state`). A graph replays the kernels of its capture, so a call made under other settings must not
replay it (:meth:`CapturedSettings.match`, checked at every replay; the arguments are
:class:`~.signature.CallSignature`'s)."""

from __future__ import annotations

from typing import List, Optional

import torch

from .capture import guards
from .autocast import autocast_state
from .module_state import REQUIRES_GRAD, ModuleState

__all__ = ["CapturedSettings", "REQUIRES_GRAD"]


class CapturedSettings:
    """Autocast (``None``: whatever is ambient) and the :class:`~.module_state.ModuleState` of ``module`` at capture
    (its attributes recorded again by :meth:`snapshot_attributes` once the capture is done)."""

    def __init__(self, module: torch.nn.Module, autocast: Optional[tuple]) -> None:
        self.module = module
        self.autocast = autocast
        self.state = ModuleState(module)
        self.params = self.state.params

    def snapshot_attributes(self) -> None:
        self.state.snapshot_attributes()

    def autocast_matches(self) -> bool:
        """The autocast settings in force now are the captured ones (a block whose autocast is switched on or
        off later must not replay)."""
        return self.autocast is None or autocast_state() == self.autocast

    def modes_match(self) -> bool:
        """Every submodule is in its captured train/eval mode and holds the captured submodules and attributes. The
        layer itself in eval mode never reaches a training graph (:mod:`.eval_graphs`)."""
        state = self.state
        return state.structure_matches() and state.modes_match() and state.attributes_match()

    def params_match(self) -> bool:
        """Every parameter requires grad as at capture (a layer frozen by ``toggle_optimizer`` must not replay
        a graph captured trainable, nor the other way round)."""
        return self.state.params_match()

    def match(self) -> bool:
        return self.autocast_matches() and self.state.match()

    def mismatches(self, autocast: bool = True) -> List[str]:
        """How the autocast settings (unless ``autocast=False``) and the module's state differ now."""
        out = []
        if autocast and not self.autocast_matches():
            out.append(f"autocast: captured {guards.describe_autocast(self.autocast)}, "
                       f"got {guards.describe_autocast(autocast_state())}")
        return out + self.state.changes()
