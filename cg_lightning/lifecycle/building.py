"""Building the pieces of a training lifecycle: graphs on the model's layers, the data-parallel engine around it,
and a :class:`~.driver.TrainingDriver` over both. One function per feature, applied to the model in turn."""

from __future__ import annotations

import warnings
from typing import Any, Optional, Type

import torch
import torch.nn as nn

from ..ddp import DataParallelEngine, DDPOptions
from ..graphs import GraphManager, GraphOptions
from ..graphs.backends import make_backend
from ..graphs.module_state import watch_registrations
from ..graphs.selection import default_layers, no_default_layers_message
from .driver import TrainingDriver
from .hf_cache import training_without_cache


def apply_graphs(
    model: nn.Module,
    options: GraphOptions,
    device: torch.device,
    *,
    accumulate_into_main_grad: bool = True,
    whole_step: bool = False,
) -> Optional[GraphManager]:
    """Install a :class:`~cg_lightning.graphs.GraphManager` on ``model``'s selected layers.

    Args:
        model: the module whose layers (``options.layers``) get graphed; their ``forward`` is replaced until
            the manager's ``remove``.
        options: :class:`~cg_lightning.graphs.GraphOptions`.
        device: the training device (picks the backend for ``backend="auto"``).
        accumulate_into_main_grad: captured backwards add weight gradients into ``param.main_grad`` (the
            data-parallel engine's buffer); ``False`` for eval-only graphs without an engine.
        whole_step: a graph of the whole step may stand in for the layers: a model without layers to graph is
            not warned about here (the front-end warns if the whole step is refused).

    A transformers model's ``config.use_cache`` is turned off for training (:mod:`.hf_cache`, one warning).

    Returns:
        the manager, or ``None`` when ``options.enabled`` is false or when ``options.layers`` is unset and the
        model has no repeated layers to graph (:func:`~cg_lightning.graphs.selection.default_layers`; a
        warning then says how to choose layers).

    Raises:
        ValueError: from ``GraphManager`` when ``options.layers`` is set and matches no module.
    """
    if not options.enabled:
        return None
    watch_registrations()  # before anything runs compiled: installing the hooks at a capture would recompile
    if options.layers is None and not default_layers(model):
        if not whole_step:  # a graph of the whole step needs no layers
            warnings.warn(no_default_layers_message(model), UserWarning, stacklevel=2)
        return None
    if accumulate_into_main_grad:  # training
        training_without_cache(model)
    return GraphManager(model, options, device, accumulate_into_main_grad=accumulate_into_main_grad)


def capture_stream(graph_manager) -> Optional["torch.cuda.Stream"]:
    """The stream the manager (or a backend) captures on (CUDA backend), or ``None``. The engine creates the
    parameters' gradient accumulators on it: a captured backward that feeds an accumulator bound to another stream
    fails."""
    if graph_manager is None:
        return None
    return getattr(getattr(graph_manager, "backend", graph_manager), "stream", None)


def apply_data_parallel(
    model: nn.Module,
    options: Optional[DDPOptions] = None,
    *,
    graph_manager: Optional[GraphManager] = None,
    process_group: Any = None,
    engine_type: Type[DataParallelEngine] = DataParallelEngine,
) -> DataParallelEngine:
    """Wrap ``model`` in a :class:`~cg_lightning.ddp.DataParallelEngine`.

    Args:
        model: the module, already on its device (and with ``graph_manager`` installed, if any).
        options: :class:`~cg_lightning.ddp.DDPOptions` (``None``: the defaults).
        graph_manager: the manager from :func:`apply_graphs` (or the backend of the whole-step graphs), whose
            capture stream the engine's gradient accumulators must be bound to.
        process_group: the group to reduce over (default: the world, when initialized).
        engine_type: :class:`~cg_lightning.ddp.DataParallelEngine` or a subclass taking its arguments.

    Returns:
        the engine (call it as the model).
    """
    return engine_type(model, options, process_group=process_group,
                       grad_accumulator_stream=capture_stream(graph_manager))


def build_driver(
    model: nn.Module,
    graphs: GraphOptions,
    ddp: Optional[DDPOptions],
    device: torch.device,
    *,
    process_group: Any = None,
    engine_type: Type[DataParallelEngine] = DataParallelEngine,
    whole_step: bool = False,
) -> TrainingDriver:
    """:func:`apply_graphs`, then :func:`apply_data_parallel`, then a :class:`TrainingDriver` over both. With
    ``whole_step`` (the front-end may capture the whole step: ``graphs.whole_step`` true, or unset under a front-end
    that decides per model) the driver's ``step_backend`` is the manager's backend (a backend of its own when no
    layer is graphed), the one whole-step graphs capture with."""
    whole_step = whole_step and graphs.enabled
    manager = apply_graphs(model, graphs, device, whole_step=whole_step)
    step_backend = None
    if whole_step:
        step_backend = manager.backend if manager is not None else make_backend(graphs.backend, device)
    engine = apply_data_parallel(model, ddp, graph_manager=manager or step_backend, process_group=process_group,
                                 engine_type=engine_type)
    driver = TrainingDriver(graphs, manager, engine)
    driver.step_backend = step_backend
    return driver
