"""benchmarks/gpu_suite.py, the one-command GPU benchmark, kept from rotting: its `--smoke` mode runs
every section end to end on the CPU (tiny shapes, float32, ZeRO-2/3 on one gloo rank) and must
report finite, positive figures under the keys the GPU run fills in. Speed is never asserted.
The FLOPs count behind MFU and the card table are checked on hand-computed numbers."""

import json
import math
import subprocess
import sys

import pytest
import torch
from transformers import Qwen2Config

from tests.conftest import REPO_ROOT, load_file_module, subprocess_env

SUITE = REPO_ROOT / "benchmarks" / "gpu_suite.py"


@pytest.fixture(scope="module")
def suite():
    """The suite's module, for its pure functions (importing it runs nothing)."""
    return load_file_module(SUITE)


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_suite") / "suite.json"
    proc = subprocess.run([sys.executable, str(SUITE), "--smoke", "--shared_prompts", "4", "--hf_static", "--json",
                           str(out)], cwd=REPO_ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"gpu_suite --smoke exited {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                                  f"{proc.stderr[-6000:]}")
    return json.loads(out.read_text()), proc.stdout


def test_actor_update_under_zero2_and_zero3_reports_achieved_flops(smoke):
    results, _ = smoke
    assert results["mode"] == "smoke" and results["dtype"] == "float32" and results["failed_sections"] == []
    assert results["peak_tflops"] is None            # no CPU peak table: no MFU
    for stage in (2, 3):
        fig = results["actor_update"][f"zero{stage}"]
        assert fig["zero_stage"] == stage and fig["timed_steps"] == results["sizes"]["update_steps"]
        for key in ("step_seconds", "tokens_per_s", "achieved_tflops", "model_tflop_per_step", "params",
                    "non_embedding_params"):
            assert positive(fig[key]), (stage, key, fig[key])
        assert fig["mfu"] is None
        assert fig["micro_batches_per_step"] == results["sizes"]["micro_batches"]
        # Packed micro-batches of prompts + responses, each within the token budget.
        assert 0 < fig["action_tokens_per_step"] < fig["tokens_per_step"] <= fig["micro_batches_per_step"] * \
            results["sizes"]["micro_tokens"]
        assert fig["tokens_per_s"] == pytest.approx(fig["tokens_per_step"] / fig["step_seconds"])
        assert fig["achieved_tflops"] == pytest.approx(fig["model_tflop_per_step"] / fig["step_seconds"])
    # Both stages train the same model on the same batches: the same work per step.
    zero2, zero3 = results["actor_update"]["zero2"], results["actor_update"]["zero3"]
    assert zero2["model_tflop_per_step"] == zero3["model_tflop_per_step"] and zero2["params"] == zero3["params"]


def test_grouped_updates_share_prompts_on_the_same_batches(smoke, suite):
    results, stdout = smoke
    shared, unshared = (results["actor_update"][f"zero2_grouped_{k}"] for k in ("shared", "unshared"))
    assert shared["shared_prompts"] and not unshared["shared_prompts"] and shared["group"] == unshared["group"] == 4
    assert shared["tokens_per_step"] == unshared["tokens_per_step"] and positive(shared["samples_per_s"])
    # Each group of 4 computes its prompt once: fewer tokens than the batch holds.
    assert unshared["computed_tokens_per_step"] == unshared["tokens_per_step"]
    assert 0 < shared["computed_tokens_per_step"] < shared["tokens_per_step"]
    assert "shared prompts" in stdout
    batches = suite.rl_micro_batches(suite.SMOKE_SIZES, 128, "cpu", seed=0, group=4)
    for batch in batches:
        assert len(batch.seq_lens) % 4 == 0 and sum(batch.seq_lens) <= suite.SMOKE_SIZES.micro_tokens
        starts = [0] + torch.tensor(batch.seq_lens).cumsum(0).tolist()
        for i, first in enumerate(batch.prompt_groups):     # a group's sequences start with the same prompt
            prompt = batch.seq_lens[i] - batch.num_actions[i]
            assert torch.equal(batch.input_ids[0, starts[i]:starts[i] + prompt],
                               batch.input_ids[0, starts[first]:starts[first] + prompt])


def test_rollout_sync_and_grpo_step_report_their_figures(smoke):
    results, stdout = smoke
    sizes = results["sizes"]
    hf = results["rollout"]["hf"]
    assert positive(hf["tokens_per_s"]) and positive(hf["seconds_per_call"])
    # min_new_tokens = max_new_tokens: every sample decodes exactly that many tokens.
    assert hf["generated_tokens"] == sizes["rollout_prompts"] * sizes["rollout_n"] * sizes["rollout_new_tokens"]
    assert "CUDA only" in results["rollout"]["vllm"]["skipped"]
    # --hf_static: the static KV cache decodes the same number of tokens (eagerly on the CPU).
    static = results["rollout"]["hf_static"]
    assert static["generated_tokens"] == hf["generated_tokens"] and positive(static["tokens_per_s"])
    assert static["compiled_step"] is False and "rollout HF static" in stdout

    sync = results["weight_sync"]
    # Every float32 parameter of the ZeRO-3 actor moved once (the tied LM head is the embedding).
    assert sync["bytes"] == 4 * results["actor_update"]["zero3"]["params"]
    assert positive(sync["copy"]["seconds"]) and positive(sync["copy"]["seconds_per_gb"]) and sync["buckets"] >= 1
    assert "skipped" in sync["vllm"]

    grpo = results["grpo_step"]
    assert grpo["model"].startswith("tiny random") and grpo["engine"] == "hf"
    assert grpo["samples_per_step"] == sizes["grpo_prompts"] * sizes["grpo_group"]
    assert positive(grpo["step_seconds"]) and positive(grpo["samples_per_s"])
    assert set(grpo["phases_seconds"]) == {"generate", "reward", "experience", "train"}
    assert all(positive(v) for v in grpo["phases_seconds"].values()), grpo["phases_seconds"]

    assert set(results["memory"]) == {"update ZeRO-2", "update ZeRO-3", "weight sync", "rollout HF",
                                      "rollout HF static", "grpo rollout (step 2)", "grpo train (step 2)"}
    for phase, fig in results["memory"].items():
        assert positive(fig["peak_gib"]) and positive(fig["seconds"]) and fig["device_used_gib"] is None, phase
    for row in ("update ZeRO-2", "update ZeRO-3", "rollout HF", "sync gather+copy", "GRPO step"):
        assert f"\n{row}" in stdout


def test_training_flops_match_the_hand_count(suite):
    # hidden 4, 2 heads of 2, 1 KV head, MLP 6, 1 layer, vocabulary 10; sequences of 3 and 2 tokens,
    # one action each. Decoder matmul weights: q 4x4 + k, v 2 x 4x2 + o 4x4 + MLP 3 x 4x6 = 120.
    config = Qwen2Config(hidden_size=4, num_attention_heads=2, num_key_value_heads=1, intermediate_size=6,
                         num_hidden_layers=1, vocab_size=10)
    forward = 2 * 120 * 5 + 2 * 4 * (3 * 3 + 2 * 2) + 2 * 4 * 10 * 2     # weights, causal attention, LM head
    assert suite.training_flops(config, [3, 2], [1, 1]) == 3 * forward == 4392
    # Qwen2.5-0.5B: 24 layers of 14.9M matmul weights = the model card's 0.36B non-embedding parameters.
    qwen = Qwen2Config(**suite.QWEN25_05B)
    per_token = 6 * 24 * (896 * 896 * 2 + 2 * 896 * 128 + 3 * 896 * 4864)
    assert per_token == 6 * 357_826_560
    assert suite.training_flops(qwen, [1], [0]) == per_token + 6 * 24 * 896
    assert suite.training_flops(qwen, [1], [1]) == per_token + 6 * 24 * 896 + 6 * 896 * 151936


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA A10", 125.0), ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.0),
    ("NVIDIA L40", 181.0), ("Tesla V100-SXM2-16GB", None), ("NVIDIA A10G", None),
])
def test_peak_table_matches_device_names(suite, name, tflops):
    assert suite.peak_tflops(name) == tflops


def test_kernel_profile_figures_from_a_hand_made_trace(suite):
    """Busy time is the union of kernel intervals (overlaps counted once), against the unprofiled step."""
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "gemm_bf16", "ts": 0.0, "dur": 400.0},
        {"cat": "kernel", "name": "pytorch_flash::flash_fwd_kernel", "ts": 300.0, "dur": 200.0},  # overlaps 100
        {"cat": "kernel", "name": "gemm_bf16", "ts": 1000.0, "dur": 100.0},
        {"cat": "kernel", "name": "fmha_bwd", "ts": 1050.0, "dur": 20.0},                        # inside the last
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 2000.0, "dur": 1.0},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 2100.0, "dur": 1.0},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5000.0},
    ]}
    figures = suite.kernel_profile_figures(trace, step_seconds=0.002, micro_batches=2)
    assert figures["gpu_busy_seconds"] == pytest.approx(600e-6)       # [0, 500) + [1000, 1100)
    assert figures["gpu_busy_share"] == pytest.approx(0.3)
    assert figures["kernel_launches"] == 4 and figures["device_to_host_copies"] == 1
    assert figures["attention_kernels_per_micro_batch"] == 1.0        # flash fwd + fmha bwd over 2
    top = figures["top_kernels"][0]
    assert (top["name"], top["calls"], top["ms"]) == ("gemm_bf16", 2, pytest.approx(0.5))
    assert top["share"] == pytest.approx(500 / 720)
