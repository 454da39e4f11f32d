"""The typed run config: the flags are generated from it, it is the one home of defaults, files and
Python build the same config as flags, and checks run however it is built."""

import dataclasses

import pytest
import yaml

from lightrft.cli import train_ppo, train_rm, train_sft
from lightrft.config import (AlgorithmConfig, ConfigError, PPODataConfig, PPOModelConfig, PPORunConfig, RewardConfig,
                             RMRunConfig, SFTRunConfig)
from lightrft.config.options import flag_fields
from lightrft.trainer.experience_maker import NaiveExperienceMaker

BASE = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "math", "--advantage_estimator",
        "group_norm", "--n_samples_per_prompt", "4"]


@pytest.mark.parametrize("config_cls, module", [(PPORunConfig, train_ppo), (SFTRunConfig, train_sft),
                                                (RMRunConfig, train_rm)])
def test_every_field_is_exactly_one_flag_with_the_fields_default(config_cls, module):
    parser = module.build_parser()
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    fields = {f.name: f for section in config_cls.sections().values() for f in flag_fields(section)}
    assert set(actions) == set(fields)
    for name, field in fields.items():
        default = field.default
        assert actions[name].default == (bool(default) if actions[name].nargs == 0 else default), name


def test_flags_file_and_python_build_the_same_config(tmp_path):
    from_flags = train_ppo.parse_args(BASE + ["--temperature", "0.7", "--eps_clip_low_high", "0.2", "0.28"])
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"pretrain": "m", "data": {"prompt_data": "p.jsonl"},
                                    "rewards": {"remote_rm_url": "math"},
                                    "algorithm": {"advantage_estimator": "group_norm", "n_samples_per_prompt": 4,
                                                  "eps_clip_low_high": [0.2, 0.28]},
                                    "rollout": {"temperature": 0.7}}))
    from_file = train_ppo.parse_args(["--config", str(path)])
    from_python = PPORunConfig(model=PPOModelConfig(pretrain="m"), data=PPODataConfig(prompt_data="p.jsonl"),
                               rewards=RewardConfig(remote_rm_url="math"),
                               algorithm=AlgorithmConfig(advantage_estimator="group_norm", n_samples_per_prompt=4,
                                                         eps_clip_low_high=(0.2, 0.28)))
    from_python = dataclasses.replace(from_python, rollout=dataclasses.replace(from_python.rollout, temperature=0.7))
    assert from_flags == from_file == from_python
    # The nested dump reads back to the same config.
    saved = tmp_path / "run_config.yaml"
    saved.write_text(yaml.safe_dump(from_flags.to_nested()))
    assert train_ppo.parse_args(["--config", str(saved)]) == from_flags


def test_values_derived_from_other_sections_and_flat_access():
    config = train_ppo.parse_args(BASE + ["--generate_max_len", "48", "--max_nonfinite_steps", "7"])
    assert config.algorithm.norm_len == 48 and config.algorithm.max_nonfinite_steps == 7
    assert config.temperature == config.rollout.temperature == 1.0
    assert config.updates_per_step == 512 * 4 // 128
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rollout.temperature = 0.5            # parsed once, never mutated
    with pytest.raises(AttributeError, match="no option 'temprature'"):
        config.temprature


@pytest.mark.parametrize("change, message", [
    (dict(algorithm=AlgorithmConfig(advantage_estimator="group_norm", n_samples_per_prompt=1)),
     "needs --n_samples_per_prompt >= 2"),
    (dict(algorithm=AlgorithmConfig(advantage_estimator="gae")), "needs a critic: pass --critic_pretrain"),
    (dict(rewards=RewardConfig()), "no reward source"),
    (dict(model=PPOModelConfig()), "--pretrain is required"),
])
def test_python_built_configs_get_the_command_lines_errors(change, message):
    values = dict(model=PPOModelConfig(pretrain="m"), data=PPODataConfig(prompt_data="p.jsonl"),
                  rewards=RewardConfig(remote_rm_url="math"),
                  algorithm=AlgorithmConfig(advantage_estimator="group_norm", n_samples_per_prompt=4))
    with pytest.raises(ConfigError, match=message):
        PPORunConfig(**{**values, **change})


def test_layers_share_the_configs_defaults():
    # Before: the experience maker used lambd = 1.0 while the flag defaulted to 0.95.
    import inspect

    maker = inspect.signature(NaiveExperienceMaker.__init__).parameters
    assert maker["lambd"].default == AlgorithmConfig.lambd == 0.95
    assert maker["gamma"].default == AlgorithmConfig.gamma
    assert train_rm.parse_args(["--pretrain", "m", "--dataset", "d"]).learning_rate == 9e-6
    assert train_sft.parse_args(["--pretrain", "m", "--dataset", "d"]).learning_rate == 5e-6
