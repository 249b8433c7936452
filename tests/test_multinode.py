"""Multi-node without a launcher of our own: Lightning's torchelastic environment under torchrun.

Two "nodes" on localhost (``torchrun --nnodes 2 --node_rank {0,1} --nproc_per_node 1``) running
``Trainer(num_nodes=2, devices=1, accelerator="cpu", strategy="cudagraph_ddp")`` form one world of two
processes; the run must equal a single-node run with two processes (Lightning's own launcher), step by
step. The same holds for SLURM (``srun`` with ``num_nodes``) and ``accelerate launch --num_machines``:
the strategy only sees a world size and its rank.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers import SCRIPT, free_port, max_rel_diff, state_rel_diff
from tests.launchers import run_all, torchrun

COMMON = ["--strategy", "cudagraph_ddp", "--steps", "12", "--backend", "eager", "--warmup-steps", "2"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_nodes_equal_one_node_two_processes(tmp_path):
    # Reference: one node, two processes started by Lightning's own launcher; at the same time (independent worlds,
    # each on its own port) the two "nodes" under torchrun.
    out = str(tmp_path / "two_nodes.pt")
    port = free_port()
    nodes = [
        torchrun(SCRIPT, "--devices", "1", "--num-nodes", "2", *COMMON, "--out", out,
                 nproc=1, nnodes=2, node_rank=rank, port=port)
        for rank in (0, 1)
    ]
    reference = [sys.executable, SCRIPT, "--devices", "2", *COMMON, "--out", str(tmp_path / "one_node.pt")]
    logs = run_all([reference, *nodes], str(tmp_path), timeout=200)[1:]
    one_node = torch.load(str(tmp_path / "one_node.pt"))
    # Lightning reports the world it joined: rank 0 of 2 on node 0, rank 1 of 2 on node 1.
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in logs[0]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in logs[1]

    two_nodes = torch.load(out)
    assert len(two_nodes["losses"]) == len(one_node["losses"]) == 12
    loss_diff = max_rel_diff(two_nodes["losses"], one_node["losses"])
    weight_diff = state_rel_diff(two_nodes["state"], one_node["state"])
    print(f"max relative difference: losses {loss_diff:.3g}, final weights {weight_diff:.3g}")
    assert loss_diff < 1e-5
    assert weight_diff < 1e-5
    # the defaults: the whole step captured once and replayed on both nodes, as on one node
    steps = {k: v for k, v in two_nodes["step_stats"].items() if k != "capture_seconds"}
    assert steps == {k: v for k, v in one_node["step_stats"].items() if k != "capture_seconds"}
    assert steps["captures"] == 1 and steps["replays"] == 12 - 3, steps
