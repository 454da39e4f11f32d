"""A vLLM engine as the explorer (`--explorer_ranks 1 --rollout_engine vllm`, vLLM's CPU build):
the weights the trainer publishes reach the engine at every sync, and GRPO running one step
ahead learns. The trainer runs ZeRO-3, so each published version is gathered from shards."""

from lightrft.utils.toy import greedy_accuracy
from tests.e2e.conftest import summary_line, tensorboard_scalars
from tests.e2e.test_vllm import SMALL, launch, pytestmark, toy_vllm  # noqa: F401  (fixture and markers)


def series(out, tag: str) -> list[float]:
    return [value for _, value in sorted(tensorboard_scalars(out / "tb")[tag])]


def test_a_vllm_explorer_samples_with_the_weights_the_trainer_published(toy_vllm, tmp_path):
    summary = summary_line(launch(toy_vllm, tmp_path, **{**SMALL, "max_samples": 128}, explorer_ranks=1,
                                  sync_offset=0, tis_cap=2.0).stdout)
    assert summary["step"] == 8
    assert series(tmp_path, "rollout/staleness_max") == [0.0] * 8
    # exp(trainer log-prob - explorer log-prob) stays 1 at every step: the explorer's vLLM engine
    # held exactly the trainer's weights each time (a missed sync moves it by 1e-4 or more).
    weights = series(tmp_path, "train/tis_weight_mean")
    assert len(weights) == 8 and max(abs(w - 1.0) for w in weights) < 5e-5, weights


def test_grpo_with_a_vllm_explorer_one_step_ahead_learns(toy_vllm, tmp_path):
    before = greedy_accuracy(toy_vllm["model"], toy_vllm["eval_rows"])
    summary = summary_line(launch(toy_vllm, tmp_path, num_episodes=2, tis_cap=2.0, explorer_ranks=1,
                                  sync_offset=1).stdout)
    after = greedy_accuracy(tmp_path / "model", toy_vllm["eval_rows"])
    print(f"held-out greedy accuracy with a vLLM explorer one step ahead {before:.3f} -> {after:.3f}")
    assert summary["step"] == 20 and after >= before + 0.07, (before, after)
    assert series(tmp_path, "rollout/staleness_max")[1:] == [1.0] * 19
    # Stale samples: importance weights differ from 1, and the cap keeps them at most 2.
    assert max(abs(w - 1.0) for w in series(tmp_path, "train/tis_weight_mean")) > 5e-5

