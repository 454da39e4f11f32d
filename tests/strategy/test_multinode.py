"""A two-node launch on one machine: two separate torchrun processes (`--nnodes 2 --node_rank 0|1
--nproc_per_node 1`) meet at 127.0.0.1 and train a step together."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, free_port, read_json_lines, subprocess_env

HERE = Path(__file__).parent


@pytest.mark.dist
def test_two_nodes_train_a_step_together(tmp_path):
    port = free_port()
    nodes = []
    for node_rank in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank),
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
               str(HERE / "dist_multinode.py"), "--out", str(tmp_path / "node.jsonl")]
        nodes.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-6000:]
    records = [read_json_lines(tmp_path / f"node.jsonl.rank{r}")[0] for r in range(2)]
    for rank, record in enumerate(records):
        # one process per node: global rank = node rank, local rank 0 on both
        assert (record["rank"], record["world"], record["local_rank"], record["group_rank"]) == (rank, 2, 0, rank)
        assert record["losses"] == [records[0]["loss"], records[1]["loss"]]
        assert record["moved"] > 1e-4
    assert records[0]["loss"] != records[1]["loss"]  # each node trained on its own data
    # gradients were averaged across the nodes, so both hold the same weights after the step
    assert records[0]["checksums"] == records[1]["checksums"]
    assert records[0]["checksums"][0] == records[0]["checksums"][1]
