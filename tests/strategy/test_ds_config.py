"""The pure DeepSpeed config builders, StrategyConfig, optimizer groups and RNG state helpers."""

import argparse
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from lightrft.strategy.config import StrategyConfig
from lightrft.strategy.ds_config import get_eval_ds_config, get_train_ds_config, gradient_accumulation_steps
from lightrft.strategy.param_groups import weight_decay_groups
from lightrft.strategy.seeding import set_seed
from tests.conftest import REPO_ROOT, subprocess_env


def train_config(**overrides):
    kwargs = dict(zero_stage=2, train_batch_size=32, micro_train_batch_size=2, world_size=4)
    kwargs.update(overrides)
    return get_train_ds_config(**kwargs)


@pytest.mark.parametrize("train, micro, world, gas", [(32, 2, 4, 4), (8, 8, 1, 1), (12, 1, 3, 4), (128, 4, 8, 4)])
def test_gradient_accumulation_is_derived(train, micro, world, gas):
    # GAS = train / (micro * world): 32 / (2*4) = 4, 8 / 8 = 1, 12 / 3 = 4, 128 / 32 = 4.
    assert gradient_accumulation_steps(train, micro, world) == gas
    config = train_config(train_batch_size=train, micro_train_batch_size=micro, world_size=world)
    assert config["gradient_accumulation_steps"] == gas
    assert config["train_batch_size"] == config["train_micro_batch_size_per_gpu"] * gas * world


@pytest.mark.parametrize("train, micro, world", [(10, 2, 4), (6, 4, 1), (16, 3, 2), (4, 4, 2)])
def test_non_dividing_batch_sizes_name_all_three(train, micro, world):
    with pytest.raises(ValueError) as err:
        train_config(train_batch_size=train, micro_train_batch_size=micro, world_size=world)
    message = str(err.value)
    assert f"--train_batch_size {train}" in message
    assert f"--micro_train_batch_size {micro}" in message
    assert f"world size {world}" in message


def test_zero_batch_sizes_are_rejected():
    with pytest.raises(ValueError, match="--micro_train_batch_size"):
        gradient_accumulation_steps(8, 0, 1)


@pytest.mark.parametrize("stage", [4, -1, "2", True, None])
def test_unknown_zero_stage_names_flag_and_valid_values(stage):
    for build in (lambda: train_config(zero_stage=stage),
                  lambda: get_eval_ds_config(zero_stage=stage, micro_batch_size=1, world_size=1),
                  lambda: StrategyConfig(zero_stage=stage)):
        with pytest.raises(ValueError) as err:
            build()
        assert "--zero_stage" in str(err.value) and "0, 1, 2, 3" in str(err.value)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("bf16", [False, True])
def test_train_config_stage_precision_and_clipping(stage, bf16):
    config = train_config(zero_stage=stage, bf16=bf16, max_norm=0.5)
    assert config["zero_optimization"]["stage"] == stage
    assert config["bf16"] == {"enabled": bf16}
    assert config["fp16"] == {"enabled": False}
    assert config["gradient_clipping"] == 0.5
    assert "offload_optimizer" not in config["zero_optimization"]
    assert "offload_param" not in config["zero_optimization"]
    assert "data_types" not in config


def test_offload_flags():
    config = train_config(zero_stage=3, adam_offload=True, zero3_param_offload=True, grad_accum_dtype="fp32")
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    assert train_config(zero_stage=1, adam_offload=True)["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    with pytest.raises(ValueError, match="--adam_offload needs ZeRO"):
        train_config(zero_stage=0, adam_offload=True)
    with pytest.raises(ValueError, match="--zero3_param_offload needs --zero_stage 3"):
        train_config(zero_stage=2, zero3_param_offload=True)
    with pytest.raises(ValueError, match="--grad_accum_dtype"):
        train_config(grad_accum_dtype="fp64")
    with pytest.raises(ValueError, match="--max_norm"):
        train_config(max_norm=-1.0)


@pytest.mark.parametrize("stage, offload, expected_stage", [(0, False, 0), (1, False, 0), (2, False, 0), (3, False, 3),
                                                             (2, True, 3), (3, True, 3)])
def test_eval_config_shards_only_under_zero3_or_offload(stage, offload, expected_stage):
    config = get_eval_ds_config(zero_stage=stage, micro_batch_size=4, world_size=2, bf16=True, offload=offload)
    assert config["zero_optimization"]["stage"] == expected_stage
    assert ("offload_param" in config["zero_optimization"]) == offload
    assert config["train_batch_size"] == 8 and config["gradient_accumulation_steps"] == 1
    assert config["bf16"] == {"enabled": True}
    assert "gradient_clipping" not in config


def test_strategy_config_from_args_and_validation():
    args = argparse.Namespace(seed=3, zero_stage=3, bf16=True, train_batch_size=16, micro_train_batch_size=4,
                              dist_timeout=5, unrelated_flag="x")
    config = StrategyConfig.from_args(args)
    assert (config.seed, config.zero_stage, config.bf16, config.train_batch_size, config.micro_train_batch_size) == \
        (3, 3, True, 16, 4)
    assert config.dist_timeout_minutes == 5  # the --dist_timeout flag
    assert config.max_norm == 1.0 and config.adam_offload is False  # defaults for flags not given
    with pytest.raises(ValueError, match="--backend 'mpi'"):
        StrategyConfig(backend="mpi")
    with pytest.raises(ValueError, match="--micro_train_batch_size"):
        StrategyConfig(micro_train_batch_size=0)
    with pytest.raises(ValueError, match="--dist_timeout_minutes"):
        StrategyConfig(dist_timeout_minutes=0)


def test_strategy_config_from_a_run_configs_sections():
    """`get_strategy` reads a run config's distributed and optim sections: the same strategy the
    flat flags of the same command line gave, --dist_timeout included."""
    from lightrft.cli.train_sft import parse_args
    from lightrft.strategy import get_strategy

    config = parse_args(["--pretrain", "m", "--dataset", "d.jsonl", "--seed", "3", "--zero_stage", "3", "--bf16",
                         "--adam_offload", "--zero3_param_offload", "--ref_reward_offload", "--grad_accum_dtype",
                         "fp32", "--dist_timeout", "5", "--train_batch_size", "16", "--micro_train_batch_size", "2",
                         "--max_norm", "0.5"])
    expected = StrategyConfig(seed=3, max_norm=0.5, micro_train_batch_size=2, train_batch_size=16, zero_stage=3,
                              bf16=True, adam_offload=True, zero3_param_offload=True, grad_accum_dtype="fp32",
                              dist_timeout_minutes=5, ref_reward_offload=True)
    assert StrategyConfig.from_sections(config.distributed, config.optim) == expected
    assert StrategyConfig.from_args(argparse.Namespace(**config.to_dict())) == expected
    assert get_strategy(config).config == expected
    assert get_strategy(argparse.Namespace(seed=3)).config == StrategyConfig(seed=3)


def test_weight_decay_skips_biases_and_norms():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2, bias=False))
    model[2].weight.requires_grad_(False)  # frozen parameters are left out
    groups = weight_decay_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [(g["weight_decay"], sorted(names[id(p)] for p in g["params"])) for g in groups] == [
        (0.1, ["0.weight"]), (0.0, ["0.bias", "1.bias", "1.weight"])]


def test_weight_decay_reads_zero3_shape():
    flat = nn.Parameter(torch.zeros(6))  # a ZeRO-3 shard is flat; ds_shape is the real shape
    flat.ds_shape = torch.Size([2, 3])
    module = nn.Module()
    module.register_parameter("proj", flat)
    assert weight_decay_groups(module, 0.1) == [{"params": [flat], "weight_decay": 0.1}]


def test_set_seed_seeds_every_generator():
    values = []
    for _ in range(2):
        set_seed(123)
        values.append((random.random(), np.random.rand(), torch.rand(1).item()))
    assert values[0] == values[1]
    set_seed(124)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) != values[0]


def test_strategy_package_import_is_light():
    code = ("import sys, lightrft, lightrft.strategy; from lightrft.strategy import StrategyConfig; "
            "import lightrft.strategy.ds_config, lightrft.strategy.checkpoint_io, lightrft.utils.distributed_sampler; "
            "print(sorted(m for m in ('deepspeed', 'transformers', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_zero_communication_knobs_reach_deepspeed_and_name_their_flag(capsys):
    """--overlap_comm and the bucket sizes land in the ZeRO section under DeepSpeed's own keys
    (absent: DeepSpeed's defaults); the ZeRO-3 ones are refused below stage 3, naming the flag."""
    from lightrft.cli.train_sft import parse_args
    from lightrft.strategy import get_strategy

    base = ["--pretrain", "m", "--dataset", "d.jsonl", "--train_batch_size", "8", "--micro_train_batch_size", "2"]
    config = parse_args(base + ["--zero_stage", "3", "--overlap_comm", "off", "--zero_reduce_bucket_size", "1000",
                                "--zero3_prefetch_bucket_size", "2000", "--zero3_max_live_parameters", "3000",
                                "--zero3_param_persistence_threshold", "0"])
    zero = get_strategy(config).get_ds_train_config()["zero_optimization"]
    assert {k: zero[k] for k in ("overlap_comm", "reduce_bucket_size", "stage3_prefetch_bucket_size",
                                 "stage3_max_live_parameters", "stage3_param_persistence_threshold")} == {
        "overlap_comm": False, "reduce_bucket_size": 1000, "stage3_prefetch_bucket_size": 2000,
        "stage3_max_live_parameters": 3000, "stage3_param_persistence_threshold": 0}
    plain = get_train_ds_config(zero_stage=3, train_batch_size=8, micro_train_batch_size=2, world_size=1)
    assert not {"overlap_comm", "reduce_bucket_size", "stage3_prefetch_bucket_size"} & set(plain["zero_optimization"])
    on = get_train_ds_config(zero_stage=2, train_batch_size=8, micro_train_batch_size=2, world_size=1,
                             overlap_comm="on")
    assert on["zero_optimization"]["overlap_comm"] is True
    with pytest.raises(SystemExit):
        parse_args(base + ["--zero_stage", "2", "--zero3_prefetch_bucket_size", "2000"])
    assert "--zero3_prefetch_bucket_size applies to --zero_stage 3" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--zero3_max_live_parameters applies to --zero_stage 3"):
        StrategyConfig(zero_stage=2, zero3_max_live_parameters=10)
