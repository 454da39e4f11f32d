"""The optimizer and the gradient clipping the strategy sets up: the multi-tensor AdamW it uses on
CPU makes exactly the per-tensor loop's update, and under ZeRO-0 in fp32 the strategy's own clipping equals DeepSpeed's while
making one all-reduce per optimizer step instead of two."""

import json
import math
from pathlib import Path

import pytest
import torch

from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm
from tests.conftest import run_torchrun

HERE = Path(__file__).parent


def test_cpu_adamw_makes_exactly_the_update_of_the_per_tensor_loop():
    strategy = DeepspeedStrategy(StrategyConfig(seed=0))
    tokenizer = build_char_tokenizer()
    fast_model = build_tiny_causal_lm(tokenizer, arch="qwen2", seed=0)
    loop_model = build_tiny_causal_lm(tokenizer, arch="qwen2", seed=0)
    fast = strategy.create_optimizer(fast_model, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    assert all(group["foreach"] and not group["fused"] for group in fast.param_groups)
    assert {group["weight_decay"] for group in fast.param_groups} == {0.0, 0.1}   # biases and norms undecayed
    # The same parameter groups and options over the other copy, stepped by the per-tensor loop.
    names = {id(p): n for n, p in fast_model.named_parameters()}
    loop_params = dict(loop_model.named_parameters())
    loop = torch.optim.AdamW([{**{k: v for k, v in group.items() if k not in ("params", "fused", "foreach")},
                               "params": [loop_params[names[id(p)]] for p in group["params"]]}
                              for group in fast.param_groups], foreach=False)
    generator = torch.Generator().manual_seed(0)
    initial = {k: v.clone() for k, v in fast_model.state_dict().items()}
    for _ in range(5):
        for p_fast, p_loop in zip(fast_model.parameters(), loop_model.parameters()):
            p_fast.grad = torch.randn(p_fast.shape, generator=generator)
            p_loop.grad = p_fast.grad.clone()
        fast.step()
        loop.step()
    moved = max((fast_model.state_dict()[k] - initial[k]).abs().max().item() for k in initial)
    gap = max((fast_model.state_dict()[k] - loop_model.state_dict()[k]).abs().max().item() for k in initial)
    assert moved > 1e-2                     # five steps of lr 1e-2 moved the weights ...
    assert gap == 0.0                       # ... and both optimizers moved them alike, to the bit


@pytest.fixture(scope="module")
def clip_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("clip")
    run_torchrun([HERE / "dist_clip.py", "--out", out], nproc=2)
    return out, [{r["name"]: r for r in json.loads((out / f"clip_rank{rank}.json").read_text())} for rank in (0, 1)]


@pytest.mark.dist
def test_zero0_clipping_by_the_strategy_equals_deepspeeds(clip_runs):
    out, ranks = clip_runs
    for rank, records in enumerate(ranks):
        ours, theirs = records["strategy"], records["deepspeed"]
        assert ours["ds_gradient_clipping"] == 0.0 and theirs["ds_gradient_clipping"] == 0.05
        # The norm of the averaged gradients, as DeepSpeed's path measured it independently in float64,
        # is the one the strategy clipped with; it is above max_norm, so every step clipped.
        assert ours["grad_norms"] == pytest.approx(theirs["reference_norms"], rel=1e-5)
        assert min(ours["grad_norms"]) > 0.05 * 10
        # One all-reduce per optimizer step (the gradients') instead of two (gradients, then norms).
        assert ours["all_reduces"] == [1, 1, 1] and theirs["all_reduces"] == [2, 2, 2]
    mine, reference = torch.load(out / "strategy.pt"), torch.load(out / "deepspeed.pt")
    initial = build_tiny_causal_lm(build_char_tokenizer(), arch="qwen2", seed=0).state_dict()
    moved = max((reference[k] - initial[k]).abs().max().item() for k in reference)
    gap = max((mine[k] - reference[k]).abs().max().item() for k in reference)
    # SGD moves each weight by lr x clipped gradient: equal up to rounding. Without clipping, the
    # first step alone would move them ~30x further (norm 1.6 against max_norm 0.05).
    assert moved > 1e-3 and gap < 1e-4 * moved


@pytest.mark.dist
@pytest.mark.parametrize("name", ["nan", "nan_unclipped"])
def test_zero0_fp32_skips_a_step_whose_gradient_is_not_finite(clip_runs, name):
    """Under ZeRO-0 in fp32 DeepSpeed steps the plain torch optimizer, which would write rank 1's NaN
    gradient into every rank's weights; the strategy skips that step as DeepSpeed's own optimizers do.
    Both with clipping on and with `max_norm` 0 (no clipping to measure a norm for)."""
    _, ranks = clip_runs
    for records in ranks:
        run = records[name]
        norms = run["grad_norms"]
        assert math.isfinite(norms[0]) and math.isnan(norms[1]) and math.isfinite(norms[2])
        # The skipped step leaves the weights exactly as they were; the steps around it train.
        assert run["moved"][0] > 1e-3 and run["moved"][1] == 0.0 and run["moved"][2] > 1e-3
        assert run["finite"] == [True, True, True]
        # DeepSpeed counts it as skipped and does not advance the learning-rate schedule.
        assert run["skipped_steps"] == [0, 1, 1]
        assert run["scheduler_steps"] == [1, 1, 2]
    # The first step, before the NaN, is the clipped step of the strategy's run to the bit.
    assert ranks[0]["nan"]["grad_norms"][0] == ranks[0]["strategy"]["grad_norms"][0]
    assert ranks[0]["nan_unclipped"]["grad_norms"][0] == pytest.approx(ranks[0]["strategy"]["grad_norms"][0], rel=1e-6)
