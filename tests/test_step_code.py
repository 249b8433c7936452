"""``graphs.step.step_code``: which training steps may run their Python once, at capture, and be replayed.

Each refused step names the function and what it reads; each accepted one lists the watched attributes, whose
changes :meth:`StepCodeReport.changed` reports.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch import LightningModule

from cg_lightning.graphs.step.step_code import check_step_code
from cg_lightning.trainer.whole_step import FRAMEWORK

GLOBAL_TENSOR = torch.ones(2)
GLOBAL_SCALE = 2.0
GLOBAL_LIST = [1.0]


def _mse(out, y):
    return F.mse_loss(out, y) * GLOBAL_SCALE


def _deeper(out, y):
    return _mse(out, y) + random.random()


def _takes_module(module, x):
    return module.body(x)


class Base(LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.body.history = []
        self.alpha = 0.5
        self.kwargs = {"reduction": "mean"}
        self.opts = ["a"]
        self.table = object()

    def forward(self, x):
        return self.body(x)

    def shared(self, batch):
        x, y = batch
        return _mse(self(x), y)


def _check(step, extra=None):
    cls = type("Step", (Base,), {"training_step": step, **(extra or {})})
    return check_step_code(cls(), "training_step", recorded=("log", "log_dict"), framework=FRAMEWORK)


def _ok_plain(self, batch, batch_idx):
    x, y = batch
    loss = _mse(self.body(x), y) * self.alpha
    self.log("train_loss", loss, prog_bar=True)
    return {"loss": loss, "sizes": [len(t) for t in batch]}


def _ok_helpers(self, batch, batch_idx):
    reg = sum(p.pow(2).sum() for p in self.parameters())
    return self.shared(batch) + 1e-4 * reg + F.mse_loss(self(batch[0]), batch[1], **self.kwargs)


@pytest.mark.parametrize("step, watched", [(_ok_plain, ("global GLOBAL_SCALE", "alpha")),
                                           (_ok_helpers, ("global GLOBAL_SCALE", "kwargs"))])
def test_steps_that_read_only_the_batch_modules_and_watched_values_are_accepted(step, watched):
    report = _check(step)
    assert report.refusal is None, report.refusal
    assert report.watched == watched


def _reads_batch_idx(self, batch, batch_idx):
    return None if batch_idx % 10 == 0 else self.shared(batch)


def _reads_global_step(self, batch, batch_idx):
    return self.shared(batch) * (1 if self.global_step < 100 else 0.5)


def _reads_trainer(self, batch, batch_idx):
    return self.shared(batch) / self.trainer.accumulate_grad_batches


def _reads_random(self, batch, batch_idx):
    return _deeper(self(batch[0]), batch[1])


def _prints(self, batch, batch_idx):
    print("step")
    return self.shared(batch)


def _assigns(self, batch, batch_idx):
    self.last = batch[0]
    return self.shared(batch)


def _assigns_elsewhere(self, batch, batch_idx):
    self.body.calls = 1
    return self.shared(batch)


def _hands_self(self, batch, batch_idx):
    return _takes_module(self, batch[0]).sum()


def _optimizers(self, batch, batch_idx):
    self.optimizers()
    return self.shared(batch)


def _global_tensor(self, batch, batch_idx):
    return self.shared(batch) + GLOBAL_TENSOR.sum()


def _global_list(self, batch, batch_idx):
    return self.shared(batch) * GLOBAL_LIST[0]


def _object_attribute(self, batch, batch_idx):
    return self.shared(batch) if self.table else None


def _seeds(self, batch, batch_idx):
    torch.manual_seed(0)
    return self.shared(batch)


def _counter():
    calls = 0

    def step(self, batch, batch_idx):
        nonlocal calls
        calls += 1
        return self.shared(batch)
    return step


def _submodule_state(self, batch, batch_idx):
    return self.shared(batch) * len(self.body.history)


def _mutable_default(self, batch, batch_idx, seen=[]):  # noqa: B006 - the case under test
    seen.append(1)
    return self.shared(batch)


def _counted(step):
    calls = []

    def wrapper(self, batch, batch_idx):
        calls.append(self.trainer.global_step)
        return step(self, batch, batch_idx)
    return wrapper


def _imports(self, batch, batch_idx):
    import time
    return self.shared(batch) * time.time()


@pytest.mark.parametrize("step, expect", [
    (_reads_batch_idx, "reads its argument 'batch_idx'"),
    (_reads_global_step, "reads self.global_step"),
    (_reads_trainer, "reads self.trainer"),
    (_reads_random, "_deeper reads the global 'random'"),
    (_prints, "prints"),
    (_assigns, "assigns self.last"),
    (_assigns_elsewhere, "assigns the attribute 'calls'"),
    (_hands_self, "hands self to other code"),
    (_optimizers, "calls self.optimizers()"),
    (_global_tensor, "reads the global 'GLOBAL_TENSOR', a Tensor"),
    (_global_list, "reads the global 'GLOBAL_LIST', a list"),
    (_object_attribute, "reads self.table, a object"),
    (_imports, "imports 'time'"),
    (_seeds, "calls manual_seed()"),
    (_submodule_state, "reads self.body.history, state of a submodule"),
    (_mutable_default, "has a mutable default argument"),
    (_counted(_ok_plain), "reads the closure variable 'calls', a list"),
    (_counter(), "assigns the closure variable 'calls'"),
])
def test_steps_that_read_what_changes_between_steps_are_refused_naming_it(step, expect):
    report = _check(step)
    assert report.refusal is not None and expect in report.refusal, report.refusal


def test_a_torchmetrics_metric_called_in_the_step_is_refused():
    torchmetrics = pytest.importorskip("torchmetrics")

    def step(self, batch, batch_idx):
        self.metric(self(batch[0]), batch[1])
        return self.shared(batch)

    module = type("Step", (Base,), {"training_step": step})()
    module.metric = torchmetrics.MeanSquaredError()
    report = check_step_code(module, "training_step", recorded=("log",), framework=FRAMEWORK)
    assert report.refusal is not None and "self.metric, a MeanSquaredError" in report.refusal, report.refusal


def test_class_attributes_globals_and_lists_inside_tuples_are_watched_by_value():
    global GLOBAL_SCALE

    def step(self, batch, batch_idx):
        return self.shared(batch) * self.level * len(self.pair[0])

    cls = type("Step", (Base,), {"training_step": step, "level": 1.0})
    module = cls()
    module.pair = ([1],)
    report = check_step_code(module, "training_step", framework=FRAMEWORK)
    assert report.refusal is None and set(report.watched) == {"level", "pair", "global GLOBAL_SCALE"}, report
    kept = report.values()
    module.pair[0].append(2)  # inside a tuple: the kept copy still holds [1]
    assert report.changed(kept) == "self.pair: ([1],) -> ([1, 2],)"
    module.pair[0].pop()
    cls.level = 2.0  # a class attribute changed at run time
    assert report.changed(kept) == "self.level: 1.0 -> 2.0"
    cls.level = 1.0
    old, GLOBAL_SCALE = GLOBAL_SCALE, 3.0
    try:
        assert report.changed(kept) == "global GLOBAL_SCALE: 2.0 -> 3.0"
    finally:
        GLOBAL_SCALE = old
    assert report.changed(kept) is None


def test_a_watched_value_changed_in_place_or_replaced_is_reported():
    def step(self, batch, batch_idx):
        return self.shared(batch) * self.alpha + len(self.opts)

    module = type("Step", (Base,), {"training_step": step})()
    report = check_step_code(module, "training_step", framework=FRAMEWORK)
    assert report.refusal is None and report.watched == ("global GLOBAL_SCALE", "alpha", "opts")
    kept = report.values()
    assert report.changed(kept) is None
    module.opts.append("b")  # in place: the kept copy still holds the old list
    assert report.changed(kept) == "self.opts: ['a'] -> ['a', 'b']"
    module.opts = ["a"]
    module.alpha = 0.25
    assert report.changed(kept) == "self.alpha: 0.5 -> 0.25"


def test_a_step_method_that_is_not_python_is_refused():
    class Compiled(Base):
        training_step = torch.nn.Identity()

    report = check_step_code(Compiled(), "training_step", framework=FRAMEWORK)
    assert report.refusal is not None and "not a Python function" in report.refusal
