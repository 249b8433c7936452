"""``ddp.overlap_param_gather`` (:mod:`cg_lightning.ddp.param_gather`): the parameters' all-gather after a sharded
step runs on into the next forward, each bucket waited for just before its parameters are first read.

In one process (no collectives): the order the buckets are gathered in, what the hooks cover, and when the graph
manager calls the engine before graphed code reads parameters. Across 2 processes
(and 4 for the driver runs; gloo, ``tests/scripts/distopt_overlap_dist.py``), from the recorded events of every run:
no read of a module's parameters (eager forward, graphed forward replayed by the eager backend, a segment's launch,
a capture, ``state_dict``, an eval forward, Lightning's validation and checkpoints) while one of their buckets is
pending; the buckets of the last layers waited for after the first layer's forward began (the overlap is real);
the weight read outside the module that holds it gathered at the step; with the option off every bucket waited
for inside the step. Numbers: every run within 1e-6 (relative) of torch DDP, or of Lightning ``"ddp"`` (per-step
validation losses and checkpointed weights); the overlapped runs equal the synchronous one bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from cg_lightning.ddp import DataParallelEngine, DDPOptions

TOL = 1e-6
DRIVER_RUNS = ("plain", "segments", "eager", "accelerate")


def test_gather_order_and_hook_coverage():
    """One process: the buckets in forward order (the buffer holds the parameters in reverse), every module that
    holds parameters hooked unless it lies in a graphed layer; nothing to gather, so the step waits for nothing."""
    from cg_lightning.ddp.param_gather import ParamGather

    torch.manual_seed(0)
    linear = torch.nn.Linear
    model = torch.nn.Sequential(linear(3, 4), torch.nn.Sequential(linear(4, 4)), linear(4, 1))
    engine = DataParallelEngine(model, DDPOptions(distributed_optimizer=True, bucket_size_mb=1e-6))
    gather = engine.param_gather
    first = [gather.bucket_of[p] for p in model.parameters()]
    assert gather.order == sorted(first, reverse=True) == first  # the first parameters are in the last bucket
    assert not gather.overlap  # one process: nothing is ever pending
    two = ParamGather(engine.shards, engine.params, overlap=True)
    two.overlap = True  # as with several processes
    two.install(model, graphed=[model[1]])
    hooked = [m for m in model.modules() if m._forward_pre_hooks]
    assert hooked == [model[0], model[2]]
    assert all(m._state_dict_pre_hooks for m in (model, model[0], model[1][0], model[2]))
    two.close()
    assert not any(m._forward_pre_hooks or m._state_dict_pre_hooks for m in model.modules())
    engine.close()


@pytest.mark.parametrize("segments", [False, True])
def test_graph_manager_calls_before_graphed_reads(segments):
    """``GraphManager.bind_param_reads``: the callback gets each graphed layer's module at its call (recorded or
    replayed), ``None`` before the capture, and at a segment's launch every member's module, before the graph that
    reads them runs (module hooks would not: a replay calls none of the layer's submodules)."""
    from cg_lightning.graphs import GraphOptions
    from cg_lightning.lifecycle import build_driver

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(3)])
    calls = []

    def body(x):
        calls.append("forward")
        for block in blocks:
            x = block(x)
        return x

    model = torch.nn.Module()
    model.blocks = blocks
    model.forward = body
    options = GraphOptions(warmup_steps=1, backend="eager", segments=segments)
    driver = build_driver(model, options, DDPOptions(), torch.device("cpu"))
    name = {id(b): f"block{i}" for i, b in enumerate(blocks)}
    driver.graph_manager.bind_param_reads(lambda m: calls.append(None if m is None else name[id(m)]))
    for step in range(3):
        driver.begin_micro_batch(step)
        loss = driver.engine(torch.randn(2, 4)).sum()
        driver.end_forward()
        driver.before_backward(loss)
        loss.backward()
        driver.after_backward()
        driver.after_optimizer_step()
    driver.close()
    each = ["block0", "block1", "block2"]
    replay = ["block0", *each, "block1", "block2"] if segments else each
    assert calls == ["forward", *each, "forward", "block0", None, *replay[1:], "forward", *replay], calls


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The script with 2 processes (every run), then with 4 (the driver runs only): the ranks' results."""
    from tests.launchers import run_ranks

    folders = {nproc: tmp_path_factory.mktemp(f"overlap{nproc}") for nproc in (2, 4)}
    run_ranks("tests/scripts/distopt_overlap_dist.py",
              [(["--out", str(folders[2])], 2), (["--out", str(folders[4]), "--short"], 4)], str(folders[2]),
              timeout=150)
    return {nproc: [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(nproc)]
            for nproc, folder in folders.items()}


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _close(run, ref, what):
    assert len(run["losses"]) == len(ref["losses"]) > 0, what
    assert max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"])) < TOL, what
    for key in ("weights", "state"):
        assert run[key].keys() == ref[key].keys() and max(_rel(run[key][k], ref[key][k]) for k in ref[key]) < TOL, \
            (what, key)
    assert _rel(run["eval"][0], ref["eval"][0]) < TOL, what


def _reads(events):
    return [e for e in events if e[0] == "read"]


def _windows(events):
    """Per optimizer step s: the events from its end to the next backward (the forward that follows it, and what
    the loop reads right after the step)."""
    ends = [i for i, e in enumerate(events) if e[0] == "step_end"]
    backs = {e[1]: i for i, e in enumerate(events) if e[0] == "backward"}
    return {events[i][1]: events[i:backs.get(events[i][1] + 1, len(events))] for i in ends}


def _check_overlapped(run, what, per_layer: bool):
    from tests.scripts.distopt_overlap_dist import STATE_AFTER

    events, buckets = run["events"], run["buckets"]
    side = {buckets["side.weight"], buckets["side.bias"]}
    assert run["synchronous"] == sorted(side), what  # only the weight read outside its module
    assert all(not pending for *_, pending in _reads(events)), (what, [e for e in _reads(events) if e[2]])
    windows = _windows(events)
    assert len(windows) == len(run["losses"])
    for step, window in windows.items():
        waited = [e[1] for e in window if e[0] == "wait"]
        assert not side & set(waited), (what, step)  # those were waited for inside the step
        if step == len(windows) - 1 or step == STATE_AFTER:  # no forward next / a state_dict waits for all first
            continue
        assert sorted(waited) == sorted(set(run["order"]) - side), (what, step)
        first_read = window.index(("read", "inp", []))
        for name in ("head.weight", "blocks.2.fc.weight"):
            assert window.index(("wait", buckets[name])) > first_read, (what, step, name)  # overlapped
        if per_layer and step > 1:  # after the capture step: each block waits for its own buckets only
            assert window.index(("wait", buckets["blocks.2.fc.weight"])) > window.index(("read", "block1", []))


@pytest.mark.distributed
@pytest.mark.timeout(360)
@pytest.mark.parametrize("nproc", [2, 4])
def test_driver_runs_overlap_and_equal_torch_ddp(runs, nproc):
    """Graphed layers one by one, graphed layers chained into a segment, no graphs, Accelerate (2 processes): reads
    never see a pending bucket, the last layers' buckets are waited for during the forward, the results equal torch
    DDP within 1e-6 and the synchronous run bit for bit."""
    for rank, res in enumerate(runs[nproc]):
        ref, off = res["torch_ddp"], res["off"]
        _close(off, ref, f"off, rank {rank}")
        for name in DRIVER_RUNS:
            if name not in res:
                continue
            run = res[name]
            what = f"{name}, rank {rank} of {nproc}"
            _close(run, ref, what)
            assert run["losses"] == off["losses"], what
            assert all(torch.equal(w, off["weights"][k]) for k, w in run["weights"].items()), what
            _check_overlapped(run, what, per_layer=name in ("plain", "eager"))
        assert res["plain"]["stats"]["forward_replays"] > 0 and res["plain"]["stats"]["segments"] == 0
        assert res["segments"]["stats"]["segments"] == 1
        if "accelerate" in res:
            assert res["accelerate"]["stats"]["forward_replays"] > 0


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_option_off_waits_inside_the_step(runs):
    for res in runs[2]:
        events = res["off"]["events"]
        assert res["off"]["synchronous"] == []
        inside, waits = False, 0
        for e in events:
            inside = e[0] == "step_begin" or (inside and e[0] != "step_end")
            if e[0] == "wait":
                assert inside, events
                waits += 1
        assert waits == len(res["off"]["order"]) * len(res["off"]["losses"])
        assert all(not pending for *_, pending in _reads(events))


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_lightning_validation_and_checkpoints_see_gathered_params(runs):
    """Lightning with a validation and a checkpoint after every second step: validation losses and checkpointed
    weights within 1e-6 of Lightning "ddp"; the checkpoint (state_dict) came with gathers pending and waited for
    them; after the other steps the next training forward overlapped them."""
    for rank, res in enumerate(runs[2]):
        ddp, cg = res["lightning_ddp"], res["lightning_cg"]
        assert len(cg["val"]) == len(ddp["val"]) == 3 and len(cg["saved"]) == len(ddp["saved"]) == 3
        assert max(abs(a - b) / abs(b) for a, b in zip(cg["val"], ddp["val"])) < TOL, rank
        for mine, theirs in zip(cg["saved"] + [cg["weights"]], ddp["saved"] + [ddp["weights"]]):
            assert max(_rel(mine[k], theirs[k]) for k in theirs) < TOL, rank
        events, head = cg["events"], cg["buckets"]["net.head.weight"]
        assert all(not pending for *_, pending in _reads(events))
        ends = [i for i, e in enumerate(events) if e[0] == "batch_end"]
        assert len(ends) == 6 and all(events[i][2] > 0 for i in ends)  # gathers pending after every step
        for i in ends[:-1]:
            window = events[i:]
            first_read = next(e for e in window if e[0] == "read")
            if events[i][1] % 2 == 1:  # a checkpoint: its state_dict waits for every bucket first
                assert first_read == ("read", "state_dict", []), window[:20]
            else:  # none: the next training forward waits layer by layer
                assert first_read == ("read", "inp", []) and window.index(("wait", head)) > window.index(first_read)
