"""Models nobody here wrote, with real CUDA graphs, against Lightning's ``"ddp"`` on the same seed and batches.

transformers Llama, GPT-2, BERT (masked LM), T5 and torchvision's resnet18, random weights from tiny configs; the
Llama's layers compiled by Inductor (``graphs.compile``, or by the user) against the same compiled layers.
Deterministic kernels (``torch.use_deterministic_algorithms``, ``CUBLAS_WORKSPACE_CONFIG``, eager attention):
weights equal bit for bit. Each case prints one line: graphed calls, segments, loss and weight difference to ``"ddp"`` and
``"ddp"``'s own run-to-run spread. Run on the GPU machine: ``pytest -m cuda -s tests/test_cuda_models.py``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import cg_strategy, make_trainer, state_rel_diff
from tests.recorders import GradRecorder, LossRecorder

pytestmark = pytest.mark.cuda

STEPS = 8


def _fit_tokens(strategy, build, precision, recorder=GradRecorder, **module_kwargs):
    from tests.hf_models import fit_hf

    rec = recorder()
    module, trainer = fit_hf(strategy, build, steps=STEPS, callbacks=[rec],
                             trainer_kwargs=dict(accelerator="gpu", precision=precision), **module_kwargs)
    return module, rec, trainer


class ResNetModule(LightningModule):
    def __init__(self):
        super().__init__()
        import torchvision

        self.model = torchvision.models.resnet18(num_classes=10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _fit_resnet(strategy, precision):
    seed_everything(0, workers=True)
    module = ResNetModule()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g))
    rec = GradRecorder()
    trainer = make_trainer(strategy, STEPS, [rec], accelerator="gpu", precision=precision)
    trainer.fit(module, DataLoader(data, batch_size=8))
    return module, rec, trainer


def _compare(name, fit, precision, tolerance=0.0):
    """``fit`` under "ddp" twice (its spread) and under per-layer graphs; losses and weights against "ddp"."""
    ref, ref_rec, _ = fit("ddp", precision)
    again, again_rec, _ = fit("ddp", precision)
    strategy = cg_strategy("cuda", whole_step=False)
    got, rec, _ = fit(strategy, precision)
    stats = strategy.last_graph_stats
    spread = state_rel_diff(again.state_dict(), ref.state_dict())
    weights = state_rel_diff(got.state_dict(), ref.state_dict())
    losses = max(abs(a - b) for a, b in zip(rec.losses, ref_rec.losses))
    print(f"{name} {precision}: graphed calls {stats.captured_runners}, segments {stats.segments}, replays "
          f"{stats.forward_replays}, loss diff {losses:.3g}, weight diff {weights:.3g}, ddp spread {spread:.3g}")
    assert stats.backend == "cuda" and stats.captured_runners > 0 and stats.forward_replays > 0, stats
    assert stats.failed_layers == [], stats
    assert weights <= max(tolerance, spread), (weights, spread)
    if tolerance == 0.0 and spread == 0.0:
        for (key, a), b in zip(got.state_dict().items(), ref.state_dict().values()):
            assert torch.equal(a, b), key


@pytest.mark.parametrize("model, precision", [("llama", "32-true"), ("llama", "bf16-mixed"), ("gpt2", "32-true"),
                                              ("bert", "32-true"), ("t5", "32-true")])
def test_cuda_transformers_models_equal_ddp(deterministic, model, precision):
    hf = pytest.importorskip("tests.hf_models")
    build = {
        "llama": lambda: hf.tiny_llama(attn_implementation="eager"),
        "gpt2": lambda: hf.tiny_gpt2(attn_implementation="eager"),
        "bert": lambda: hf.tiny_bert(attn_implementation="eager"),
        "t5": hf.tiny_t5,
    }[model]
    _compare(model, lambda strategy, p: _fit_tokens(strategy, build, p), precision)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_cuda_resnet18_equal_ddp(deterministic, precision):
    pytest.importorskip("torchvision")
    _compare("resnet18", _fit_resnet, precision)


class KernelCount(Callback):
    """Profiles the device kernels of one training step (``at``: its batch index) and counts Inductor's
    (named ``triton_*``) among them."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.kernels = self.triton = 0
        self._prof = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            torch.cuda.synchronize()
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self._prof.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.at:
            torch.cuda.synchronize()
            self._prof.__exit__(None, None, None)
            names = [e.name for e in self._prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            self.kernels, self.triton = len(names), sum("triton" in n for n in names)


def _compiled_layers(model):
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=False)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_cuda_compiled_layers_equal_the_same_compiled_layers_under_ddp(deterministic, precision):
    """graphs.compile (Inductor's kernels captured in the layer graphs), and layers the user compiled under the
    strategy, against the same compiled layers under ``"ddp"``: compiling changes the rounding, so the compiled
    model under ``"ddp"`` is the reference. A replayed step launches Inductor's kernels."""
    hf = pytest.importorskip("tests.hf_models")

    def build():
        return hf.tiny_llama(attn_implementation="eager")

    def fit(strategy, prepare=None, probe=None):
        torch._dynamo.reset()
        rec = GradRecorder()
        module, trainer = hf.fit_hf(strategy, build, steps=STEPS, callbacks=[rec] + ([probe] if probe else []),
                                    prepare=prepare, trainer_kwargs=dict(accelerator="gpu", precision=precision))
        return module, rec

    ref_probe = KernelCount(at=STEPS - 2)
    ref, ref_rec = fit("ddp", _compiled_layers, ref_probe)
    again, _ = fit("ddp", _compiled_layers)
    spread = state_rel_diff(again.state_dict(), ref.state_dict())
    for what, strategy, prepare in [("graphs.compile", cg_strategy("cuda", compile=True), None),
                                    ("user-compiled", cg_strategy("cuda"), _compiled_layers)]:
        probe = KernelCount(at=STEPS - 2)
        got, rec = fit(strategy, prepare, probe)
        stats = strategy.last_graph_stats
        weights = state_rel_diff(got.state_dict(), ref.state_dict())
        losses = max(abs(a - b) for a, b in zip(rec.losses, ref_rec.losses))
        print(f"llama {what} {precision}: graphed calls {stats.captured_runners}, segments {stats.segments}, "
              f"compile {stats.compile_seconds:.1f} s, capture {stats.capture_seconds:.2f} s, replayed step "
              f"{probe.kernels} kernels ({probe.triton} Inductor), ddp step {ref_probe.kernels} ({ref_probe.triton}), "
              f"loss diff {losses:.3g}, weight diff {weights:.3g}, ddp spread {spread:.3g}")
        assert stats.backend == "cuda" and stats.captured_runners == 3 and stats.forward_replays > 0, stats
        assert probe.triton > 0, "the replayed graphs launch no Inductor kernel: the compiled forward was not captured"
        assert weights <= spread, (what, weights, spread)
        if spread == 0.0:
            for (key, a), b in zip(got.state_dict().items(), ref.state_dict().values()):
                assert torch.equal(a, b), (what, key)


def _fit_parity(strategy, precision):
    from tests.lightning_models import ParityModel

    seed_everything(0, workers=True)
    module = ParityModel(body="modulelist", optimizer="adam", scheduler="step")
    rec = GradRecorder()
    trainer = make_trainer(strategy, STEPS, [rec], accelerator="gpu", precision=precision)
    trainer.fit(module)
    return module, rec, trainer


class HostReadModule(LightningModule):
    """A Lightning-style model whose ``training_step`` reads the loss on the host (``.item()``) every step."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.seen.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit_host_read(strategy, precision):
    seed_everything(0, workers=True)
    module = HostReadModule()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    rec = GradRecorder()
    trainer = make_trainer(strategy, STEPS, [rec], accelerator="gpu", precision=precision)
    trainer.fit(module, DataLoader(data, batch_size=8))
    return module, rec, trainer


def _compare_whole_step(name, fit, precision, graphs=None, expect_replays=True):
    """``fit`` under "ddp" twice (its spread) and under the strategy with ``graphs`` (``whole_step`` true unless
    given); the step graph's counts, losses and weights against "ddp"."""
    ref, ref_rec, _ = fit("ddp", precision)
    again, _, _ = fit("ddp", precision)
    strategy = cg_strategy("cuda", **{"whole_step": True, **(graphs or {})})
    got, rec, _ = fit(strategy, precision)
    stats = strategy.last_step_graph_stats
    spread = state_rel_diff(again.state_dict(), ref.state_dict())
    weights = state_rel_diff(got.state_dict(), ref.state_dict())
    losses = max(abs(a - b) for a, b in zip(rec.losses, ref_rec.losses))
    print(f"{name} {precision} whole step: captures {stats.captures}, replays {stats.replays}, capture "
          f"{stats.capture_seconds:.2f} s, loss diff {losses:.3g}, weight diff {weights:.3g}, ddp spread {spread:.3g}")
    if expect_replays:
        assert stats.captures == 1 and stats.replays == STEPS - 3, stats  # warmup 2 steps, capture at the third
    else:
        assert stats.replays == 0, stats
    assert weights <= spread, (weights, spread)
    if spread == 0.0:
        for (key, a), b in zip(got.state_dict().items(), ref.state_dict().values()):
            assert torch.equal(a, b), key
    return strategy, got


# transformers treats a capturing stream like a compiler (utils.import_utils.is_tracing): its mask code then skips its
# data-dependent checks and builds an explicit causal mask, which bf16 rounds differently from the eager step's
# is_causal=True with grouped-query attention. The capture tells such code no stream captures and answers its host
# reads of constants from the eager run (graphs.capture_reads), so "llama" in bf16 takes the eager path and is
# bit-exact; "llama-capture-path" runs both sides on the capture path (transformers told it traces in every step).


@contextlib.contextmanager
def _transformers_capture_path():
    """transformers' mask code as it runs while a stream captures, in eager steps too."""
    import transformers.masking_utils as masking

    before = masking.is_tracing
    masking.is_tracing = lambda tensor=None: True
    try:
        yield
    finally:
        masking.is_tracing = before


@pytest.mark.parametrize("model, precision", [
    ("llama", "32-true"), ("llama", "bf16-mixed"), ("llama-mha", "bf16-mixed"),
    ("llama-capture-path", "bf16-mixed"),
    ("gpt2", "32-true"), ("gpt2", "bf16-mixed"), ("resnet18", "32-true"), ("resnet18", "bf16-mixed"),
    ("parity", "32-true"), ("parity", "bf16-mixed")])
def test_cuda_whole_step_equals_ddp(deterministic, model, precision):
    """graphs.whole_step: forward, loss, backward and gradient sync replayed from one graph per step, the optimizer
    step eager; weights bit-equal to ``"ddp"`` (resnet18: batch-norm buffers updated by the replays; the parity
    model: logs in training_step and a step scheduler; llama-mha: without grouped-query attention; llama-capture-path:
    transformers' capture-time mask code in every step)."""
    if model == "resnet18":
        pytest.importorskip("torchvision")
        fit = _fit_resnet
    elif model == "parity":
        fit = _fit_parity
    else:  # SDPA (transformers' default) on its math kernel, deterministic; "eager" attention cannot be captured whole
        from torch.nn.attention import SDPBackend, sdpa_kernel

        hf = pytest.importorskip("tests.hf_models")
        build = {"llama": lambda: hf.tiny_llama(attn_implementation="sdpa"),
                 "llama-capture-path": lambda: hf.tiny_llama(attn_implementation="sdpa"),
                 "llama-mha": lambda: hf.tiny_llama(attn_implementation="sdpa", num_key_value_heads=4),
                 "gpt2": lambda: hf.tiny_gpt2(attn_implementation="sdpa")}[model]

        path = _transformers_capture_path if model == "llama-capture-path" else contextlib.nullcontext

        def fit(strategy, p):
            with sdpa_kernel(SDPBackend.MATH), path():
                return _fit_tokens(strategy, build, p)
    _compare_whole_step(model, fit, precision)


def test_cuda_whole_step_of_transformers_eager_attention_falls_back_naming_the_library_line(deterministic):
    """transformers' "eager" attention builds its mask with ``torch.tensor(0.0, device=...)``, a copy from host memory
    that a capture refuses: one warning names that line, per-layer graphs take over, weights equal ``"ddp"``."""
    hf = pytest.importorskip("tests.hf_models")

    def fit(strategy, p):
        return _fit_tokens(strategy, lambda: hf.tiny_llama(attn_implementation="eager"), p)

    with pytest.warns(UserWarning, match=r"whole_step.*pinned.*masking_utils\.py"):
        _compare_whole_step("llama eager attention", fit, "32-true", expect_replays=False)


def test_cuda_whole_step_host_read_falls_back_to_eager_with_the_line_named(deterministic):
    """A ``.item()`` in training_step cannot be replayed: the capture is refused with the user's line, nothing of it
    is kept, and the run goes on with per-layer graphs (the two Linear layers), equal to ``"ddp"``."""
    with pytest.warns(UserWarning, match=r"whole_step.*HostSyncError.*test_cuda_models\.py"):
        strategy, got = _compare_whole_step("host-read", _fit_host_read, "32-true", expect_replays=False)
    assert strategy.last_step_graph_stats.captures == 0
    # each capture attempt's eager run (on the capture stream) read it once more: the eager path, then the capture path
    assert len(got.seen) == STEPS + 2


def test_cuda_whole_step_compiled_model_equals_the_same_compiled_model_under_ddp(deterministic):
    """graphs.whole_step with the whole model compiled by Inductor (graphs.layers=["model"], graphs.compile) against
    the same compiled model under ``"ddp"``; a replayed step launches Inductor's kernels."""
    hf = pytest.importorskip("tests.hf_models")

    def build():
        return hf.tiny_llama(attn_implementation="eager")

    def compiled_model(model):
        model.forward = torch.compile(model.forward, dynamic=False)

    def fit(strategy, prepare=None, probe=None):
        torch._dynamo.reset()
        rec = GradRecorder()
        module, _ = hf.fit_hf(strategy, build, steps=STEPS, callbacks=[rec] + ([probe] if probe else []),
                              prepare=prepare, trainer_kwargs=dict(accelerator="gpu", precision="32-true"))
        return module, rec

    ref, ref_rec = fit("ddp", compiled_model)
    again, _ = fit("ddp", compiled_model)
    spread = state_rel_diff(again.state_dict(), ref.state_dict())
    strategy = cg_strategy("cuda", whole_step=True, compile=True, layers=["model"])
    probe = KernelCount(at=STEPS - 2)
    got, rec = fit(strategy, None, probe)
    stats = strategy.last_step_graph_stats
    weights = state_rel_diff(got.state_dict(), ref.state_dict())
    losses = max(abs(a - b) for a, b in zip(rec.losses, ref_rec.losses))
    print(f"llama whole step + compile: replays {stats.replays}, replayed step {probe.kernels} kernels "
          f"({probe.triton} Inductor), loss diff {losses:.3g}, weight diff {weights:.3g}, ddp spread {spread:.3g}")
    assert stats.captures == 1 and stats.replays == STEPS - 3, stats
    assert probe.triton > 0
    assert weights <= spread, (weights, spread)


def _sdpa_fit(model, **kwargs):
    """``fit(strategy, precision)`` of a transformers model on SDPA's math kernel (deterministic): ``"llama"``,
    ``"gpt2"``, ``"llama-user-compiled"`` (``torch.compile`` of the Llama, as a LightningModule would) or
    ``"llama-module-compiled"`` (``trainer.fit(torch.compile(module))``); ``kwargs`` go to :func:`_fit_tokens`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hf = pytest.importorskip("tests.hf_models")
    build = {"llama": lambda: hf.tiny_llama(attn_implementation="sdpa"),
             "gpt2": lambda: hf.tiny_gpt2(attn_implementation="sdpa"),
             "llama-user-compiled": lambda: torch.compile(hf.tiny_llama(attn_implementation="sdpa")),
             "llama-module-compiled": lambda: hf.tiny_llama(attn_implementation="sdpa")}[model]
    if model == "llama-module-compiled":
        kwargs = {"compile_module": True, **kwargs}

    def fit(strategy, p):
        torch._dynamo.reset()
        with sdpa_kernel(SDPBackend.MATH):
            return _fit_tokens(strategy, build, p, **kwargs)

    return fit


@pytest.mark.parametrize("model", ["llama", "gpt2", "llama-user-compiled", "llama-module-compiled"])
def test_cuda_defaults_replay_the_whole_step_and_equal_ddp(deterministic, model):
    """No graph options: a transformers model's step is replayed from one graph, bit-equal to "ddp" in bf16-mixed;
    a model the LightningModule compiled itself (``self.model = torch.compile(model)``), or a LightningModule
    compiled before ``Trainer.fit``, equals the same compiled model under "ddp", its step launching Inductor's
    kernels from the graph."""
    strategy, _ = _compare_whole_step(model + " defaults", _sdpa_fit(model), "bf16-mixed", graphs={"whole_step": None})
    assert strategy.last_step_graph_stats.refusal is None


@pytest.mark.parametrize("model", ["llama", "gpt2", "llama-user-compiled"])
def test_cuda_whole_iteration_with_the_optimizer_update_equals_ddp(deterministic, model):
    """``graphs.capture_optimizer`` and no other option, fused AdamW, bf16-mixed: forward, backward, gradient sync
    and the optimizer's update replayed as one graph from the capture step on (Lightning's ``optimizer.step()`` only
    marks the step), weights bit-equal to "ddp"."""
    fit = _sdpa_fit(model, recorder=LossRecorder, fused=True)
    strategy, _ = _compare_whole_step(model + " iteration", fit, "bf16-mixed",
                                      graphs={"whole_step": None, "capture_optimizer": True})
    stats = strategy.last_step_graph_stats
    print(f"{model} iteration: updates in the step graph {stats.updates}")
    assert stats.refusal is None and stats.update_refusal is None and stats.updates == STEPS - 2, stats
    assert strategy.last_optimizer_replays == stats.updates


@pytest.mark.parametrize("model", ["mixtral-router-loss", "qwen2-moe"])
def test_cuda_moe_models_with_no_options_are_graphed_and_equal_ddp(deterministic, model):
    """No options: Mixtral with its router's auxiliary loss and Qwen2-MoE with its default experts. Whatever the
    defaults choose (the whole step, or per-layer graphs with the decoder layers split), something is replayed from
    graphs and the weights equal "ddp" within its own spread (0 with deterministic kernels)."""
    hf = pytest.importorskip("tests.hf_models")
    build = {"mixtral-router-loss": hf.tiny_mixtral, "qwen2-moe": hf.tiny_qwen2_moe}[model]
    ref, _, _ = _fit_tokens("ddp", build, "32-true")
    again, _, _ = _fit_tokens("ddp", build, "32-true")
    strategy = cg_strategy("cuda")
    got, _, _ = _fit_tokens(strategy, build, "32-true")
    step, layers = strategy.last_step_graph_stats, strategy.last_graph_stats
    spread = state_rel_diff(again.state_dict(), ref.state_dict())
    weights = state_rel_diff(got.state_dict(), ref.state_dict())
    print(f"{model} defaults: step replays {step.replays} (refusal: {step.refusal}), layer replays "
          f"{layers.forward_replays if layers else 0}, split {layers.split_layers if layers else []}, graphed parts "
          f"{len(layers.graphed_parts) if layers else 0}, weight diff {weights:.3g}, ddp spread {spread:.3g}")
    assert step.replays > 0 or (layers is not None and layers.forward_replays > 0)
    assert weights <= spread, (weights, spread)
