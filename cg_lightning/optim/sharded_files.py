"""Checkpoint files of ``ddp.distributed_optimizer``: every rank's optimizer shard in a folder beside the checkpoint.

Every rank's ``optimizer.state_dict()`` is its own shard (:mod:`.sharded_state`). The checkpoint file is written as
usual by rank 0 with a small descriptor in place of each shard, and every rank writes its shards to
``<path>.optim/rank<r>-of-<N>.pt``. Two layouts of the checkpoint are served: Lightning's Trainer keeps optimizer
states in the list ``checkpoint["optimizer_states"]``; Lightning Fabric keeps each under the name the script gave it
(``{"model": ..., "optimizer": ..., "step": ...}``). Loading reads the shard of this rank when the world size is the
one saved, and every rank's shard otherwise (the state is then cut to the ranges each rank owns now: any world
size); without the distributed optimizer the shards are joined into an ordinary full state
(:func:`~.sharded_state.full_state_dict`). :func:`consolidate` does that offline.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List

import torch

from .sharded_state import full_state_dict, is_shard

#: the descriptor key that stands for an optimizer's state in the checkpoint file
FILES_KEY = "sharded_optimizer_files"
_LISTED = "optimizer_states"  # Lightning Trainer's list of optimizer states (also the shard file's key for them)
_NAMED = "named_states"  # the shard file's key for the states a checkpoint keeps by name (Fabric)


def shard_dir(filepath: str) -> str:
    """The folder beside the checkpoint file ``filepath`` that holds the ranks' optimizer shards."""
    return f"{filepath}.optim"


def shard_file(filepath: str, rank: int, world_size: int) -> str:
    return os.path.join(shard_dir(filepath), f"rank{rank}-of-{world_size}.pt")


def _is_descriptor(state: Any) -> bool:
    return isinstance(state, dict) and FILES_KEY in state


def save_shards(checkpoint: Dict[str, Any], filepath: str, rank: int, world_size: int,
                save: Callable[[Dict[str, Any], str], None]) -> Dict[str, Any]:
    """Write this rank's optimizer shards (those in ``checkpoint["optimizer_states"]`` and the top-level values that
    are shards) with ``save(obj, path)``; return ``checkpoint`` with descriptors in their place (unchanged when it
    holds no shard)."""
    listed = checkpoint.get(_LISTED) if isinstance(checkpoint.get(_LISTED), list) else []
    named = {k: v for k, v in checkpoint.items() if is_shard(v)}
    if not named and not any(is_shard(s) for s in listed):
        return checkpoint
    if "://" not in str(filepath):  # a local path (a remote one is left to the saver)
        os.makedirs(shard_dir(str(filepath)), exist_ok=True)
    content: Dict[str, Any] = {_NAMED: named}
    if any(is_shard(s) for s in listed):
        content[_LISTED] = listed
    save(content, shard_file(str(filepath), rank, world_size))
    files = {"world_size": world_size, "folder": os.path.basename(shard_dir(str(filepath)))}
    out = {**checkpoint, **{k: {FILES_KEY: {**files, "name": k}} for k in named}}
    if _LISTED in content:
        out[_LISTED] = [{FILES_KEY: dict(files)} if is_shard(s) else s for s in listed]
    return out


def load_shards(checkpoint: Dict[str, Any], filepath: str, rank: int, world_size: int, sharded: bool,
                load: Callable[[str], Dict[str, Any]]) -> Dict[str, Any]:
    """``checkpoint`` (read from ``filepath``) with each descriptor replaced by optimizer state read with
    ``load(path)``: the saved shard of this rank (``sharded`` and the same world size), the list of every saved
    rank's shard (``sharded``, another world size), or their join into a full state (not ``sharded``).

    Raises:
        FileNotFoundError: a shard file is missing (copy the ``.optim`` folder with the checkpoint file).
    """
    listed = checkpoint.get(_LISTED) if isinstance(checkpoint.get(_LISTED), list) else []
    named = [k for k, v in checkpoint.items() if _is_descriptor(v)]
    descriptors = [s[FILES_KEY] for s in listed if _is_descriptor(s)] + [checkpoint[k][FILES_KEY] for k in named]
    if not descriptors:
        return checkpoint
    saved = descriptors[0]["world_size"]
    folder = os.path.join(os.path.dirname(str(filepath)), descriptors[0]["folder"])
    ranks = [rank] if sharded and saved == world_size else range(saved)
    files: List[Dict[str, Any]] = []
    for r in ranks:
        path = os.path.join(folder, f"rank{r}-of-{saved}.pt")
        if not os.path.exists(path):
            raise FileNotFoundError(f"cg_lightning: the optimizer shard {path} of checkpoint {filepath} is missing: a "
                                    "checkpoint saved with ddp.distributed_optimizer keeps every rank's optimizer "
                                    "state in the '.optim' folder beside it")
        files.append(load(path))

    def resolve(pick: Callable[[Dict[str, Any]], Any]) -> Any:
        if not sharded:
            return full_state_dict([pick(f) for f in files])
        return pick(files[0]) if len(files) == 1 and saved == world_size else [pick(f) for f in files]

    out = {**checkpoint, **{k: resolve(lambda f, n=checkpoint[k][FILES_KEY]["name"]: f[_NAMED][n]) for k in named}}
    if any(_is_descriptor(s) for s in listed):
        out[_LISTED] = [resolve(lambda f, i=i: f[_LISTED][i]) if _is_descriptor(s) else s for i, s in enumerate(listed)]
    return out


def consolidate(filepath: str) -> Dict[str, Any]:
    """The checkpoint at ``filepath`` (a Lightning Trainer's or Fabric's) with every rank's optimizer shards joined
    into ordinary full optimizer states: save it with ``torch.save`` to resume without ``ddp.distributed_optimizer``
    (CPU, offline)."""
    checkpoint = torch.load(filepath, map_location="cpu", weights_only=False)
    return load_shards(checkpoint, filepath, 0, 1, False,
                       lambda path: torch.load(path, map_location="cpu", weights_only=False))


def remove_shards(filepath: str, rank: int, world_size: int, remove: Callable[[str], None]) -> None:
    """Remove this rank's shard of the checkpoint ``filepath`` (and the folder, once empty) if there is one."""
    path = shard_file(str(filepath), rank, world_size)
    if os.path.exists(path):
        remove(path)
    try:
        os.rmdir(shard_dir(str(filepath)))
    except OSError:  # other ranks' shards still there, or no folder
        pass
