"""Resuming safely: a corrupted checkpoint is skipped for the previous intact one, a changed model
is refused naming the flag before DeepSpeed reads any state (tests/trainer/resume_checks.py, real
engines in a child process), and a refused resume leaves run_config.yaml as it was."""

import json
import subprocess
import sys

import pytest

from lightrft.cli.common import announce_config
from lightrft.cli.train_ppo import build_parser, parse_args
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from lightrft.strategy import checkpoint_io as cio
from lightrft.trainer.run_services import RunServices
from tests.conftest import REPO_ROOT, subprocess_env


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_checks")
    proc = subprocess.run([sys.executable, "tests/trainer/resume_checks.py", "--root", str(root / "ckpt"),
                           "--out", str(root / "record.json")], cwd=REPO_ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads((root / "record.json").read_text()), root / "ckpt"


def test_a_corrupted_checkpoint_resumes_the_previous_intact_one(resumed):
    record, ckpt = resumed
    assert record["size_kept"]
    # Step 2 holds 3.4e38 in its weights: the resume took step 1, whose weights it restored exactly.
    assert record["resumed_step"] == 1
    assert record["max_diff_to_step1"] == 0.0 and record["max_diff_to_step2"] > 1e-3
    assert record["max_abs_weight"] < 10
    recorded = cio.read_marker(ckpt / "global_step2")["checksums"]["files"]["deepspeed/mp_rank_00_model_states.pt"]
    warning = record["warnings"][0]
    assert warning.startswith(f"checkpoint {ckpt / 'global_step2'} is corrupted: {record['corrupted']} has crc32 ")
    assert f"not the {recorded} recorded when it was saved" in warning
    assert warning.endswith(f"loading {ckpt / 'global_step1'} instead")


def test_a_bigger_model_is_refused_naming_the_flag_or_the_shapes(resumed):
    record, ckpt = resumed
    # Another --pretrain: our check runs before DeepSpeed loads, so the flag is named.
    assert "--pretrain: checkpoint has 'small', this run has 'big'" in record["changed_flag"]
    assert "size mismatch" not in record["changed_flag"]
    # The same --pretrain with a bigger model behind it: DeepSpeed's shapes, said in our words.
    assert record["same_flag"].startswith(f"cannot resume from {ckpt / 'global_step1'}: the model this run built "
                                          "does not have the shapes of the checkpoint")
    assert "torch.Size([100, 32]) from checkpoint" in record["same_flag"]
    assert "torch.Size([100, 48])" in record["same_flag"]


PPO_FLAGS = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "math", "--advantage_estimator",
             "group_norm", "--rollout_batch_size", "8", "--train_batch_size", "32"]


def ppo_checkpoint(ckpt, n_samples: int) -> None:
    """A PPO checkpoint (`_actor/global_step2`) that pinned --n_samples_per_prompt and --pretrain,
    and the run_config.yaml of the run that wrote it."""
    options = {"pretrain": "m", "n_samples_per_prompt": n_samples}
    state = RunServices.client_state({"global_step": 2, "consumed_samples": 16}, options)
    cio.save_checkpoint_dir(ckpt / "_actor", "global_step2", lambda tmp: cio.save_client_state(tmp, 0, state))
    (ckpt / "run_config.yaml").write_text("the run that trained\n")


def test_a_refused_resume_leaves_run_config_yaml_alone(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ppo_checkpoint(ckpt, n_samples=4)
    strategy = DeepspeedStrategy(StrategyConfig())      # rank 0 of a world of one; no process group
    args = parse_args([*PPO_FLAGS, "--n_samples_per_prompt", "8", "--load_checkpoint", "--ckpt_path", str(ckpt)])
    with pytest.raises(ValueError, match="--n_samples_per_prompt: checkpoint has 4, this run has 8") as err:
        announce_config(build_parser(), args, strategy, str(ckpt))
    assert str(ckpt / "_actor" / "global_step2") in str(err.value)
    assert (ckpt / "run_config.yaml").read_text() == "the run that trained\n"
    # The same options resume, and a run that does not resume compares nothing: the file then
    # describes the new run.
    for flags in (["--n_samples_per_prompt", "4", "--load_checkpoint"], ["--n_samples_per_prompt", "8"]):
        args = parse_args([*PPO_FLAGS, *flags, "--ckpt_path", str(ckpt)])
        announce_config(build_parser(), args, strategy, str(ckpt))
        assert f"n_samples_per_prompt: {flags[1]}" in (ckpt / "run_config.yaml").read_text()


def test_a_required_resume_with_nothing_to_load_is_refused_before_anything_is_built(tmp_path):
    """`--load_checkpoint` with no complete checkpoint in --ckpt_path (missing, empty, or holding only
    a save that never finished) stops in announce_config, before any model is built, and writes no
    run_config.yaml; `--load_checkpoint if_present` starts fresh there, and one intact checkpoint in
    a part's folder is enough."""
    strategy = DeepspeedStrategy(StrategyConfig())
    ckpt = tmp_path / "ckpt"
    unfinished = ckpt / "_actor" / ".tmp-global_step1"            # a save killed mid-write
    for make in (lambda: None, lambda: ckpt.mkdir(), lambda: unfinished.mkdir(parents=True)):
        make()
        args = parse_args([*PPO_FLAGS, "--n_samples_per_prompt", "4", "--load_checkpoint", "--ckpt_path", str(ckpt)])
        with pytest.raises(FileNotFoundError, match=f"no complete checkpoint under {ckpt}; pass --load_checkpoint "
                                                    "if_present"):
            announce_config(build_parser(), args, strategy, str(ckpt))
        assert not (ckpt / "run_config.yaml").exists()
    args = parse_args([*PPO_FLAGS, "--n_samples_per_prompt", "4", "--load_checkpoint", "if_present", "--ckpt_path",
                       str(ckpt)])
    announce_config(build_parser(), args, strategy, str(ckpt))
    assert "load_checkpoint: if_present" in (ckpt / "run_config.yaml").read_text()
    ppo_checkpoint(ckpt, n_samples=4)
    args = parse_args([*PPO_FLAGS, "--n_samples_per_prompt", "4", "--load_checkpoint", "--ckpt_path", str(ckpt)])
    announce_config(build_parser(), args, strategy, str(ckpt))


def test_a_resume_accepts_another_spelling_of_the_same_model_folder(tmp_path, monkeypatch):
    """`--pretrain model` saved, `--pretrain ./model` or its absolute path given on resume: the same
    folder, so the resume goes on; another folder is still refused, naming both."""
    from lightrft.trainer.checkpoint import check_resume_options

    (tmp_path / "model").mkdir()
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path)
    check_resume_options({"pretrain": "model", "seed": 1}, {"pretrain": "./model", "seed": 1}, "ckpt")
    check_resume_options({"pretrain": "model"}, {"pretrain": str(tmp_path / "model")}, "ckpt")
    with pytest.raises(ValueError, match="--pretrain: checkpoint has 'model', this run has 'other'"):
        check_resume_options({"pretrain": "model"}, {"pretrain": "other"}, "ckpt")
    with pytest.raises(ValueError, match="--seed: checkpoint has 1, this run has 2"):
        check_resume_options({"pretrain": "model", "seed": 1}, {"pretrain": "model", "seed": 2}, "ckpt")
