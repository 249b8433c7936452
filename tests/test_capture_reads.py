"""``graphs.step.capture_reads``: host reads of constants kept in the eager run and answered in the capture run.

On a CPU nothing captures, so the capture run here is the answer mode alone: it must hand back the eager run's
values for reads of tensors made from constants only, refuse reads of anything else (the batch, weights, random
draws, a constant changed in place by one of those) naming the line, and notice a run that reads differently.
"""

from __future__ import annotations

import pytest
import torch

from cg_lightning.graphs.step.capture_reads import (ReadsDiverged, answer_reads, capture_seen_by_code,
                                               eager_path_under_capture, record_reads)
from cg_lightning.graphs.errors import HostSyncError


def _constant_reads(x: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(x.shape[-1]).expand(x.shape[0], -1)
    packed = (torch.diff(pos, dim=-1) != 1).cumsum(-1)
    if (packed[:, -1] == 0).all():  # transformers' packed-sequence check, on positions made from a shape
        x = x * 2
    n = int(torch.tensor(3) + 1)  # a literal
    return x * n + torch.zeros(2).tolist()[0]


def test_reads_of_constants_are_kept_then_answered_with_the_same_values():
    x = torch.randn(2, 5)
    with record_reads() as rec:
        want = _constant_reads(x)
    assert [name for name, _ in rec.reads] == ["_local_scalar_dense", "_local_scalar_dense"]
    with answer_reads(rec) as answered:
        got = _constant_reads(x)
    assert torch.equal(got, want) and answered.unanswered() == 0


@pytest.mark.parametrize("step, line", [
    (lambda x: x * 2 if x.sum() > 0 else x, "x.sum() > 0"),  # the batch
    (lambda x: x * float(torch.rand(())), "torch.rand"),  # a random draw
    (lambda x: x + torch.zeros(3).add_(x[0, :3]).sum().item(), "add_(x[0, :3])"),  # a constant changed by the batch
    (lambda x: x + len(x[0].tolist()), "tolist()"),  # a CPU tensor's data handed to Python
])
def test_reads_of_what_depends_on_the_batch_or_random_draws_are_refused_naming_the_line(step, line):
    x = torch.randn(2, 5)
    with record_reads() as rec:
        step(x)
    with pytest.raises(HostSyncError, match="depends on the batch or the weights") as info:
        with answer_reads(rec):
            step(x)
    assert line in str(info.value), info.value


def test_a_capture_run_that_reads_differently_from_the_eager_run_is_refused():
    x = torch.randn(2, 5)
    with record_reads() as rec:
        _constant_reads(x)
    with pytest.raises(ReadsDiverged, match="fewer host reads"):
        with answer_reads(rec):
            x * 2
    with record_reads() as rec:
        x * 2
    with pytest.raises(ReadsDiverged, match="not in its eager run"):
        with answer_reads(rec):
            _constant_reads(x)


def test_outside_code_is_told_the_path_of_an_eager_step_and_torch_the_truth(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from transformers.utils.import_utils import is_tracing

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # as while a stream captures
    asks_from_torch = eval("lambda: torch.cuda.is_current_stream_capturing()", {"__name__": "torch.cuda.graphs",
                                                                                "torch": torch})
    assert is_tracing()
    with eager_path_under_capture():
        assert not is_tracing() and not torch.cuda.is_current_stream_capturing()
        assert asks_from_torch()
    assert is_tracing()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with capture_seen_by_code():
        assert is_tracing() and not asks_from_torch()
    assert not is_tracing()
