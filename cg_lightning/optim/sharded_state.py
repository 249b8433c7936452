"""The distributed optimizer's state in checkpoints: one shard per rank, loadable at any world size.

A shard (what ``optimizer.state_dict()`` returns under ``ddp.distributed_optimizer``) looks like a torch optimizer
state dict with an empty ``"state"``, the user's ``"param_groups"`` (hyperparameters, parameter numbers) and, under
:data:`KEY`, this rank's *pieces*: ``{"param": number, "start": s, "end": e, "state": {...}, "master": t}`` for
elements ``[s, e)`` of the flattened parameter, with each per-element state tensor (``exp_avg``...) cut to those
elements, scalar states (``step``) as they are, and the fp32 master weights of low-precision parameters. Pieces name
parameters and element ranges, not ranks, so :func:`load_state` takes the shards of any world size and picks out
the ranges this rank owns now (or an ordinary full state dict, from ``"ddp"``); :func:`full_state_dict` joins the
shards into an ordinary full state dict, loadable by any optimizer of the user's class.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

import torch

#: the key under which a shard holds its pieces
KEY = "sharded_optimizer"


def is_shard(state: Any) -> bool:
    """Whether ``state`` is a shard made by :func:`shard_state_dict`."""
    return isinstance(state, dict) and KEY in state


def _groups(optimizer: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    out, n = [], 0
    for g in optimizer.param_groups:
        out.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(n, n + len(g["params"])))})
        n += len(g["params"])
    return out


def _per_element(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def shard_state_dict(sharded) -> Dict[str, Any]:
    """This rank's shard of ``sharded``'s (a :class:`~.sharded_optimizer.ShardedOptimizer`) state. Its tensors are
    views of the live state, as ``Optimizer.state_dict()``'s are."""
    number = {p: i for i, p in enumerate(sharded.params)}
    pieces = []
    for run in sharded.runs:
        state = sharded.inner.state.get(run.param, {})
        offset = 0
        for piece in run.pieces:
            n = piece.end - piece.start
            entry = {"param": number[piece.param], "start": piece.start, "end": piece.end,
                     "state": {k: v[offset : offset + n] if _per_element(v, run.numel) else v for k, v in state.items()}}
            if run.master:
                entry["master"] = run.param[offset : offset + n]
            pieces.append(entry)
            offset += n
    layout = sharded.layout
    return {"state": {}, "param_groups": _groups(sharded.optimizer),
            KEY: {"format": 1, "rank": layout.rank, "world_size": layout.world_size,
                  "shapes": [list(p.shape) for p in sharded.params], "pieces": pieces}}


def _entries_of_full(state: Dict[str, Any], params: Sequence[torch.nn.Parameter]) -> List[Dict[str, Any]]:
    """An ordinary state dict's per-parameter states as pieces covering whole parameters."""
    out = []
    for number, st in state["state"].items():
        numel = params[number].numel()
        out.append({"param": number, "start": 0, "end": numel,
                    "state": {k: v.reshape(-1) if _per_element(v, numel) else v for k, v in st.items()}})
    return out


def _take(entries: List[Dict[str, Any]], start: int, end: int, key: str, master: bool = False) -> Optional[Any]:
    """Elements ``[start, end)`` of state ``key`` (or the master weights) from ``entries`` (one parameter's pieces,
    sorted by start); a scalar state is taken from the first piece; ``None`` if the pieces lack it.

    Raises:
        ValueError: the pieces do not cover ``[start, end)``.
    """
    parts, pos = [], start
    for e in entries:
        if e["end"] <= pos or e["start"] >= end:
            continue
        if e["start"] > pos:
            break
        value = e.get("master") if master else e["state"].get(key)
        if value is None:
            return None
        if not _per_element(value, e["end"] - e["start"]):
            return value
        stop = min(end, e["end"])
        parts.append(value[pos - e["start"] : stop - e["start"]])
        pos = stop
    if pos != end:
        raise ValueError(f"the optimizer state given does not cover elements [{pos}, {end}) of a parameter: pass the "
                         "shards of every rank that saved them")
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _by_param(states: Sequence[Dict[str, Any]], params) -> Dict[int, List[Dict[str, Any]]]:
    by_param: Dict[int, List[Dict[str, Any]]] = {}
    for st in states:
        entries = st[KEY]["pieces"] if is_shard(st) else _entries_of_full(st, params)
        for e in entries:
            by_param.setdefault(e["param"], []).append(e)
    for entries in by_param.values():
        entries.sort(key=lambda e: e["start"])
    return by_param


def load_state(sharded, state: Any) -> None:
    """Load ``state`` into ``sharded``: a shard, a list of shards (of any world size; every saved rank's, or at
    least those covering this rank's ranges), or an ordinary full state dict of the user's optimizer. The param
    groups' hyperparameters go to the user's optimizer; master weights missing from ``state`` are taken from the
    parameters.

    Raises:
        ValueError: the param groups do not match the optimizer's, or the pieces do not cover this rank's ranges.
    """
    states = list(state) if isinstance(state, (list, tuple)) else [state]
    saved_groups = states[0]["param_groups"]
    groups = sharded.optimizer.param_groups
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in groups]:
        raise ValueError("loaded optimizer state has param groups of other sizes than the optimizer's "
                         f"({[len(g['params']) for g in saved_groups]} against {[len(g['params']) for g in groups]})")
    for group, saved in zip(groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    by_param = _by_param(states, sharded.params)
    number = {p: i for i, p in enumerate(sharded.params)}
    inner = sharded.inner
    if inner is None:
        return
    index = {p: i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
    inner_state: Dict[int, Dict[str, Any]] = {}
    with torch.no_grad():
        for run in sharded.runs:
            lists = [by_param.get(number[piece.param], []) for piece in run.pieces]
            keys = {k for entries in lists for e in entries for k in e["state"]}
            values = {}
            for key in sorted(keys):
                parts = [_take(entries, piece.start, piece.end, key) for piece, entries in zip(run.pieces, lists)]
                if any(p is None for p in parts):
                    raise ValueError(f"optimizer state {key!r} is missing for part of a parameter")
                value = torch.cat(parts) if _per_element(parts[0], run.pieces[0].end - run.pieces[0].start) \
                    else parts[0]
                # a copy: the pieces may be views of another optimizer's live state (torch's load keeps tensors
                # that already have the right dtype and device)
                values[key] = value.clone() if isinstance(value, torch.Tensor) else value
            if values:
                inner_state[index[run.param]] = values
            if run.master:
                masters = [_take(entries, piece.start, piece.end, "", master=True)
                           for piece, entries in zip(run.pieces, lists)]
                run.param.copy_(torch.cat(masters) if all(m is not None for m in masters) else run.param_view)
    inner.load_state_dict({"state": inner_state,
                           "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                             "params": [index[p] for p in g["params"]]} for g in inner.param_groups]})


def full_state_dict(shards: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Every rank's shard joined into an ordinary full optimizer state dict (state tensors in the parameters' shapes;
    master weights dropped), loadable by the user's optimizer under any strategy.

    Raises:
        ValueError: ``shards`` do not cover every parameter's state.
    """
    shapes = shards[0][KEY]["shapes"]
    by_param = _by_param(shards, None)
    state: Dict[int, Dict[str, Any]] = {}
    for number, entries in sorted(by_param.items()):
        shape = shapes[number]
        numel = math.prod(shape)
        st = {}
        for key in entries[0]["state"]:
            value = _take(entries, 0, numel, key)
            st[key] = value.reshape(shape).clone() if _per_element(value, numel) else value
        state[number] = st
    return {"state": state, "param_groups": shards[0]["param_groups"]}
