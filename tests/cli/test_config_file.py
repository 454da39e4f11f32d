"""`--config FILE.yaml`: the file sets flag values, the command line overrides them, mistakes name
the file and key, and the resolved config a run writes reads back to the same options."""

import pytest
import yaml

from lightrft.cli import train_ppo, train_rm, train_sft
from lightrft.cli.common import announce_config, resolved_config


class Rank0:
    @staticmethod
    def is_rank_0():
        return True


def write(tmp_path, values) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def test_the_file_sets_flags_and_the_command_line_wins(tmp_path):
    config = write(tmp_path, {"pretrain": "m", "prompt_data": "p.jsonl", "remote_rm_url": "math",
                              "advantage_estimator": "group_norm", "n_samples_per_prompt": 4, "use_kl_loss": True,
                              "eps_clip_low_high": [0.2, 0.28], "actor_learning_rate": "2e-6",
                              "rollout_batch_size": 8, "train_batch_size": 32})
    args = train_ppo.parse_args(["--config", config, "--n_samples_per_prompt", "8", "--train_batch_size", "64"])
    assert (args.pretrain, args.prompt_data, args.advantage_estimator) == ("m", "p.jsonl", "group_norm")
    assert args.use_kl_loss is True and args.eps_clip_low_high == (0.2, 0.28)
    assert args.actor_learning_rate == 2e-6          # converted as the flag converts its text
    assert args.n_samples_per_prompt == 8 and args.train_batch_size == 64     # the command line wins


@pytest.mark.parametrize("values, message", [
    ({"pretrain": "m", "prompt_data": "p", "remote_rm_url": "math", "n_sample_per_prompt": 4},
     "unknown key 'n_sample_per_prompt' (did you mean --n_samples_per_prompt"),
    ({"pretrain": "m", "prompt_data": "p", "remote_rm_url": "math", "rollout_batch_size": "many"},
     "key 'rollout_batch_size' has the value 'many'"),
    ({"pretrain": "m", "prompt_data": "p", "remote_rm_url": "math", "advantage_estimator": "ppo2"},
     "key 'advantage_estimator' must be one of"),
    ({"pretrain": "m", "prompt_data": "p", "remote_rm_url": "math", "bf16": "yes"},
     "key 'bf16' has the value 'yes'"),
    (["not", "a", "mapping"], "expected a mapping of flag names to values"),
])
def test_mistakes_in_the_file_name_the_file_and_the_key(tmp_path, capsys, values, message):
    config = write(tmp_path, values)
    with pytest.raises(SystemExit):
        train_ppo.parse_args(["--config", config])
    err = capsys.readouterr().err
    assert f"--config {config}" in err and message in err


@pytest.mark.parametrize("text, message", [
    # YAML keeps the last of two equal keys silently: the option written first would be lost.
    ("pretrain: m\nprompt_data: p\nremote_rm_url: math\neps_clip: 0.1\neps_clip: 0.3\n",
     "key 'eps_clip' appears twice (lines 4 and 5)"),
    ("model:\n  pretrain: m\n  pretrain: n\n", "key 'pretrain' appears twice"),
    # A misspelt section was read as if it were one, whatever it was called.
    ("pretrain: m\nprompt_data: p\nremote_rm_url: math\nalgorythm:\n  eps_clip: 0.3\n",
     "'algorythm' is no section of the options (sections: distributed, model, rollout, algorithm"),
    ("pretrain: m\nprompt_data: p\nremote_rm_url: math\neps_clip: 0.2\nalgorithm:\n  eps_clip: 0.3\n",
     "--eps_clip is given twice"),
])
def test_repeated_keys_and_unknown_sections_are_refused(tmp_path, capsys, text, message):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit):
        train_ppo.parse_args(["--config", str(config)])
    err = capsys.readouterr().err
    assert f"--config {config}" in err and message in err and "Traceback" not in err, err


def test_a_missing_file_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_ppo.parse_args(["--config", str(tmp_path / "nope.yaml")])
    assert "nope.yaml: cannot read it" in capsys.readouterr().err


def test_a_file_that_is_not_utf8_is_named(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("pretrain: mod\xe8le\n".encode("latin-1"))
    with pytest.raises(SystemExit):
        train_ppo.parse_args(["--config", str(path)])
    err = capsys.readouterr().err
    assert f"--config {path}: byte 13 (0xe8) is not UTF-8 text" in err and "Traceback" not in err


@pytest.mark.parametrize("module, required", [
    (train_ppo, {"pretrain": "m", "prompt_data": "p.jsonl", "remote_rm_url": "math",
                 "advantage_estimator": "group_norm", "n_samples_per_prompt": 2}),
    (train_sft, {"pretrain": "m", "dataset": "d.jsonl"}),
    (train_rm, {"pretrain": "m", "dataset": "d.jsonl"}),
])
def test_the_written_config_reads_back_to_the_same_options(tmp_path, capsys, module, required):
    args = module.parse_args(["--config", write(tmp_path, required), "--seed", "7"])
    announce_config(module.build_parser(), args, Rank0(), str(tmp_path / "ckpt"))
    printed = capsys.readouterr().out
    assert '"seed": 7' in printed and '"pretrain": "m"' in printed     # what differs from the defaults
    again = module.parse_args(["--config", str(tmp_path / "ckpt" / "run_config.yaml")])
    # Compared as resolved values: a two-value flag is a list whether it came from a file or the command line.
    assert {k: v for k, v in resolved_config(again).items() if k != "config"} == \
        {k: v for k, v in resolved_config(args).items() if k != "config"}


PPO_REQUIRED = {"pretrain": "m", "prompt_data": "p.jsonl", "remote_rm_url": "math",
                "advantage_estimator": "group_norm", "n_samples_per_prompt": 4}


@pytest.mark.parametrize("key, value, expected", [
    # Before: int() and str() turned these into 2, 1, 1 and "{'n': 4}" without a word.
    ("rollout_batch_size", 2.9, "an integer"),
    ("n_samples_per_prompt", True, "an integer"),
    ("n_samples_per_prompt", "4.5", "an integer"),
    ("pretrain", {"n": 4}, "a string"),
    ("remote_rm_url", ["math", "format"], "a string"),
    ("wandb_project", False, "a string"),
    ("eps_clip", True, "a number"),
    ("eps_clip", [0.2], "a number"),
    ("use_kl_loss", "yes", "true or false"),
    ("use_kl_loss", 1, "true or false"),
    ("eps_clip_low_high", [0.2], "a list of 2 numbers"),
    ("eps_clip_low_high", [0.2, "high"], "a list of 2 numbers"),
    ("adam_betas", 0.9, "a list of 2 numbers"),
    ("ckpt_path", None, "a string"),
])
def test_values_of_the_wrong_type_are_refused_naming_the_type(tmp_path, capsys, key, value, expected):
    config = write(tmp_path, {**PPO_REQUIRED, key: value})
    with pytest.raises(SystemExit):
        train_ppo.parse_args(["--config", config])
    err = capsys.readouterr().err
    assert f"--config {config}: key {key!r} has the value {value!r}, but --{key} takes {expected}" in err, err


def test_values_the_command_line_would_take_are_converted(tmp_path):
    config = write(tmp_path, {**PPO_REQUIRED, "rollout_batch_size": 8.0, "train_batch_size": "32",
                              "use_kl_loss": "True", "bf16": "false", "eps_clip": 1, "wandb_run_name": 2024,
                              "target_modules": "q_proj", "kl_target": None})
    args = train_ppo.parse_args(["--config", config])
    assert (args.rollout_batch_size, args.train_batch_size) == (8, 32)
    assert type(args.rollout_batch_size) is int and type(args.eps_clip) is float and args.eps_clip == 1.0
    assert (args.use_kl_loss, args.bf16, args.wandb_run_name) == (True, False, "2024")
    assert args.target_modules == ("q_proj",) and args.kl_target is None


def test_non_finite_values_in_the_file_are_refused(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("pretrain: m\nprompt_data: p.jsonl\nremote_rm_url: math\nadvantage_estimator: reinforce\n"
                      "eps_clip: .nan\n")
    with pytest.raises(SystemExit):
        train_ppo.parse_args(["--config", str(config)])
    assert "--eps_clip must be a finite number, got nan" in capsys.readouterr().err
