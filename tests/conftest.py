import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m cuda` on the GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def deterministic():
    """Deterministic kernels for bit-exact GPU comparisons (``CUBLAS_WORKSPACE_CONFIG`` declared)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.fixture
def fresh_accelerate_state(monkeypatch):
    """A single-process world: no process group or launcher variables left by earlier in-process tests
    (Lightning's in-process "ddp" runs keep their gloo group), and Accelerate's singletons reset."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState

    from tests.helpers import DIST_VARS

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for var in DIST_VARS:
        monkeypatch.delenv(var, raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
