"""The gradient protocol (:mod:`cg_lightning.protocol`): one module owns the contract attributes, and each
data-parallel engine owns its grad-ready reporter, handed to the graph manager that replays for it."""

import ast
import io
import pathlib
import tokenize

import torch

from cg_lightning.ddp import DataParallelEngine, DDPOptions
from tests import engine_models as em
from tests.engine_models import assert_grads_equal, batches, eager_reference, graph_manager, train_steps
from tests.source_checks import PACKAGE, offenders

CONTRACT = {"main_grad", "grad_added_to_main_grad", "skip_backward_post_hook"}


def _direct_uses(path: pathlib.Path):
    """``(line, text)`` of every ``x.<contract attribute>`` and every string literal naming one (``getattr``,
    ``hasattr``, ``attrgetter``) in ``path``; comments and docstrings are not code and are skipped."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
              if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)]
    found = []
    for owner, prev, tok in zip([None] + tokens, tokens, tokens[1:]):
        accessor = owner is not None and owner.string == "protocol"  # protocol.main_grad(p): the accessor itself
        if (tok.type == tokenize.NAME and tok.string in CONTRACT and prev.type == tokenize.OP and prev.string == "."
                and not accessor):
            found.append((tok.start[0], tok.line.strip()))
        if tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):
                continue
            if value in CONTRACT:
                found.append((tok.start[0], tok.line.strip()))
    return found


def test_contract_attributes_are_read_and_written_only_in_protocol():
    found = offenders(_direct_uses, PACKAGE / "protocol.py")
    assert not found, "use cg_lightning.protocol's accessors:\n" + "\n".join(found)


def test_the_check_sees_direct_uses(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""p.main_grad in a docstring"""\n# p.main_grad in a comment\n'
                     'a = p.main_grad\nb = getattr(p, "skip_backward_post_hook", False)\n'
                     'p.grad_added_to_main_grad = True\nc = protocol.main_grad(p)\n')
    assert [line for line, _ in _direct_uses(probe)] == [3, 4, 5]


def test_two_engines_over_one_model_keep_separate_reporters():
    """Engine A and then engine B are built over the same parameters, A is closed and the graph manager is bound
    to B. B's reporter is its own (closing A leaves it whole), and the graph replays report to B: gradients and
    grad-ready counts as in eager training, including the notifications of the reentrant recomputation that the
    capture bypassed (which only the bound reporter can supply); A counts nothing."""
    ref, _ = eager_reference(em.TorchReentrantLayer)
    torch.manual_seed(0)
    model = em.Stack(em.TorchReentrantLayer, 16, 2, recompute=True)
    manager = graph_manager(model, layers=["layers.*"])
    first = DataParallelEngine(model, DDPOptions())
    engine = DataParallelEngine(model, DDPOptions())
    weight = model.layers[0].fc1.weight
    assert first.grad_ready.notifier(weight) is not engine.grad_ready.notifier(weight)
    first.close()
    assert first.grad_ready.notifier(weight) is None and engine.grad_ready.notifier(weight) is not None
    manager.bind_grad_ready(engine.grad_ready)
    grads, counts = train_steps(manager, engine, model, batches(4, 16, "cpu"))
    assert manager.stats.forward_replays > 0
    assert all(c == counts[0] for c in counts[1:]), counts
    assert counts[0]["layers.0.fc1.weight"] == 1
    assert all(c == 0 for b in first.buckets for c in b.slot_counts)
    assert_grads_equal(grads, ref)


def test_a_manager_that_adds_into_main_grad_needs_a_bound_reporter():
    """Capture over parameters that an engine owns, with no reporter bound, is refused with the call to make."""
    import pytest

    torch.manual_seed(0)
    model = em.Stack(em.TorchReentrantLayer, 16, 1, recompute=True)
    manager = graph_manager(model, layers=["layers.*"])
    engine = DataParallelEngine(model, DDPOptions())
    manager.begin_step(0)
    engine(torch.randn(4, 16)).backward()
    engine.finish_grad_sync()
    manager.begin_step(1)
    with pytest.raises(RuntimeError, match=r"bind_grad_ready\(engine\.grad_ready\)"):
        engine(torch.randn(4, 16))
