"""A vLLM engine as the explorer (`--explorer_ranks 1 --rollout_engine vllm`, vLLM's CPU build):
the weights the trainer publishes reach the engine at every sync, and GRPO running one step
ahead learns. The trainer runs ZeRO-3, so each published version is gathered from shards. Both
runs share one torchrun launch (tests/e2e/run_many.py); each builds and shuts down its engine."""

import pytest

from lightrft.datasets.toy import greedy_accuracy
from tests.conftest import run_torchrun_many
from tests.e2e.conftest import grpo_flags, summary_line, tensorboard_scalars
from tests.e2e.test_vllm import INDUCTOR_CACHE, SMALL, VLLM, pytestmark, toy_vllm  # noqa: F401  (fixture and markers)


def series(out, tag: str) -> list[float]:
    return [value for _, value in sorted(tensorboard_scalars(out / "tb")[tag])]


@pytest.fixture(scope="module")
def explorer_runs(toy_vllm, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("vllm_explorer")
    on_policy = {**SMALL, "explorer_ranks": 1, "sync_offset": 0, "tis_cap": 2.0}
    runs = {"on_policy": {**on_policy, "max_samples": 128},
            "ahead": {"num_episodes": 2, "tis_cap": 2.0, "explorer_ranks": 1, "sync_offset": 1},
            "lora": {**on_policy, "lora_rank": 8, "lora_alpha": 16, "actor_learning_rate": 2e-3}}
    outputs = run_torchrun_many([grpo_flags(toy_vllm, root / name, **{**VLLM, **extra}) for name, extra in runs.items()],
                                root, env={"TORCHINDUCTOR_CACHE_DIR": INDUCTOR_CACHE})
    return {name: (root / name, output) for name, output in zip(runs, outputs)}


def test_a_vllm_explorer_samples_with_the_weights_the_trainer_published(explorer_runs):
    out, stdout = explorer_runs["on_policy"]
    assert summary_line(stdout)["step"] == 8
    assert series(out, "rollout/staleness_max") == [0.0] * 8
    # exp(trainer log-prob - explorer log-prob) stays 1 at every step: the explorer's vLLM engine
    # held exactly the trainer's weights each time (a missed sync moves it by 1e-4 or more).
    weights = series(out, "train/tis_weight_mean")
    assert len(weights) == 8 and max(abs(w - 1.0) for w in weights) < 5e-5, weights


def test_a_vllm_explorer_serves_the_lora_adapter_the_trainer_published(toy_vllm, explorer_runs):  # noqa: F811
    """--lora_rank with a vLLM explorer: the explorer's engine serves each published adapter
    (read from the trainer's weights with the adapter's config) over its frozen base weights."""
    out, stdout = explorer_runs["lora"]
    assert summary_line(stdout)["step"] == 4
    # The trainer's log-probs under the adapter it trained equal the explorer's sampling ones at
    # every step: an adapter not loaded (or the base weights alone) moves them by 1e-4 or more.
    weights = series(out, "train/tis_weight_mean")
    assert len(weights) == 4 and max(abs(w - 1.0) for w in weights) < 5e-5, weights
    # ... and the adapter did move the policy (the export merges it into the base weights).
    from safetensors.torch import load_file

    start, end = (load_file(folder / "model.safetensors") for folder in (toy_vllm["model"], out / "model"))
    assert max((start[k] - end[k]).abs().max().item() for k in start) > 1e-4


def test_grpo_with_a_vllm_explorer_one_step_ahead_learns(toy_vllm, explorer_runs):  # noqa: F811
    out, stdout = explorer_runs["ahead"]
    before = greedy_accuracy(toy_vllm["model"], toy_vllm["eval_rows"])
    summary = summary_line(stdout)
    after = greedy_accuracy(out / "model", toy_vllm["eval_rows"])
    print(f"held-out greedy accuracy with a vLLM explorer one step ahead {before:.3f} -> {after:.3f}")
    assert summary["step"] == 20 and after >= before + 0.07, (before, after)
    assert series(out, "rollout/staleness_max")[1:] == [1.0] * 19
    # Stale samples: importance weights differ from 1, and the cap keeps them at most 2.
    assert max(abs(w - 1.0) for w in series(out, "train/tis_weight_mean")) > 5e-5
