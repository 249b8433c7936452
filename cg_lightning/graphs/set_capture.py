"""Capturing the recorded calls of one step as a graph set, dropping layers whose capture fails.

All calls are captured together by :func:`~.capture.capture_in_order` (forwards in order, backwards in
reverse, one pool). When one runner raises :class:`GraphCaptureError` and the policy is ``"eager"``, its
layer is reported through ``on_failed`` and every remaining call is captured again from scratch: the
failed attempt's runners are dropped and ``capture_in_order`` has restored the training state, so nothing
of it survives. With ``"raise"`` the error propagates, naming the layer.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch.nn as nn

from .capture import capture_in_order
from .graph_sets import CallRecord
from .guards import GraphCaptureError
from .runner import LayerGraphRunner


def capture_calls(
    calls: Sequence[CallRecord],
    make_runner: Callable[[CallRecord], LayerGraphRunner],
    model: nn.Module,
    on_capture_error: str,
    on_failed: Callable[[object, GraphCaptureError], None],
    segments_of: Optional[Callable[[List[CallRecord]], List[List[int]]]] = None,
) -> Tuple[List[CallRecord], List[LayerGraphRunner]]:
    """Capture ``calls``; returns the calls captured and their runners (both empty if all failed).
    ``segments_of(calls)``: the runs of calls to capture as segments (recomputed after a failed layer is
    dropped)."""
    calls = list(calls)
    while calls:
        runners = [make_runner(c) for c in calls]
        blamed: List[LayerGraphRunner] = []
        try:
            capture_in_order(runners, model, [c.layer.module for c in calls],
                             segments=segments_of(calls) if segments_of is not None else None,
                             on_failure=blamed.append)
            return calls, runners
        except GraphCaptureError as exc:
            if not blamed:
                raise
            layer = calls[runners.index(blamed[0])].layer
            if on_capture_error != "eager":
                if layer.name not in str(exc):
                    raise GraphCaptureError(f"layer {layer.name!r}: {exc}") from exc
                raise
            on_failed(layer, exc)
            calls = [c for c in calls if c.layer is not layer]
    return [], []

