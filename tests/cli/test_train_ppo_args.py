"""train_ppo start-up checks: incompatible options are errors that say what to change."""

import pytest

from lightrft.cli.train_ppo import build_parser, parse_args

BASE = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "math"]


def error_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(BASE + argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv,words", [
    (["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "1"], ["--n_samples_per_prompt", "group_norm"]),
    (["--advantage_estimator", "rloo"], ["--n_samples_per_prompt", "rloo"]),
    (["--advantage_estimator", "gae"], ["needs a critic", "--critic_pretrain"]),
    (["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--critic_pretrain", "m"],
     ["does not use a critic"]),
    (["--dynamic_sampling", "--advantage_estimator", "reinforce"], ["--dynamic_sampling", "--n_samples_per_prompt"]),
    (["--ptx_coef", "0.1", "--advantage_estimator", "reinforce"], ["--pretrain_data"]),
    (["--dual_clip", "0.5", "--advantage_estimator", "reinforce"], ["--dual_clip must be > 1"]),
    (["--advantage_estimator", "reinforce", "--rollout_batch_size", "10", "--train_batch_size", "4"],
     ["10 samples per rollout", "--train_batch_size 4"]),
    (["--advantage_estimator", "reinforce", "--micro_train_batch_size", "0"], ["--micro_train_batch_size must be positive"]),
    (["--advantage_estimator", "reinforce", "--vllm_tensor_parallel_size", "0"],
     ["--vllm_tensor_parallel_size must be positive"]),
    (["--advantage_estimator", "nope"], ["invalid choice", "group_norm"]),
    # Before: NaN/inf parsed; --eps_clip nan made every step's loss NaN, all steps were skipped, exit 0.
    (["--advantage_estimator", "reinforce", "--eps_clip", "nan"], ["--eps_clip must be a finite number, got nan"]),
    (["--advantage_estimator", "reinforce", "--actor_learning_rate", "inf"],
     ["--actor_learning_rate must be a finite number, got inf"]),
    (["--advantage_estimator", "reinforce", "--adam_betas", "0.9", "nan"],
     ["--adam_betas must be finite numbers, got (0.9, nan)"]),
    # Before: --ckpt_path "" wrote checkpoints into the working directory without the run lock.
    (["--advantage_estimator", "reinforce", "--ckpt_path", ""], ["--ckpt_path is empty"]),
])
def test_incompatible_options_are_start_up_errors(argv, words, capsys):
    err = error_of(argv, capsys)
    for word in words:
        assert word in err, (word, err)


def test_no_reward_source_is_an_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--pretrain", "m", "--prompt_data", "p", "--advantage_estimator", "reinforce"])
    assert "--reward_pretrain and/or --remote_rm_url" in capsys.readouterr().err


def test_a_consistent_grpo_command_parses():
    args = parse_args(BASE + ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "8",
                              "--eps_clip_low_high", "0.2", "0.28", "--rollout_batch_size", "16",
                              "--train_batch_size", "64", "--load_checkpoint"])
    assert args.eps_clip_low_high == (0.2, 0.28)
    assert args.load_checkpoint == "required"


def test_help_documents_every_flag_once():
    parser = build_parser()
    text = parser.format_help()
    flags = [a.option_strings[-1] for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) == len(set(flags)) > 90
    for flag in flags:
        # Each flag starts exactly one line of the option list, and has help text or a group.
        assert sum(line.lstrip().startswith(flag + " ") or line.strip() == flag
                   for line in text.splitlines() if line.startswith("  -")) == 1, flag
