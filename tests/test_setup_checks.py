"""The strategy refuses options it cannot honour before the first step, for every entry point (here the Python API;
the command line: tests/test_cli_errors.py): ``graphs.layers`` matching nothing, ``graphs.backend: cuda`` off a GPU,
``graphs.shape_policy: error`` with a smaller last batch that training reaches (CPU, one process, fast)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

import tests.helpers_config as helpers
from cg_lightning.errors import ConfigError
from cg_lightning.graphs import GraphSignatureError
from cg_lightning.trainer.setup_checks import partial_last_batch
from tests.helpers import cg_strategy, make_trainer


@pytest.fixture
def steps_run(monkeypatch):
    """The training steps TinyRegressor ran, in order of batch index."""
    ran = []
    original = helpers.TinyRegressor.training_step

    def counting(self, batch, batch_idx):
        ran.append(batch_idx)
        return original(self, batch, batch_idx)

    monkeypatch.setattr(helpers.TinyRegressor, "training_step", counting)
    return ran


def _fit(strategy, steps: int = 2, n: int = 16):
    trainer = make_trainer(strategy, steps)
    trainer.fit(helpers.TinyRegressor(in_features=3), datamodule=helpers.TinyData(in_features=3, n=n))
    return trainer


def test_layers_matching_nothing_refused_before_the_first_step(steps_run):
    with pytest.raises(ConfigError) as info:
        _fit(cg_strategy(layers=["nope.*"]))
    assert str(info.value).startswith("graphs.layers: ['nope.*'] matched no module; some module names: ['net', ")
    assert steps_run == []


def test_layers_checked_for_validate_too():
    trainer = make_trainer(cg_strategy(layers=["nope.*"]), 1, limit_val_batches=1)
    with pytest.raises(ConfigError, match="graphs.layers"):
        trainer.validate(helpers.TinyRegressor(in_features=3), datamodule=helpers.TinyData(in_features=3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_backend_off_a_gpu_refused(steps_run):
    with pytest.raises(ConfigError, match=r"^graphs\.backend: 'cuda' needs a CUDA device but the strategy runs on "
                                          r"'cpu'"):
        _fit(cg_strategy("cuda", layers=["net.0"]))
    assert steps_run == []
    _fit(cg_strategy("cuda", layers=["net.0"], enabled=False))  # no graphs: nothing to refuse


def test_shape_policy_error_with_a_smaller_last_batch_refused(steps_run):
    with pytest.raises(ConfigError) as info:
        _fit(cg_strategy(layers=["net.0"], shape_policy="error", warmup_steps=1), steps=6, n=18)
    message = str(info.value)
    assert message.startswith("graphs.shape_policy: 'error' cannot work with this training data: on process 0 each "
                              "epoch ends, after 4 full batches of 4, with a batch of 2")
    assert "drop_last=True in the training DataLoader" in message  # TinyData takes no drop_last argument
    assert steps_run == []


@pytest.mark.parametrize("steps, n", [(6, 16), (4, 18)], ids=["divisible", "stops-before-the-smaller-batch"])
def test_shape_policy_error_accepted_when_it_can_work(steps, n):
    trainer = _fit(cg_strategy(layers=["net.0"], shape_policy="error", warmup_steps=1), steps=steps, n=n)
    assert trainer.global_step == steps


def test_shape_policy_conflict_is_real(monkeypatch):
    """Without the check the smaller last batch fails in the middle of training."""
    import cg_lightning.trainer.strategy as strategy_module

    monkeypatch.setattr(strategy_module, "check_train_data", lambda strategy, trainer: None)
    trainer = make_trainer(cg_strategy(layers=["net.0"], shape_policy="error", warmup_steps=1), 6)
    with pytest.raises(GraphSignatureError):
        trainer.fit(helpers.TinyRegressor(in_features=3), datamodule=helpers.TinyData(in_features=3, n=18))
    assert trainer.global_step == 4  # the four full batches trained, the fifth (2 samples) failed


def test_partial_last_batch():
    data = TensorDataset(torch.arange(18.0))
    assert partial_last_batch(DataLoader(data, batch_size=4)) == (4, 4, 2)
    assert partial_last_batch(DataLoader(data, batch_size=4, drop_last=True)) is None
    assert partial_last_batch(DataLoader(data, batch_size=6)) is None
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=False)  # 9 samples per process
    assert partial_last_batch(DataLoader(data, batch_size=4, sampler=sampler)) == (2, 4, 1)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(5))

    assert partial_last_batch(DataLoader(Stream(), batch_size=2)) is None  # cannot be told: not checked
