"""The eager path under capture: host reads of values that no batch can change, answered from the eager run.

Libraries skip data-dependent checks while a stream captures and take another path instead: transformers' mask
code asks ``torch.cuda.is_current_stream_capturing()`` (through its ``is_tracing``) and then builds an explicit
causal mask where an eager step hands SDPA ``is_causal=True``. A captured step would then compute something else
than the eager one: equal in fp32, rounded differently in bf16. What those checks read, though, is often made from
constants and shapes alone (``torch.arange`` position ids), so its value is the same at every step of one batch
signature and may be read once, before capture, and frozen.

:func:`record_reads` and :func:`answer_reads` do that around the two runs of a step that a capture makes:

1. the *eager run* (before capture, same inputs) runs under :class:`ConstantReads` in ``record`` mode: every
   operation's outputs are marked *constant* when all its tensor inputs are constant and it draws no random
   numbers (factories such as ``arange``, ``zeros`` and literals start the chains; the batch, parameters, buffers
   and anything made before the run are not constant), and the value of each host read of a constant tensor
   (``.item()``, ``bool(t)``, a copy to the host) is kept, in order;
2. the *capture run* runs under :class:`ConstantReads` in ``answer`` mode, with code outside torch and this package
   told that no stream captures (:func:`eager_path_under_capture`): it takes its eager path, and each host read of a
   constant tensor is answered with the kept value, without touching the device. A host read of any other tensor
   depends on the batch or the weights and is refused (:class:`~..capture.host_sync.HostSyncError`, naming the source line);
   a read that does not match the kept sequence is refused as well (:class:`ReadsDiverged`).

A constant's value depends on nothing a replay changes, so the frozen answer is the one an eager step would get:
provably, not by sampling. The rule that marks values constant is taint tracking, as dynamo's specialization on
constants and Inductor's constant folding reason about values known before the run.

Dispatch modes stop dynamo from running compiled code, so the caller uses neither mode for compiled models (under
compilation those libraries take their traced path in the eager reference too).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from ...torch_compat import TO_COPY, TorchDispatchMode, tree_flatten
from ..errors import HostSyncError
from ..capture.host_sync import SYNC_OPS, _user_frame

_aten = torch.ops.aten
#: host reads of a scalar: answered with a Python number
_SCALAR_READS = {op for op in (getattr(_aten, n, None) for n in ("_local_scalar_dense", "is_nonzero", "equal"))
                 if op is not None}
_SCALAR_READS = {op.default for op in _SCALAR_READS}
#: ops whose result starts a constant chain though their input was made before the run (a Python literal)
_LITERALS = {op.default for op in (getattr(_aten, n, None) for n in ("lift_fresh", "lift_fresh_copy")) if op is not None}
#: copies that move data to the host
_COPIES = {TO_COPY, _aten.copy_.default}
#: Tensor methods that hand a tensor's data to Python without a scalar read the dispatcher sees (a CPU tensor)
_PY_READS = {torch.Tensor.tolist: ".tolist()", torch.Tensor.numpy: ".numpy()", torch.Tensor.__repr__: "printing a tensor",
             torch.Tensor.__str__: "printing a tensor", torch.Tensor.__format__: "formatting a tensor into a string"}


class ReadsDiverged(RuntimeError):
    """The capture run read the host in another order than the eager run: the step's Python took another path."""


def _storage_key(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):  # sparse, nested, meta without storage
        return None


def _written(func) -> List[int]:
    """Positions of the arguments ``func`` writes to (its schema's ``Tensor(a!)``)."""
    return [i for i, arg in enumerate(func._schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write]


def _is_host_copy(func, args: tuple, kwargs: dict) -> bool:
    if func is TO_COPY:
        src, device = args[0], kwargs.get("device")
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and device is not None \
            and torch.device(device).type == "cpu"
    if func is _aten.copy_.default:
        dst, src = args[0], args[1]
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu"
    return False


class ConstantReads(TorchDispatchMode):
    """Marks tensors made from constants only and records or answers their host reads (module docstring).

    Args:
        answers: ``None`` to record (the eager run); the :attr:`reads` of a recording run to answer them (the
            capture run).

    Attributes:
        reads: ``(operation name, value)`` of each host read of a constant tensor, in order (recording).
    """

    def __init__(self, answers: Optional[List[Tuple[str, Any]]] = None) -> None:
        super().__init__()
        self.answering = answers is not None
        self.answers = list(answers or [])
        self.reads: List[Tuple[str, Any]] = []
        self._constant: dict = {}  # storage key -> storage, kept alive so that a key is never reused in the run

    # ------------------------------------------------------------------ constants
    def is_constant(self, t: torch.Tensor) -> bool:
        key = _storage_key(t)
        return key is not None and key in self._constant

    def _mark(self, tensors, constant: bool) -> None:
        for t in tensors:
            key = _storage_key(t)
            if key is None:
                continue
            if constant:
                self._constant[key] = t.untyped_storage()
            else:
                self._constant.pop(key, None)

    # ------------------------------------------------------------------ reads
    def _refuse(self, what: str) -> HostSyncError:
        where = _user_frame()
        return HostSyncError(f"host synchronization {what} on a value that depends on the batch or the weights"
                             + (f" at {where}" if where else ""))

    def _answer(self, name: str) -> Any:
        if not self.answers:
            raise ReadsDiverged(f"the step read the host ({name}) while it was captured but not in its eager run: "
                                "its Python took another path under capture")
        want, value = self.answers.pop(0)
        if want != name:
            raise ReadsDiverged(f"the step read the host with {name} while it was captured where its eager run read "
                                f"with {want}: its Python took another path under capture")
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        constant = all(self.is_constant(t) for t in tensors)
        name = func.__name__.split(".")[0]
        if func in _SCALAR_READS or _is_host_copy(func, args, kwargs):
            source = tensors if func in _SCALAR_READS else [args[0] if func is TO_COPY else args[1]]
            if not all(self.is_constant(t) for t in source):
                if self.answering:
                    raise self._refuse(f"{name} ({SYNC_OPS.get(func, 'a copy to the host')})")
                return func(*args, **kwargs)
            if self.answering:
                value = self._answer(name)
                if func is _aten.copy_.default:
                    args[0].copy_(value)
                    return args[0]
                return value.clone() if isinstance(value, torch.Tensor) else value
            out = func(*args, **kwargs)
            self.reads.append((name, out.clone() if isinstance(out, torch.Tensor) else out))
            if isinstance(out, torch.Tensor):
                self._mark([out], True)
            return out
        if self.answering and func in SYNC_OPS:  # data-dependent output shapes: no frozen answer
            raise self._refuse(f"{name} ({SYNC_OPS[func]})")
        out = func(*args, **kwargs)
        random = torch.Tag.nondeterministic_seeded in func.tags
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if func in _LITERALS or (constant and not random):
            self._mark(outs, True)
        else:
            written = [args[i] for i in _written(func) if i < len(args) and isinstance(args[i], torch.Tensor)]
            written += [v for k, v in kwargs.items() if k == "out" and isinstance(v, torch.Tensor)]
            self._mark(written + outs, False)
        return out

    def unanswered(self) -> int:
        """Kept reads the capture run did not make (its Python took another path)."""
        return len(self.answers)


class _PythonReads(TorchFunctionMode):
    """Refuses, in the capture run, Python reads of non-constant tensor data the dispatcher does not see."""

    def __init__(self, reads: ConstantReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = _PY_READS.get(func)
        if what is not None and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu" \
                and not self.reads.is_constant(args[0]):
            raise self.reads._refuse(what)
        return func(*args, **(kwargs or {}))


def _ours(caller: str) -> bool:
    return caller == "torch" or caller.startswith(("torch.", "cg_lightning"))


def eager_path_under_capture() -> contextlib.AbstractContextManager:
    """Code outside torch and this package asking ``torch.cuda.is_current_stream_capturing()`` is told ``False``
    (torch's own code and this package's still learn the truth), so libraries take the path an eager step takes."""
    return _told(False)


def capture_seen_by_code() -> contextlib.AbstractContextManager:
    """The opposite, for the eager backend's stand-in for a capture: code outside torch and this package is told a
    stream captures, so that it takes the path it takes under a real capture (CPU tests see what a GPU does)."""
    return _told(True)


@contextlib.contextmanager
def _told(answer: bool) -> Iterator[None]:
    real = torch.cuda.is_current_stream_capturing

    def is_current_stream_capturing() -> bool:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return real() if _ours(caller) else answer

    torch.cuda.is_current_stream_capturing = is_current_stream_capturing
    try:
        yield
    finally:
        torch.cuda.is_current_stream_capturing = real


@contextlib.contextmanager
def record_reads() -> Iterator[ConstantReads]:
    """The eager run: constants tracked, their host reads kept (``.reads``)."""
    mode = ConstantReads()
    with mode:
        yield mode
    mode._constant.clear()


@contextlib.contextmanager
def answer_reads(recorded: ConstantReads) -> Iterator[ConstantReads]:
    """The capture run: outside code sees no capture, constant reads answered from ``recorded``, others refused.

    Raises:
        HostSyncError: a host read of a value that is not constant.
        ReadsDiverged: the reads differ from ``recorded``'s (also when some were not made).
    """
    mode = ConstantReads(answers=recorded.reads)
    with eager_path_under_capture(), _PythonReads(mode), mode:
        yield mode
    mode._constant.clear()
    if mode.unanswered():
        raise ReadsDiverged(f"the step made {mode.unanswered()} fewer host reads while it was captured than in its "
                            "eager run: its Python took another path under capture")
