"""ActorLanguage and Critic under ZeRO-3 with two gloo ranks (one torchrun launch)."""

from pathlib import Path

import pytest
import torch

from lightrft.models import Critic
from tests.conftest import read_json_lines, run_torchrun

HERE = Path(__file__).parent
ATOL = 1e-5

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def records(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("wrappers_zero3")
    critic = Critic(tiny_dirs["llama"])
    with torch.no_grad():
        critic.model.score.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
    critic.save_pretrained(out / "critic_init")
    run_torchrun([HERE / "dist_wrappers.py", "--actor", tiny_dirs["qwen2"], "--critic", out / "critic_init",
                  "--causal_lm", tiny_dirs["llama"], "--out", out / "run.jsonl"], nproc=2)
    return [{r["check"]: r for r in read_json_lines(out / f"run.jsonl.rank{rank}")} for rank in (0, 1)]


def test_parameters_are_sharded(records):
    # Under ZeRO-3 a rank holds no full parameter: DeepSpeed leaves an empty placeholder.
    assert all(r["sharded"]["numel"] == [0] for r in records)


def test_sharded_forwards_equal_the_unsharded_model(records):
    for rank in records:
        forward = rank["forward"]
        assert forward["packed_vs_padded"] < ATOL
        assert forward["padded_vs_reference"] < ATOL
        assert forward["values_packed_vs_padded"] < ATOL
        assert forward["values_padded_vs_reference"] < ATOL
        assert forward["values_scale"] > 0.1  # the trained head was loaded, not a fresh ~0 one


def test_fresh_value_head_is_initialised_under_zero3(records):
    for rank in records:
        assert rank["forward"]["fresh_values_finite"]
        assert 0 < rank["forward"]["fresh_values_scale"] < 10


def test_trained_actor_and_critic_export_as_hugging_face_folders(records):
    for rank in records:
        export = rank["export"]
        assert export["step_moved"] > 1e-4  # the optimizer step changed the policy
        assert export["reloaded_vs_trained"] < ATOL
        assert export["reloaded_values_vs_reference"] < ATOL
