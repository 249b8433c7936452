"""transformers models keep a key/value cache by default (``config.use_cache=True``). In training every forward
then hands each decoder layer a new cache object, which no captured call can match: nothing would replay. As
transformers itself does under gradient checkpointing, graphed training turns that default off
(:func:`training_without_cache`); a call that passes ``use_cache=True`` itself (``generate``) keeps its cache.
Nothing is imported: a model of transformers means the library is loaded already."""

from __future__ import annotations

import sys
import warnings
from typing import List

import torch.nn as nn


def training_without_cache(model: nn.Module) -> List[str]:
    """Set ``config.use_cache = False`` on the transformers models inside ``model`` that have it on, with one
    warning naming them. Returns their qualified names (empty when none, or transformers is not loaded)."""
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    if pretrained is None:
        return []
    changed, seen = [], set()
    for name, module in model.named_modules():
        config = module.config if isinstance(module, pretrained) else None
        if config is None or id(config) in seen or getattr(config, "use_cache", None) is not True:
            continue
        seen.add(id(config))
        config.use_cache = False
        changed.append(name or type(module).__name__)
    if changed:
        warnings.warn(
            f"cg_lightning: set config.use_cache=False on {', '.join(changed)}: with the cache on, every training "
            "forward hands the graphed layers a new cache object, which no graph can replay (transformers does "
            "the same under gradient checkpointing). Calls that pass use_cache=True themselves, such as "
            "generate(), keep their cache.",
            UserWarning,
            stacklevel=3,
        )
    return changed
