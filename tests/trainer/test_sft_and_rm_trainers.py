"""One optimizer step of SFTTrainer and RewardModelTrainer on two ranks (ZeRO-2, two accumulation
steps, packed SFT micro-batches) equals the whole-batch step computed in one process; evaluation
and reward statistics count every sample once although one rank pads its last batch."""

import pytest

from tests.conftest import read_json_lines, run_torchrun

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_rm_steps") / "result.jsonl"
    run_torchrun(["tests/trainer/dist_sft.py", "--out", out], nproc=2)
    (record,) = read_json_lines(out)
    assert record["gas"] == 2
    return record


def test_sft_step_equals_the_whole_batch_step(result):
    sft = result["sft"]
    # The logged loss is the global token-mean over the 8 samples (56 response tokens), not a mean of
    # per-micro-batch means.
    assert sft["tokens"] == sft["ref_tokens"] == 56
    assert sft["loss"] == pytest.approx(sft["ref_loss"], rel=1e-5)
    # SGD with lr 1: every weight moved by exactly minus the whole-batch gradient. A wrong loss
    # scale would be off by a fraction of the gradient itself, which reaches 0.86 here.
    assert sft["grad_scale"] > 0.1
    assert sft["step_error"] < 1e-5


def test_sft_evaluation_counts_each_sample_once(result):
    sft = result["sft"]
    # 7 eval samples over 2 ranks in batches of 2: one rank has a filler that must not count.
    assert sft["eval"]["eval/loss"] == pytest.approx(sft["ref_eval"], rel=1e-5)
    assert sft["eval"]["eval/tokens"] == 51


def test_rm_step_equals_the_whole_batch_step(result):
    rm = result["rm"]
    assert rm["loss"] == pytest.approx(rm["ref_loss"], rel=1e-5)
    assert rm["acc"] == pytest.approx(rm["ref_acc"])
    assert rm["grad_scale"] > 0.1
    assert rm["step_error"] < 1e-5


def test_rm_evaluation_and_reward_statistics(result):
    rm = result["rm"]
    assert rm["eval"]["eval/pairs"] == 5
    assert rm["eval"]["eval/loss"] == pytest.approx(rm["ref_eval"]["eval/loss"], rel=1e-5)
    assert rm["eval"]["eval/acc"] == pytest.approx(rm["ref_eval"]["eval/acc"])
    # Mean and population std of the 16 chosen and rejected training scores.
    assert rm["stats"] == pytest.approx(rm["ref_stats"], rel=1e-5)
