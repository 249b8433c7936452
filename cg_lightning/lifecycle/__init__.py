"""One training lifecycle for every front-end: per-layer graphs, the data-parallel engine, the optimizer step.

The Lightning strategy, the Accelerate integration and a hand-written PyTorch loop all drive the same
objects through the same events; this package holds them, so each front-end only maps its own hooks onto
them. Torch only: it imports :mod:`cg_lightning.graphs`, :mod:`cg_lightning.ddp` and :mod:`cg_lightning.optim`,
never Lightning, Accelerate or OmegaConf.

Building: one function per feature, applied to the model in turn (graphs on its layers, then the engine
around it), and a driver over what they return::

    manager = apply_graphs(model, GraphOptions(warmup_steps=2), device)   # None when graphs are off
    engine = apply_data_parallel(model, DDPOptions(), graph_manager=manager)
    driver = TrainingDriver(GraphOptions(...), manager, engine)            # or: build_driver(model, ...)

A loop over optimizer steps, each made of one or more micro-batches (all but the last under ``no_sync``)::

    for step, window in enumerate(windows):
        for i, batch in enumerate(window):
            last = i == len(window) - 1
            with contextlib.nullcontext() if last else driver.no_sync():
                driver.begin_micro_batch(step)
                loss = loss_fn(engine(batch))
                driver.end_forward()
                driver.before_backward(loss)
                loss.backward()
                driver.after_backward(completes_step=last)
            summary = driver.capture_summary()
            if summary is not None:
                print(summary)
        with driver.stepping(optimizer):
            optimizer.step()
        driver.after_optimizer_step()
        optimizer.zero_grad()
    driver.close()

The events and what they guarantee:

* :meth:`~TrainingDriver.begin_micro_batch`: the graphed layers' calls from here on belong to one
  micro-batch (call indices, the warmup / capture / replay schedule keyed by the optimizer step).
* :meth:`~TrainingDriver.end_forward`: that micro-batch makes no further layer calls.
* :meth:`~TrainingDriver.before_backward`: right before autograd, after everything that reads or edits the
  sum so far in ``param.grad`` (clipping, scaling, ``zero_grad``): that sum goes back into ``main_grad`` and
  ``param.grad`` is dropped; the graph manager looks at the loss's autograd graph.
* :meth:`~TrainingDriver.after_backward`: right after autograd, before anything reads the gradients: the
  buckets' all-reduce is waited for (unless under :meth:`~TrainingDriver.no_sync`) and ``param.grad`` points at
  ``main_grad``.
* :meth:`~TrainingDriver.stepping`: inside, ``optimizer.step()`` is the captured step graph
  (``graphs.capture_optimizer``) or the cached fused Adam step (``graphs.cached_optimizer_step``) where they
  apply, else the optimizer's own.
* :meth:`~TrainingDriver.after_optimizer_step`: closes a micro-batch a forward opened after the backward and
  (unless told otherwise) zeroes ``main_grad``.
* :meth:`~TrainingDriver.wait_for_params`: every parameter holds its updated value (under
  ``ddp.overlap_param_gather`` the all-gathers after a sharded step are otherwise waited for by the next forward,
  bucket by bucket, by ``state_dict()`` and by the next backward or step: :mod:`cg_lightning.ddp.param_gather`).
* :meth:`~TrainingDriver.capture_summary`: what was captured since the last call, as a value to print.
* :meth:`~TrainingDriver.close`: graphs removed, the optimizers as the user built them, the engine's hooks
  gone; the counters stay readable (``last_graph_stats``, ``last_optimizer_replays``, ...).

For loops the user writes (Accelerate, Fabric), :class:`GraphedDataParallel` (:mod:`.loop_engine`) is the engine
that raises these events from the loop's own calls: the model's forward, the front end's backward, the optimizer
step and ``zero_grad``.

Modules: :mod:`.building` (the functions that build the pieces), :mod:`.driver` (:class:`TrainingDriver`, the
events), :mod:`.loop_engine` (:class:`GraphedDataParallel`), :mod:`.optimizer_steps` (what runs as ``optimizer.step()`` inside :meth:`~TrainingDriver.stepping`),
:mod:`.summary` (:class:`CaptureSummary`).
"""

from .building import apply_data_parallel, apply_graphs, build_driver, capture_stream
from .driver import TrainingDriver
from .loop_engine import GraphedDataParallel, loop_backward
from .summary import CaptureSummary

__all__ = [
    "CaptureSummary",
    "GraphedDataParallel",
    "TrainingDriver",
    "apply_data_parallel",
    "apply_graphs",
    "build_driver",
    "capture_stream",
    "loop_backward",
]
