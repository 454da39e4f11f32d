"""The fused log-prob head under ZeRO-3 with two gloo ranks (one torchrun launch of
dist_fused_head.py): with the LM head's weight partitioned, the fused actor's log-probs,
entropies and trained weights equal the plain actor's."""

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_torchrun

HERE = Path(__file__).parent

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("fused_head_zero3") / "run.json"
    run_torchrun([HERE / "dist_fused_head.py", "--out", out], nproc=2)
    return [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("arch", ["qwen2", "llama_tied"])
def test_fused_head_equals_plain_under_zero3(records, arch):
    for record in records:
        plain, fused = record[f"{arch}/plain"], record[f"{arch}/fused"]
        assert plain["sharded"] and fused["sharded"]  # the head's weight is an empty shard outside its hooks
        # The fused head read the weight inside the head's own hooks: nothing gathered as an external parameter.
        assert fused["external"] == plain["external"] == 0
        for key in ("padded", "packed", "entropy"):
            torch.testing.assert_close(torch.tensor(fused[key]), torch.tensor(plain[key]), atol=1e-5, rtol=0)
        # One Adam step at lr 1e-2 moves the log-probs by nats; the gradients that moved them agree.
        moved = (torch.tensor(plain["after"]) - torch.tensor(plain["padded"])).abs().max()
        assert moved > 0.5
        torch.testing.assert_close(torch.tensor(fused["after"]), torch.tensor(plain["after"]), atol=1e-4, rtol=0)


def test_routing_replay_under_zero3(records):
    """Routing replay with the router weights partitioned (tests/models/dist_fused_head.py): the
    sharded actor replays the routes as the unsharded one does, padded and packed, and its routers
    train through the replayed forward."""
    for record in records:
        r = record["moe/replay"]
        assert r["sharded"] and r["replayed_vs_live"] > 1e-2
        assert r["padded"] < 1e-5 and r["packed"] < 1e-5 and r["router_moved"] > 1e-4
