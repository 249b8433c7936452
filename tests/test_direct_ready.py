"""``graphs.direct_grad_ready``: replays report the parameters only they reach, without autograd edges
against Lightning "ddp" and against the same run with edges. Eager graph backend on CPU:
the edge bookkeeping, the confirmation on the autograd graph and the grad-ready counts are the same code
as on a GPU; the cuda test checks real graphs."""

import pytest
import torch
from lightning.pytorch import Callback, seed_everything

from cg_lightning.ddp import GradSyncError
from cg_lightning.examples.data import TextDataModule
from cg_lightning.examples.gpt import GPTLightningModule
from tests.helpers import (
    DATA, DEVICES, MODEL, cg_strategy, fit_gpt, make_trainer, max_rel_diff, state_rel_diff, train_in_process,
    train_subprocess,
)

TEXT = dict(DATA, max_bytes=300_000)


def _cg(backend="eager", direct=True, **graphs):
    """Per-layer graphs (direct grad-ready is theirs), ``direct_grad_ready`` as given."""
    return cg_strategy(backend, direct_grad_ready=direct, **{"whole_step": False, **graphs})


def _block_params(model, i):
    return [n for n, _ in model.named_parameters() if n.startswith(f"model.blocks.{i}.")]


@pytest.mark.parametrize("accelerator,backend", DEVICES)
@pytest.mark.parametrize("segments", [False, True], ids=["layers", "segments"])
def test_block_parameters_reported_by_their_replay_equal_ddp(accelerator, backend, segments):
    """4-block GPT, 10 steps: every block parameter loses its edge after the first replayed step; losses and
    weights equal "ddp" (1e-6) and the grad-ready counts equal those of the same run with edges."""
    kw = dict(steps=10, accelerator=accelerator, model_kwargs=dict(MODEL, n_layer=4))
    ref_model, ref, _ = train_in_process("ddp", **kw)
    edges = _cg(backend, direct=False, segments=segments)
    _, with_edges, _ = train_in_process(edges, **kw)
    strategy = _cg(backend, segments=segments)
    model, rec, _ = train_in_process(strategy, **kw)
    stats = strategy.last_graph_stats
    n_block_params = sum(len(_block_params(model, i)) for i in range(4))
    assert stats.direct_ready_params == n_block_params
    assert max_rel_diff(rec.losses, ref.losses) < 1e-6
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-6
    assert rec.ready_counts == with_edges.ready_counts and len(rec.ready_counts) == 10
    print(f"direct grad-ready ({'segments' if segments else 'layers'}, {backend}): "
          f"{stats.direct_ready_params} parameters, loss diff {max_rel_diff(rec.losses, ref.losses):.1e}")


def test_block_applied_twice_keeps_its_edges():
    """block_schedule [0, 0, 1]: block 0's parameters are reached by two replays, so they keep their edges
    (one report per outer backward, as eager); block 1's are reported directly. Counts equal the run with
    edges, values equal "ddp" (1e-6)."""
    kw = dict(steps=8, model_kwargs=dict(MODEL, block_schedule=[0, 0, 1]))
    ref_model, ref, _ = train_in_process("ddp", **kw)
    _, with_edges, _ = train_in_process(_cg(direct=False), **kw)
    strategy = _cg()
    model, rec, _ = train_in_process(strategy, **kw)
    assert strategy.last_graph_stats.captured_runners == 3
    assert strategy.last_graph_stats.direct_ready_params == len(_block_params(model, 1))
    assert rec.ready_counts == with_edges.ready_counts
    assert max_rel_diff(rec.losses, ref.losses) < 1e-6
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-6


def test_graphed_glue_embeddings_keep_their_edges():
    """Glue graphed too (graphs.layers with the embeddings, final norm and head): the embeddings take integer
    ids, so their parameter edges are what runs their backward and they keep them; every other graphed
    parameter is reported by its replay. Values equal "ddp" (1e-6). Found while trying this: without the
    rule the embeddings never reported ready."""
    layers = ["model.tok_emb", "model.pos_emb", "model.blocks.*", "model.ln_f", "model.lm_head"]
    kw = dict(steps=8, model_kwargs=MODEL)
    ref_model, ref, _ = train_in_process("ddp", **kw)
    strategy = _cg(layers=layers)
    model, rec, _ = train_in_process(strategy, **kw)
    stats = strategy.last_graph_stats
    assert stats.captured_runners == 6
    graphed = [n for n, _ in model.named_parameters() if not n.startswith(("model.tok_emb", "model.pos_emb"))]
    assert stats.direct_ready_params == len(graphed)
    assert max_rel_diff(rec.losses, ref.losses) < 1e-6
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-6


class _SharedHead(GPTLightningModule):
    """The last block's MLP output weight is also used by the loss (a regulariser), every step or only at
    ``only_at_step``."""

    def __init__(self, only_at_step=None, **kw):
        super().__init__(**kw)
        self.only_at_step = only_at_step

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.only_at_step is None or self.global_step == self.only_at_step:
            loss = loss + 1e-3 * self.model.blocks[-1].fc_out.weight.square().sum()
        return loss


def _fit_shared(strategy, only_at_step=None, steps=8):
    model, rec, _, _ = fit_gpt(strategy, steps, model_cls=_SharedHead, model_kwargs=dict(only_at_step=only_at_step),
                               data=TEXT)
    return model, rec


def test_parameter_also_used_outside_keeps_its_edge():
    """A block weight also used by the loss in every step: the autograd graph shows a second producer, so
    that weight keeps its edge (the others of the block do not); values equal "ddp" (1e-6)."""
    ref_model, ref = _fit_shared("ddp")
    strategy = _cg()
    model, rec = _fit_shared(strategy)
    total = len(_block_params(model, 0)) + len(_block_params(model, 1))
    assert strategy.last_graph_stats.direct_ready_params == total - 1
    assert max_rel_diff(rec.losses, ref.losses) < 1e-6
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-6
    assert all(set(c.values()) == {1} for c in rec.ready_counts)


def test_parameter_used_outside_only_later_is_a_named_error():
    """The same weight used by the loss only at step 5 (after the switch at step 3): its count exceeds the
    golden count and the engine raises, naming it and the option, instead of reducing a bucket before that
    gradient."""
    with pytest.raises(GradSyncError, match=r"(?s)model\.blocks\.1\.fc_out\.weight \(ready 2 times, expected 1\)"
                                            r".*graphs\.direct_grad_ready=false"):
        _fit_shared(_cg(), only_at_step=5)
    ref_model, ref = _fit_shared("ddp", only_at_step=5)
    model, rec = _fit_shared(_cg(direct=False), only_at_step=5)  # with edges the same model trains like ddp
    assert max_rel_diff(rec.losses, ref.losses) < 1e-6


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_processes_gloo_direct_grad_ready_equals_ddp(tmp_path):
    """2 processes (gloo), 4-block GPT with segments, 12 steps: with direct grad-ready the buckets still
    complete and reduce on both ranks; losses and weights equal Lightning "ddp" (1e-5) and every parameter
    reports once per step."""
    common = ["--devices", "2", "--steps", "12", "--n-layer", "4", "--d-model", "32", "--n-head", "2",
              "--block-size", "16"]
    ref = train_subprocess(str(tmp_path / "ddp.pt"), "--strategy", "ddp", *common)
    cg = train_subprocess(str(tmp_path / "cg.pt"), "--strategy", "cudagraph_ddp", "--backend", "eager",
                          "--direct-grad-ready", "--segments", "--whole-step", "false", *common)
    assert cg["stats"]["direct_ready_params"] == 4 * 12
    assert max_rel_diff(cg["losses"], ref["losses"]) < 1e-5
    assert state_rel_diff(cg["state"], ref["state"]) < 1e-5
    assert all(set(c.values()) == {1} for c in cg["ready_counts"]) and len(cg["ready_counts"]) == 12


def test_candidates_wait_for_a_step_whose_calls_replayed():
    """The first step after capture runs its calls eagerly (a smaller batch there, shape_policy="eager"): the
    candidates stay pending and are confirmed at the next step that replays, instead of being dropped."""
    kw = dict(steps=9, model_kwargs=dict(MODEL, block_size=32),
              data_kwargs=dict(max_bytes=400, drop_last=False))  # batch sizes 4 4 2 | 4 4 2 | ...
    ref_model, ref, _ = train_in_process("ddp", **kw)
    strategy = _cg(shape_policy="eager")  # capture at step 2, the 2-sample batch
    with pytest.warns(UserWarning, match="runs eagerly for a call"):
        model, rec, _ = train_in_process(strategy, **kw)
    stats = strategy.last_graph_stats
    assert stats.fallback_calls > 0
    assert stats.direct_ready_params == len(_block_params(model, 0)) + len(_block_params(model, 1))
    assert max_rel_diff(rec.losses, ref.losses) < 1e-6
    assert state_rel_diff(model.state_dict(), ref_model.state_dict()) < 1e-6


class _FreezeAt(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 5:
            pl_module.model.blocks[1].fc_out.weight.requires_grad_(False)


def test_freezing_a_directly_reported_parameter_later_is_a_named_error():
    """Freezing a parameter after its replay took over reporting it: a replay would keep adding into its
    main_grad with no autograd edge going silent, so the layer no longer matches its capture and runs eagerly
    (one warning naming the parameter); the frozen parameter then reports no gradient and the engine names it,
    as "ddp" stops for a parameter without a gradient."""
    seed_everything(7, workers=True)
    model = GPTLightningModule(**MODEL)
    trainer = make_trainer(_cg(), 8, [_FreezeAt()])
    with pytest.warns(UserWarning, match=r"'model\.blocks\.1'.*requires_grad changed since capture.*'fc_out\.weight'"):
        with pytest.raises(GradSyncError, match=r"model\.blocks\.1\.fc_out\.weight \(ready 0 times, expected 1\)"):
            trainer.fit(model, datamodule=TextDataModule(**TEXT))


class _Core:
    """Stands for a C++ autograd node: its children, and ``runner``/``variable`` where the real one has them."""

    def __init__(self, children=(), runner=None, variable=None):
        self.children, self.runner, self.variable = list(children), runner, variable


class _Wrapper:
    """A fresh Python wrapper at every ``next_functions`` access, freed when dropped, as torch's wrappers of C++
    nodes are: a new wrapper may get the address (``id``) of one freed a moment ago."""

    def __init__(self, core):
        self._core = core
        if core.runner is not None:
            self.runner = core.runner
        if core.variable is not None:
            self.variable = core.variable

    @property
    def next_functions(self):
        return tuple((_Wrapper(c), 0) for c in self._core.children)


@pytest.mark.parametrize("depth", [1, 5, 20])
def test_confirming_walk_survives_reused_node_wrapper_ids(depth):
    """torch creates a node's Python wrapper on each ``next_functions`` access and frees it when dropped, so a
    walk that marks nodes as seen by the wrapper's id can meet a freed id again for another node and skip it
    (on an H200 such a walk confirmed 0 of 48 candidates). Here a chain of ``depth`` nodes with side branches
    leads to the replay node; the walk must find the parameter behind it (an id-marking walk finds it at
    depth 1 and 2 and loses it from depth 5 on)."""
    from cg_lightning.graphs.replay import direct_ready

    runner = object()
    param = torch.nn.Parameter(torch.zeros(1))
    node = _Core([_Core(variable=param)], runner=runner)
    for _ in range(depth):
        node = _Core([node, _Core()])

    class Loss:
        grad_fn = _Wrapper(node)

    assert direct_ready.confirmed(Loss, {id(param): runner}) == {runner: [param]}
