"""Numbers outside what an option means are refused at parse time, naming the flag, its bounds and
its purpose; the same check runs when research code builds a config in Python. Every default is
inside its own bounds, the "off" value of a step option stays allowed, and --help shows the bounds."""

import dataclasses

import pytest

from lightrft.cli import serve, train_ppo, train_sft
from lightrft.config import CheckpointConfig, ConfigError, PPORunConfig, RMRunConfig, SFTRunConfig
from lightrft.config.options import bound_problem, flag_fields
from lightrft.serving.http import HTTPSettings

BASE = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "math", "--advantage_estimator",
        "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "8", "--train_batch_size", "32",
        "--micro_rollout_batch_size", "8"]

ABSURD = [("seed", "-1", ">= 0 and <= 4294967295"), ("seed", str(2**64), ">= 0 and <= 4294967295"), ("dist_timeout", "0", ">= 1"),
          ("lora_rank", "-1", ">= 0"), ("lora_alpha", "0", ">= 1"), ("lora_dropout", "1.0", ">= 0 and < 1"),
          ("max_samples", "0", ">= 1"), ("max_norm", "-1", ">= 0"), ("lr_warmup_ratio", "1.5", ">= 0 and <= 1"),
          ("l2", "-0.1", ">= 0"), ("logging_steps", "0", ">= 1"), ("save_steps", "0", "-1 (off) or >= 1"),
          ("max_ckpt_num", "0", ">= 1"), ("preemption_grace", "-1", "> 0"), ("max_nonfinite_steps", "0", ">= 1"),
          ("ema_beta", "1.5", ">= 0 and < 1"), ("temperature", "-1", ">= 0"), ("top_p", "0", "> 0 and <= 1"), ("top_k", "-2", ">= -1"),
          ("vllm_gpu_memory_utilization", "1.5", "> 0 and <= 1"), ("vllm_kv_cache_gb", "0", "> 0"),
          ("vllm_sync_bucket_mb", "0", "> 0"), ("eps_clip", "-0.1", "> 0"), ("value_clip", "-1", "> 0"),
          ("tis_cap", "0", "> 0"), ("init_kl_coef", "-1", ">= 0"), ("kl_target", "-1", "> 0"),
          ("kl_horizon", "0", ">= 1"), ("gamma", "1.5", ">= 0 and <= 1"), ("lambd", "-0.5", ">= 0 and <= 1"),
          ("max_sampling_rounds", "0", ">= 1"), ("overlong_buffer_len", "-1", ">= 0"),
          ("overlong_penalty_factor", "-1", ">= 0"), ("freezing_actor_steps", "-2", ">= -1"),
          ("max_steps", "0", "-1 (off) or >= 1"), ("actor_learning_rate", "-1e-6", ">= 0"),
          ("eval_steps", "0", "-1 (off) or >= 1"), ("eval_n_samples", "0", ">= 1"), ("reward_timeout", "0", "> 0"),
          ("reward_retries", "-1", ">= 0"), ("preview_steps", "-1", ">= 0"), ("ptx_coef", "-1", ">= 0")]


@pytest.mark.parametrize("flag, value, wanted", ABSURD)
def test_an_absurd_value_is_refused_naming_the_flag_and_its_bounds(flag, value, wanted, capsys):
    with pytest.raises(SystemExit):
        train_ppo.parse_args(BASE + [f"--{flag}={value}"])
    err = capsys.readouterr().err
    assert f"--{flag} must be {wanted}" in err and "Traceback" not in err, err


@pytest.mark.parametrize("betas", [["2", "2"], ["0.9", "1"], ["-0.1", "0.95"]])
def test_adam_betas_outside_zero_one_are_refused_naming_the_flag(betas, capsys):
    # Before: `--adam_betas 2 2` parsed and the run died in torch.optim.Adam with a traceback.
    for parse, base in ((train_ppo.parse_args, BASE), (train_sft.parse_args, ["--pretrain", "m", "--dataset", "d"])):
        with pytest.raises(SystemExit):
            parse(base + ["--adam_betas", *betas])
        err = capsys.readouterr().err
        assert "--adam_betas must be two numbers in [0, 1)" in err and "Traceback" not in err, err
    assert train_ppo.parse_args(BASE + ["--adam_betas", "0", "0.999"]).adam_betas == (0.0, 0.999)


def test_off_values_and_bounds_themselves_are_accepted():
    config = train_ppo.parse_args(BASE + ["--save_steps", "-1", "--max_steps", "1", "--top_k", "-1", "--top_p", "1",
                                          "--temperature", "0", "--gamma", "1", "--lora_dropout", "0",
                                          "--seed", str(2**32 - 1)])
    assert (config.save_steps, config.max_steps, config.top_k, config.seed) == (-1, 1, -1, 2**32 - 1)


@pytest.mark.parametrize("config_cls", [PPORunConfig, SFTRunConfig, RMRunConfig])
def test_every_default_is_inside_its_bounds(config_cls):
    bounded = 0
    for section in config_cls.sections().values():
        for f in flag_fields(section):
            if f.metadata.get("bounds"):
                bounded += 1
                assert bound_problem(f, f.default) is None, f.name
    assert bounded >= 10


def test_python_built_configs_get_the_same_check():
    with pytest.raises(ConfigError, match=r"--max_ckpt_num must be >= 1, got 0 \(.*checkpoints"):
        dataclasses.replace(train_ppo.parse_args(BASE), checkpoint=CheckpointConfig(max_ckpt_num=0))


def test_help_shows_the_bounds(capsys):
    with pytest.raises(SystemExit):
        train_sft.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "[>= 1]" in out and "[-1 (off) or >= 1]" in out


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-3"])
def test_serving_intervals_must_be_finite_and_positive(value, capsys):
    with pytest.raises(ValueError, match="--request_timeout must be a positive number of seconds"):
        HTTPSettings(request_timeout=float(value))
    with pytest.raises(SystemExit):
        serve.main(["--pretrain", "m", "--watch", "w", "--watch_interval", value])
    assert "--watch_interval must be a positive number of seconds" in capsys.readouterr().err
