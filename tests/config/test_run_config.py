"""The typed run config: the flags are generated from it, it is the one home of defaults, files and
Python build the same config as flags, and checks run however it is built."""

import dataclasses

import pytest
import yaml

from lightrft.cli import train_ppo, train_rm, train_sft
from lightrft.config import (AlgorithmConfig, CheckpointConfig, ConfigError, PPODataConfig, PPOModelConfig,
                             PPOOptimConfig, PPORunConfig, RewardConfig, RMRunConfig, SFTDataConfig, SFTRunConfig)
from lightrft.config.options import flag_fields
from lightrft.experience.maker import NaiveExperienceMaker

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
    # A teacher alone gives no task reward: dynamic sampling would drop every group.
    (dict(rewards=RewardConfig(), model=PPOModelConfig(pretrain="m", teacher_pretrain="t"),
          algorithm=AlgorithmConfig(advantage_estimator="reinforce", n_samples_per_prompt=4, dynamic_sampling=True)),
     "--dynamic_sampling keeps the groups whose task rewards differ, and this run has no task reward"),
    (dict(model=PPOModelConfig()), "--pretrain is required"),
    # A token budget is for packed rows; padded ones cost their longest row times their rows.
    (dict(optim=PPOOptimConfig(micro_train_max_tokens=4096)),
     "--micro_train_max_tokens 4096 budgets the tokens of packed micro-batches: add --packing_samples"),
    (dict(optim=PPOOptimConfig(micro_train_max_tokens=4096), model=PPOModelConfig(pretrain="m", packing_samples=True),
          data=PPODataConfig(prompt_data="p.jsonl", pretrain_data="sft.jsonl"),
          algorithm=AlgorithmConfig(advantage_estimator="group_norm", n_samples_per_prompt=4, ptx_coef=0.1)),
     "--micro_train_max_tokens 4096 changes the number of micro-batches .* PTX batch \\(--ptx_coef 0.1\\)"),
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


def float_fields(config_cls):
    """(section name, field name) of every float or tuple-of-floats flag of a run config."""
    import typing

    from lightrft.config.options import _base_type

    found = []
    for name, section in config_cls.sections().items():
        hints = typing.get_type_hints(section)
        for f in flag_fields(section):
            base, _ = _base_type(hints[f.name])
            if base is float or typing.get_args(base)[:1] == (float,):
                found.append((name, f.name))
    return found


PPO_VALUES = dict(model=PPOModelConfig(pretrain="m"), data=PPODataConfig(prompt_data="p.jsonl"),
                  rewards=RewardConfig(remote_rm_url="math"),
                  algorithm=AlgorithmConfig(advantage_estimator="group_norm", n_samples_per_prompt=4))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_every_float_flag_refuses_nan_and_inf_naming_the_flag(bad):
    # Before: --eps_clip nan parsed, every step's loss was NaN and skipped, and the run exited 0.
    fields = float_fields(PPORunConfig)
    assert ("algorithm", "eps_clip") in fields and ("optim", "adam_betas") in fields and len(fields) > 25
    for section_name, name in fields:
        section = PPO_VALUES.get(section_name) or PPORunConfig.sections()[section_name]()
        value = (bad, 0.95) if name in ("adam_betas", "eps_clip_low_high", "rollout_mask_band") else bad
        with pytest.raises(ConfigError) as info:
            PPORunConfig(**{**PPO_VALUES, section_name: dataclasses.replace(section, **{name: value})})
        assert f"--{name} " in str(info.value), (name, str(info.value))
    for config_cls in (SFTRunConfig, RMRunConfig):
        sections = config_cls.sections()
        values = dict(model=sections["model"](pretrain="m"), data=sections["data"](dataset="d"))
        for section_name, name in float_fields(config_cls):
            section = values.get(section_name) or sections[section_name]()
            value = (bad, 0.95) if name == "adam_betas" else bad
            with pytest.raises(ConfigError, match=f"--{name} "):
                config_cls(**{**values, section_name: dataclasses.replace(section, **{name: value})})


def test_finite_floats_still_parse():
    config = train_ppo.parse_args(BASE + ["--eps_clip", "0.3", "--adam_betas", "0.9", "0.99", "--l2", "0"])
    assert (config.eps_clip, config.adam_betas, config.l2) == (0.3, (0.9, 0.99), 0.0)


@pytest.mark.parametrize("name", ["ckpt_path", "save_path"])
def test_an_empty_checkpoint_or_export_folder_is_refused(name):
    # Before: --ckpt_path "" wrote checkpoints into the working directory, with no run lock.
    for empty in ("", "  "):
        with pytest.raises(ConfigError, match=f"--{name} is empty"):
            CheckpointConfig(**{name: empty})


@pytest.mark.parametrize("template, words", [
    ("Q: {} {x}", ["named field {x}", "exactly one '{}'"]),
    ("Q: {} A: {}", ["2 placeholders", "exactly one '{}'"]),
    ("Q: {0}", ["named field {0}"]),
    ("Q: {!r}", ["exactly one '{}'"]),
    ("Q: {", ["not a valid format string"]),
    ("Question:", ["0 placeholders"]),
])
def test_input_templates_are_checked_when_the_config_is_built(template, words):
    # Before: 'Q: {} {x}' passed parsing and raised KeyError('x') on the first row.
    with pytest.raises(ConfigError) as info:
        SFTDataConfig(dataset="d", input_template=template)
    message = str(info.value)
    assert message.startswith(f"--input_template {template!r}")
    for word in words:
        assert word in message, (word, message)


def test_good_input_templates_pass():
    for template in ("Q: {}\nA: ", "{} -> ", "JSON {{\"q\": \"{}\"}}"):
        assert SFTDataConfig(dataset="d", input_template=template).input_template == template
