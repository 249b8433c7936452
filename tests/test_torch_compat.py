"""Private torch APIs live in :mod:`cg_lightning.torch_compat` only, each behind a gate that names the feature."""

import ast
import io
import pathlib
import re
import tokenize

import pytest
import torch

from cg_lightning import torch_compat
from tests.source_checks import PACKAGE, offenders

PRIVATE_NAMES = {"_C", "_pytree", "_python_dispatch", "CheckpointFunction", "__wrapped__"}
# torch's hook dictionaries on modules, tensors and optimizers, version counters, torch._foo_ kernels
_HOOKS = r"_(forward|forward_pre|backward|backward_pre|post_accumulate_grad|optimizer_step_pre|optimizer_step_post|global_[a-z_]+)_hooks"
PRIVATE_ATTR = re.compile(_HOOKS + r"|_version|_[a-z][a-z_]*_")
# torch, torch.distributed, optimizers (the class and instances by their usual name), aten operators: any _name on
# them (Optimizer._group_tensors_by_device_and_dtype, optimizer._opt_called, torch.ops.aten._to_copy)
PRIVATE_OWNERS = {"torch", "dist", "optim_mod", "module", "Optimizer", "optimizer", "aten", "_aten"}
PRIVATE_STRING = re.compile(r"^(_C\b|" + _HOOKS + r"$|_version$|_broadcast_coalesced$|_[a-z][a-z_]*_$)")


def _private_uses(path: pathlib.Path):
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
              if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)]
    found = []
    for owner, dot, tok in zip([None, None] + tokens, [None] + tokens, tokens):
        attribute = dot is not None and dot.type == tokenize.OP and dot.string == "."
        if tok.type == tokenize.NAME:
            if tok.string in PRIVATE_NAMES:
                found.append((tok.start[0], tok.line.strip()))
            elif attribute and PRIVATE_ATTR.fullmatch(tok.string):
                found.append((tok.start[0], tok.line.strip()))
            elif (attribute and tok.string.startswith("_") and not tok.string.startswith("__")
                  and owner is not None and owner.string in PRIVATE_OWNERS):
                found.append((tok.start[0], tok.line.strip()))
        elif tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):
                continue
            if isinstance(value, str) and PRIVATE_STRING.match(value):
                found.append((tok.start[0], tok.line.strip()))
    return found


def test_private_torch_apis_only_in_torch_compat():
    found = offenders(_private_uses, PACKAGE / "torch_compat")
    assert not found, "go through cg_lightning.torch_compat:\n" + "\n".join(found)


def test_the_check_sees_private_uses(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""torch._foreach_add_ in a docstring"""\n'
                     "torch._foreach_add_(a, b)\n"
                     "from torch.utils import _pytree\n"
                     "n = t._version\n"
                     "h = m._forward_pre_hooks\n"
                     'g = getattr(dist, "_broadcast_coalesced", None)\n'
                     "x = torch._C._will_engine_execute_node(n)\n"
                     "y = torch_compat.version(t)\n"
                     "g = torch.optim.Optimizer._group_tensors_by_device_and_dtype(lists)\n"
                     "optimizer._opt_called = True\n"
                     "op = torch.ops.aten._to_copy.default\n"
                     "op = _aten._to_copy.default\n")
    assert [line for line, _ in _private_uses(probe)] == [2, 3, 4, 5, 6, 7, 9, 10, 11, 12]


def test_missing_private_api_names_feature_version_and_remedy(monkeypatch):
    monkeypatch.delattr(torch, "_fused_adamw_")
    with pytest.raises(torch_compat.TorchAPIMissing) as info:
        torch_compat.fused_adam_kernel(True)
    text = str(info.value)
    assert "torch._fused_adamw_" in text and "cached fused Adam step" in text and torch.__version__ in text
    assert "torch >= 2.11" in text and "fused=True" in text


def test_public_fallbacks_match_the_private_paths():
    a = [torch.arange(4.0), torch.ones(3)]
    b = [torch.full((4,), 0.5), torch.full((3,), 2.0)]
    fast = [t.clone() for t in a]
    torch_compat.foreach_add_(fast, b)
    slow = [t.clone() for t in a]
    torch_compat._foreach_add_fallback(slow, b)
    assert all(torch.equal(x, y) for x, y in zip(fast, slow))
    assert torch_compat.torch_version() >= torch_compat.TORCH_FLOOR
    assert not torch_compat.saved_tensor_hooks_active()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert torch_compat.saved_tensor_hooks_active()


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_bounded_store_client_gives_up_on_a_stopped_store_host():
    """A plain TCPStore client waits for good on a store host that is stopped (SIGSTOP); this one raises within
    about its timeout, so the progress board never hangs reading (``cg_lightning/ddp/progress.py``)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import free_port

    port = free_port()
    code = (f"import datetime, time, torch.distributed as d; s = d.TCPStore('127.0.0.1', {port}, is_master=True, "
            "wait_for_workers=False, timeout=datetime.timedelta(seconds=60)); s.set('k', 'v'); time.sleep(60)")
    host = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                client = torch_compat.bounded_store_client("127.0.0.1", port, 1.0)
                break
            except Exception:
                assert time.monotonic() < deadline and host.poll() is None
                time.sleep(0.2)
        assert client.check(["k"]) and client.get("k") == b"v"
        os.kill(host.pid, signal.SIGSTOP)
        stopped_by = time.monotonic() + 10  # the signal takes effect a little later: the store may answer once more
        while any(open(f"/proc/{host.pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0] != "T"
                  for t in os.listdir(f"/proc/{host.pid}/task")):  # every thread, the store's server thread too
            assert time.monotonic() < stopped_by, "the store host did not stop"
            time.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(Exception, match="Timeout"):
            client.check(["k"])
        assert time.monotonic() - start < 3
    finally:
        host.kill()
        host.wait(timeout=10)


def test_compiled_around_sees_compiled_code_that_encloses_a_layer_not_a_layer_compiled_on_its_own():
    import torch.nn as nn

    def net():
        return nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.ReLU()))

    plain = net()
    assert not torch_compat.compiled_around(plain, [plain[1]])
    own = net()
    own[1].forward = torch.compile(own[1].forward, backend="eager")
    assert not torch_compat.compiled_around(own, [own[1]])  # the layer's own compiled forward
    assert torch_compat.compiled_around(own, [own[1][0]])  # ... runs its first submodule
    inner = net()
    wrapped = nn.ModuleDict({"model": torch.compile(inner, backend="eager")})
    assert torch_compat.compiled_around(wrapped, [inner[1]])
    whole = net()
    whole.forward = torch.compile(whole.forward, backend="eager")
    assert torch_compat.compiled_around(whole, [whole[1]]) and not torch_compat.compiled_around(whole, [whole])
