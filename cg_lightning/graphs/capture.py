"""Capturing a set of runners that replay in a fixed order, without changing any training state."""

from __future__ import annotations

import contextlib
from typing import List, Sequence

import torch
import torch.nn as nn

from .buffer_reuse import (
    release_param_grad_outputs,
    share_grad_outputs_with_next_grad_inputs,
    share_inputs_with_previous_outputs,
)


def capture_in_order(
    runners: Sequence,
    model: nn.Module,
    layers: List[nn.Module],
    restore_grads: bool = True,
    reuse_buffers: bool = False,
) -> None:
    """Warm up every runner, capture the forwards in order and the backwards in reverse order.

    That is the order in which they replay, so one shared memory pool is safe. ``main_grad``,
    ``param.grad`` (unless ``restore_grads`` is false), the layers' buffers and RNG states are restored
    afterwards, and autocast's weight-cast cache is off throughout. ``reuse_buffers``: the runners form a
    chain and share static buffers (:mod:`cg_lightning.graphs.buffer_reuse`).
    """
    with _preserved_training_state(model, layers, restore_grads), _uncached_autocast():
        for runner in runners:
            with runner.backend.warmup_stream():
                runner.warmup()
        for i, runner in enumerate(runners):
            if reuse_buffers and i > 0:
                share_inputs_with_previous_outputs(runners[i - 1], runner)
            runner.capture_forward()
        for i in reversed(range(len(runners))):
            runner = runners[i]
            if reuse_buffers and i + 1 < len(runners):
                share_grad_outputs_with_next_grad_inputs(runner, runners[i + 1])
            runner.capture_backward()
            if reuse_buffers:
                release_param_grad_outputs(runner)


@contextlib.contextmanager
def _uncached_autocast():
    """Keep the surrounding autocast (dtype, enabled) but with its weight-cast cache off.

    A cached cast made before capture would be baked into the graph and never see updated weights;
    capture must not depend on how a Lightning version configures the cache.
    """
    device_types = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    stack = contextlib.ExitStack()
    with stack:
        for dt in device_types:
            if torch.is_autocast_enabled(dt):
                torch.clear_autocast_cache()
                stack.enter_context(
                    torch.autocast(dt, dtype=torch.get_autocast_dtype(dt), enabled=True, cache_enabled=False)
                )
        yield


@contextlib.contextmanager
def _preserved_training_state(model: nn.Module, layers: List[nn.Module], restore_grads: bool = True):
    """Restore ``main_grad``, ``param.grad``, layer buffers and RNG states after warmup and capture."""
    params = list(model.parameters())
    main_grads = [p.main_grad.clone() if hasattr(p, "main_grad") else None for p in params]
    grads = [p.grad for p in params]
    buffers = []
    for layer in layers:
        buffers.extend(b for b in layer.buffers())
    buffer_copies = [b.clone() for b in buffers]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for p, mg, g in zip(params, main_grads, grads):
                if mg is not None:
                    p.main_grad.copy_(mg)
                if restore_grads:
                    p.grad = g
            for b, c in zip(buffers, buffer_copies):
                b.copy_(c)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
