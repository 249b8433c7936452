"""The lifecycle driver (:mod:`cg_lightning.lifecycle`) on plain PyTorch, without Lightning or Accelerate.

A hand-written loop calls the driver's events around an ordinary forward, ``loss.backward()`` and
``optimizer.step()``; the reference is the same loop without the driver (eager layers, ``param.grad``
accumulated by autograd). Same seed, same data, CPU, the eager graph backend: every loss and every final weight
is bit-identical (``torch.equal``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cg_lightning.ddp import DDPOptions
from cg_lightning.graphs import GraphOptions
from cg_lightning.lifecycle import (
    CaptureSummary,
    TrainingDriver,
    apply_data_parallel,
    apply_graphs,
    build_driver,
)
from cg_lightning.lifecycle.summary import compact_names
from tests.helpers import ROOT, WARMUP

STEPS = 7


class _Net(nn.Module):
    """An input layer, three residual MLP blocks (the graphed layers) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _data(steps: int, accumulate: int):
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)) for _ in range(accumulate)]
            for _ in range(steps)]


def _optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    return torch.optim.Adam(params, lr=1e-2)


def _eager(data, kind: str, halve_between: bool):
    """The reference: plain PyTorch, ``param.grad`` accumulated by autograd over the window's micro-batches."""
    torch.manual_seed(0)
    model = _Net()
    opt = _optimizer(kind, model.parameters())
    losses = []
    for window in data:
        for i, (x, y) in enumerate(window):
            if halve_between and i > 0:
                for p in model.parameters():
                    p.grad.mul_(0.5)
            loss = F.mse_loss(model(x), y) / len(window)
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return model, losses


def _driven(data, kind: str, halve_between: bool, graphs: GraphOptions, build=build_driver):
    """The same loop through the driver's events; returns (model, losses, driver, capture summaries)."""
    torch.manual_seed(0)
    model = _Net()
    driver = build(model, graphs, DDPOptions(), torch.device("cpu"))
    engine = driver.engine
    opt = _optimizer(kind, model.parameters())
    losses, summaries = [], []
    for step, window in enumerate(data):
        for i, (x, y) in enumerate(window):
            last = i == len(window) - 1
            with contextlib.nullcontext() if last else driver.no_sync():
                if halve_between and i > 0:
                    for p in model.parameters():
                        p.grad.mul_(0.5)  # the sum so far, as after an eager backward
                driver.begin_micro_batch(step)
                loss = F.mse_loss(engine(x), y) / len(window)
                driver.end_forward()
                driver.before_backward(loss)
                loss.backward()
                driver.after_backward(completes_step=last)
                losses.append(loss.detach())
            summary = driver.capture_summary()
            if summary is not None:
                summaries.append((step, summary))
        assert all(p.grad is p.main_grad for p in model.parameters())  # what the optimizer reads
        with driver.stepping(opt):
            opt.step()
        driver.after_optimizer_step()
        opt.zero_grad()
    return model, losses, driver, summaries


def _assert_same(model, losses, ref_model, ref_losses) -> None:
    assert len(losses) == len(ref_losses)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert torch.equal(a, b), (i, a, b)
    for (name, a), b in zip(model.state_dict().items(), ref_model.state_dict().values()):
        assert torch.equal(a, b), name


def _graphs(**kw) -> GraphOptions:
    return GraphOptions(**{"warmup_steps": WARMUP, "backend": "eager", "layers": ["blocks.*"], **kw})


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw_fused"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_driven_loop_equals_eager_training(kind, accumulate):
    """Graphed blocks (warmup, capture, replay), the engine's ``main_grad``, accumulation under ``no_sync``,
    and for fused AdamW the cached fused step: losses and weights bit-identical to plain PyTorch."""
    data = _data(STEPS, accumulate)
    ref_model, ref_losses = _eager(data, kind, halve_between=False)
    model, losses, driver, summaries = _driven(data, kind, False, _graphs())
    _assert_same(model, losses, ref_model, ref_losses)
    stats = driver.graph_manager.stats
    assert stats.captured_runners == 3
    assert stats.forward_replays == 3 * accumulate * (STEPS - WARMUP)
    assert driver.completed_steps == STEPS
    assert [s for s, _ in summaries] == [WARMUP]  # captured once, in the first step after warmup
    summary = summaries[0][1]
    assert summary.layers == ("blocks.0", "blocks.1", "blocks.2") and summary.eager == ("inp", "head")
    assert str(summary).startswith("cg_lightning: captured 3 layer calls (blocks.0-2) with the eager backend in ")
    assert str(summary).endswith("; eager: inp, head")
    if kind == "adamw_fused":
        assert driver.cached_optimizer_steps == STEPS - 1  # every step after the first, which builds the lists
    else:
        assert driver.cached_optimizer_steps == 0
    driver.close()


def test_sum_so_far_edited_between_micro_batches_is_carried_back():
    """``param.grad`` halved between two micro-batches of a window (it aliases ``main_grad`` there): the next
    ``before_backward`` carries the edit into ``main_grad``, as eager autograd accumulates onto it."""
    data = _data(STEPS, 2)
    ref_model, ref_losses = _eager(data, "sgd", halve_between=True)
    model, losses, driver, _ = _driven(data, "sgd", True, _graphs())
    _assert_same(model, losses, ref_model, ref_losses)
    driver.close()


def test_graphs_disabled_and_no_cached_step():
    """``enabled=False``: no manager, the engine alone; ``cached_optimizer_step`` needs graphs (as under the
    strategy), so fused AdamW steps as usual. Still bit-identical."""
    data = _data(4, 2)
    ref_model, ref_losses = _eager(data, "adamw_fused", halve_between=False)
    model, losses, driver, summaries = _driven(data, "adamw_fused", False, _graphs(enabled=False))
    _assert_same(model, losses, ref_model, ref_losses)
    assert driver.graph_manager is None and summaries == [] and driver.cached_optimizer_steps == 0
    driver.close()
    assert driver.last_graph_stats is None


def test_captured_optimizer_step_on_the_eager_backend():
    """``capture_optimizer`` with the eager backend (which runs the step again at every "replay") and a fused AdamW:
    step 0 is torch's own (the cached lists are built after it), step 1 runs on the lists, step 2 records the step
    and every later one replays it; bit-identical; the replay count survives ``close``."""
    data = _data(STEPS, 1)
    ref_model, ref_losses = _eager(data, "adamw_fused", halve_between=False)
    model, losses, driver, _ = _driven(data, "adamw_fused", False, _graphs(capture_optimizer=True))
    _assert_same(model, losses, ref_model, ref_losses)
    assert driver.optimizer_replays == STEPS - 3
    driver.close()
    assert driver.last_optimizer_replays == STEPS - 3


def test_built_by_parts_and_closed():
    """``apply_graphs`` + ``apply_data_parallel`` + ``TrainingDriver`` equal ``build_driver``; ``close`` gives the
    model back: the blocks' own ``forward``, no engine hooks (a backward fills ``param.grad`` again), the graph
    counters kept."""

    def by_parts(model, graphs, ddp, device):
        manager = apply_graphs(model, graphs, device)
        return TrainingDriver(graphs, manager, apply_data_parallel(model, ddp, graph_manager=manager))

    data = _data(4, 1)
    ref_model, ref_losses = _eager(data, "sgd", halve_between=False)
    model, losses, driver, _ = _driven(data, "sgd", False, _graphs(), build=by_parts)
    _assert_same(model, losses, ref_model, ref_losses)
    driver.close()
    assert driver.graph_manager is None and driver.engine is None
    assert all("forward" not in block.__dict__ for block in model.blocks)
    assert driver.last_graph_stats.forward_replays == 3 * (4 - WARMUP)
    x, y = data[0][0]
    F.mse_loss(model(x), y).backward()
    assert all(p.grad is not None and p.grad is not p.main_grad for p in model.parameters())


def test_capture_summary_text():
    summary = CaptureSummary(layer_calls=4, layers=("blocks.0", "blocks.1"), backend="cuda", seconds=1.234,
                             graph_sets=2, segments=1)
    assert str(summary) == ("cg_lightning: captured 4 layer calls (blocks.0, blocks.1) with the cuda backend in "
                            "1.23 s (2 graph sets), chained into 1 segment(s)")
    one = CaptureSummary(layer_calls=2, layers=("h.0",), backend="eager", seconds=0.5, graph_sets=1, segments=0)
    assert str(one) == "cg_lightning: captured 2 layer calls (h.0) with the eager backend in 0.50 s"
    llama = CaptureSummary(layer_calls=12, layers=tuple(f"model.layers.{i}" for i in range(12)), backend="cuda",
                           seconds=2.0, graph_sets=1, segments=0, eager=("model.embed_tokens", "model.norm", "lm_head"))
    assert str(llama) == ("cg_lightning: captured 12 layer calls (model.layers.0-11) with the cuda backend in 2.00 s; "
                          "eager: model.embed_tokens, model.norm, lm_head")


def test_compact_names_collapse_runs_of_three_or_more():
    names = ["a.0", "a.1", "a.3", "a.4", "a.5", "b", "c.1", "c.2", "d.7"]
    assert compact_names(names) == "a.0, a.1, a.3-5, b, c.1, c.2, d.7"
    assert compact_names(["x.0", "x.1", "x.2", "y.3", "y.4", "y.5", "z"]) == "x.0-2, y.3-5, z"
    assert compact_names([f"p{i}" for i in range(5)], limit=3) == "p0, p1, p2, +2 more"
    assert compact_names([]) == ""


def test_summary_names_a_failed_layer_eager():
    """A layer whose capture failed runs eagerly: the summary lists it with the eager modules, not as graphed."""
    model = _Net()
    manager = apply_graphs(model, _graphs(), torch.device("cpu"))
    manager.layers[1].failure = "returns non-tensor outputs"
    summary = CaptureSummary.of(manager)
    assert summary.layers == ("blocks.0", "blocks.2") and summary.eager == ("inp", "blocks.1", "head")
    manager.remove()


def test_backward_that_misses_the_model_waits_for_the_next_one():
    """``before_backward`` reports whether a micro-batch waits for this backward; ``defer_backward`` keeps it
    waiting (a GAN generator's micro-batch when the discriminator's loss did not reach it)."""
    torch.manual_seed(0)
    model = _Net()
    driver = build_driver(model, _graphs(enabled=False), DDPOptions(), torch.device("cpu"))
    loss = driver.engine(torch.randn(2, 6)).sum()
    assert driver.before_backward(loss) is False  # no micro-batch began
    driver.begin_micro_batch()
    assert driver.micro_batch_open
    assert driver.before_backward(loss) is True and not driver.micro_batch_open
    driver.defer_backward()
    assert driver.before_backward(loss) is True
    assert driver.before_backward(loss) is False
    driver.close()


def test_lifecycle_module_imports_torch_only():
    """``cg_lightning.lifecycle`` (with ``graphs/`` and ``ddp/`` under it) loads none of Lightning, Accelerate or
    OmegaConf, checked in a fresh interpreter. The package's ``__init__`` (which registers the Lightning
    strategy) is bypassed: this is about the module and what it imports."""
    code = (
        "import importlib, sys, types\n"
        f"pkg = types.ModuleType('cg_lightning'); pkg.__path__ = [{os.path.join(ROOT, 'cg_lightning')!r}]\n"
        "sys.modules['cg_lightning'] = pkg\n"
        "importlib.import_module('cg_lightning.lifecycle')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('lightning', 'pytorch_lightning', 'lightning_fabric', 'lightning_utilities', 'accelerate', 'omegaconf'))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
