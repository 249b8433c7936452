"""What every peer of the step-time benchmark shares: sizes, settings, data, optimizer, timing, cleanup.

Every peer trains the same model (``benchmarks.models``: the example GPT or a ``transformers`` Llama) with the
same sizes, the same random-token batches (fixed seed), bf16
autocast over fp32 weights, and AdamW (``fused=True`` on a GPU) with the same parameter groups. Each peer is
timed the same way: ``warmup`` steps, then ``repeats`` windows of ``steps`` steps, with a device
synchronization at each window boundary only, so the CPU may run ahead inside a window as in real training.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cg_lightning import torch_compat

Batch = Tuple[Tensor, Tensor]

# Model sizes: d_model, layers, heads, sequence length T (= block_size), batch size B.
SIZES: Dict[str, Dict[str, int]] = {
    "tiny": dict(d_model=256, n_layer=12, n_head=4, block_size=128, batch_size=8),
    "small": dict(d_model=768, n_layer=12, n_head=12, block_size=512, batch_size=8),
    "compute": dict(d_model=2048, n_layer=8, n_head=16, block_size=1024, batch_size=8),
}
# ``--smoke``: the tiny size shrunk until a CPU runs a step in well under a second.
SMOKE_SIZE_NAME = "tiny_smoke"
SMOKE_SIZE: Dict[str, int] = dict(d_model=32, n_layer=2, n_head=2, block_size=16, batch_size=2)

VOCAB_SIZE = 50304  # GPT-2's 50257 rounded up to a multiple of 128; cg_lightning.examples.gpt.GPT takes any vocab_size
SMOKE_VOCAB_SIZE = 512


@dataclass(frozen=True)
class RunSettings:
    """One (size, device) measurement setting, shared by all peers of that size."""

    device: torch.device
    size_name: str
    size: Dict[str, int]
    vocab_size: int = VOCAB_SIZE
    warmup: int = 10
    steps: int = 30
    repeats: int = 5
    seed: int = 0
    lr: float = 3e-4
    betas: Tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    cg_warmup_steps: int = 2
    data_batches: int = 8
    model: str = "gpt"  #: ``benchmarks.models.MODELS``

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps * self.repeats

    def gpt_kwargs(self) -> Dict[str, Any]:
        """Arguments of ``cg_lightning.examples.gpt.GPT`` (and of ``GPTLightningModule``) for this size."""
        s = self.size
        return dict(
            vocab_size=self.vocab_size, block_size=s["block_size"], n_layer=s["n_layer"], n_head=s["n_head"],
            d_model=s["d_model"], dropout=0.0, bias=True, tie_weights=False,
        )


@dataclass
class PeerResult:
    """What one peer measured; the runner adds status, ratios and peak memory."""

    ms_per_step: List[float]  # one entry per repeat: mean ms/step of that window
    warmup_s: float  # wall time of the warmup steps (includes capture/compile where it happens there)
    capture_s: Optional[float] = None  # graph capture or compile time, seconds
    capture_what: Optional[str] = None  # what capture_s measures
    final_loss: Optional[float] = None  # loss of the last step (sanity: every peer trains the same problem)
    extra: Dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- data


def make_batches(s: RunSettings) -> List[Batch]:
    """``data_batches`` distinct ``(x, y)`` pairs of random token ids on the CPU, fixed seed.

    ``y`` is ``x`` shifted left by one token, as in ``cg_lightning.examples.data``. On a GPU run the tensors are
    pinned, so every peer's host-to-device copy (``non_blocking=True``, as Lightning does) is asynchronous.
    """
    B, T = s.size["batch_size"], s.size["block_size"]
    gen = torch.Generator().manual_seed(s.seed)
    tokens = torch.randint(0, s.vocab_size, (s.data_batches, B, T + 1), generator=gen, dtype=torch.long)
    batches = []
    for t in tokens:
        x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
        if s.is_cuda:
            x, y = x.pin_memory(), y.pin_memory()
        batches.append((x, y))
    return batches


class BatchDataset(torch.utils.data.Dataset):
    """Map-style dataset whose items are whole batches (load it with ``batch_size=None``): item ``i`` is
    ``batches[i % len(batches)]``, the same sequence the plain loops use."""

    def __init__(self, batches: Sequence[Batch], length: int) -> None:
        self.batches = list(batches)
        self.length = int(length)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Batch:
        return self.batches[i % len(self.batches)]


# ----------------------------------------------------------------------------- model, optimizer, loss


def build_model(s: RunSettings) -> nn.Module:
    """``s.model`` (``benchmarks.models``) for this size, initialised from ``s.seed``, in train mode on
    ``s.device``."""
    from benchmarks.models import build

    torch.manual_seed(s.seed)
    return build(s.model, s.size, s.vocab_size).to(s.device).train()


def make_optimizer(
    named_params: Iterator[Tuple[str, nn.Parameter]],
    s: RunSettings,
    *,
    capturable: bool = False,
) -> torch.optim.Optimizer:
    """AdamW with the example's groups (decay on ``ndim >= 2``), ``fused=True`` on a GPU."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": s.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kwargs: Dict[str, Any] = dict(lr=s.lr, betas=s.betas)
    if s.is_cuda:
        kwargs["fused"] = True
    if capturable:
        kwargs["capturable"] = True
    return torch.optim.AdamW(groups, **kwargs)


def optimizer_description(s: RunSettings) -> str:
    fused = "fused=True" if s.is_cuda else "fused=False (CPU)"
    return (
        f"torch.optim.AdamW({fused}, lr={s.lr}, betas={s.betas}, weight_decay={s.weight_decay} on ndim>=2 "
        "params, 0 on the rest); whole_step_graph adds capturable=True"
    )


def autocast(s: RunSettings, cache_enabled: bool = True):
    """bf16 autocast on the run's device (the weights stay fp32): what Lightning's ``bf16-mixed`` does."""
    return torch.autocast(device_type=s.device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled)


def lm_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Mean next-token cross-entropy, as ``GPTLightningModule._loss``."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def make_train_step(
    model: Callable[[Tensor], Tensor],
    optimizer: torch.optim.Optimizer,
    s: RunSettings,
    *,
    cache_enabled: bool = True,
    before_step: Optional[Callable[[], None]] = None,
) -> Callable[[Batch], Tensor]:
    """One eager training step of a plain loop: copy the batch, forward and loss under autocast, backward,
    optimizer step, ``zero_grad(set_to_none=True)``. Returns the detached loss (no host sync)."""
    device = s.device

    def step(batch: Batch) -> Tensor:
        x, y = batch
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        if before_step is not None:
            before_step()
        with autocast(s, cache_enabled=cache_enabled):
            loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


# ----------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class LoopTiming:
    ms_per_step: List[float]
    warmup_s: float
    warmup_step_s: List[float]
    last_loss: Optional[Tensor]


def time_loop(step: Callable[[Batch], Optional[Tensor]], batches: Sequence[Batch], s: RunSettings) -> LoopTiming:
    """Run ``s.warmup`` steps (each synchronized and timed), then ``s.repeats`` windows of ``s.steps`` steps
    with a synchronization only at the window boundaries. Step ``i`` uses ``batches[i % len(batches)]``."""
    i = 0
    loss = None
    warmup_step_s = []
    sync(s.device)
    start = time.perf_counter()
    for _ in range(s.warmup):
        t0 = time.perf_counter()
        loss = step(batches[i % len(batches)])
        sync(s.device)
        warmup_step_s.append(time.perf_counter() - t0)
        i += 1
    warmup_s = time.perf_counter() - start
    ms = []
    for _ in range(s.repeats):
        sync(s.device)
        t0 = time.perf_counter()
        for _ in range(s.steps):
            loss = step(batches[i % len(batches)])
            i += 1
        sync(s.device)
        ms.append(1000.0 * (time.perf_counter() - t0) / s.steps)
    return LoopTiming(ms, warmup_s, warmup_step_s, loss)


def excess_warmup_s(warmup_step_s: Sequence[float], ms_per_step: Sequence[float]) -> float:
    """Time the warmup steps took beyond as many steady steps: compile/record time "until steady"."""
    steady = statistics.median(ms_per_step) / 1000.0
    return max(0.0, sum(warmup_step_s) - steady * len(warmup_step_s))


def loss_value(loss: Optional[Tensor]) -> Optional[float]:
    return None if loss is None else float(loss.detach().float().cpu())


# ----------------------------------------------------------------------------- process group, memory


#: Rendezvous and collective timeout of every peer's process group: a stalled peer becomes an error row
#: instead of blocking the run for torch's default 30 minutes.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=300)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def single_process_group(device: torch.device):
    """A world-size-1 process group on a free localhost port (NCCL on a GPU, gloo on the CPU), destroyed on
    exit. An existing default group (left by an earlier peer) is destroyed first."""
    import torch.distributed as dist

    destroy_process_group()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=PROCESS_GROUP_TIMEOUT)
    try:
        yield
    finally:
        destroy_process_group()


def free_memory(device: torch.device) -> int:
    """Collect garbage, drop the cuBLAS workspaces earlier peers' streams left and return cached device memory
    (between peers), so that each peer's peak holds only what it allocated itself. Returns the bytes the
    workspaces held (0 on a CPU)."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device)
    torch_compat.clear_cublas_workspaces()
    freed = held - torch.cuda.memory_allocated(device)
    torch.cuda.empty_cache()
    return freed


def mib(n_bytes: float) -> float:
    return n_bytes / 2**20
