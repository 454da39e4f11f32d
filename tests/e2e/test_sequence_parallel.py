"""`--sequence_parallel_size 2` on two ranks trains what one replica trains unsplit: the same
rollouts, losses, entropy, KL, gradient norms and final weights as two data-parallel ranks, under
ZeRO-2, under ZeRO-3 with gradient checkpointing, and with a critic (GAE: the value loss too); and
its refusal names the flag to change (split rows with images: tests/e2e/test_vlm.py)."""

import pytest
import torch

from lightrft.cli import train_ppo
from tests.conftest import run_torchrun, run_torchrun_many
from tests.e2e.conftest import grpo_flags, summary_line, tensorboard_scalars

# One optimizer step per rollout (train batch = the rollout's 256 samples), so the data-parallel
# and the sequence-parallel runs sum the same samples into each step; entropy and a KL loss
# against the reference exercise every gathered per-token term.
COMMON = {"max_steps": 2, "train_batch_size": 256, "packing_samples": True, "entropy_coef": 0.01,
          "init_kl_coef": 0.01, "use_kl_loss": True, "kl_estimator": "k3"}
GAE = {"advantage_estimator": "gae", "critic_learning_rate": 1e-3}
AHEAD = {"sync_offset": 1, "tis_cap": 2.0}
MOE = {"aux_loss_coef": 1.0, "pretrain": "{moe}"}
RUNS = {"data_parallel": {}, "split_zero2": {"sequence_parallel_size": 2},
        "split_zero3": {"sequence_parallel_size": 2, "zero_stage": 3, "gradient_checkpointing": True},
        "gae_data_parallel": GAE, "gae_split": {**GAE, "sequence_parallel_size": 2},
        # An explorer thread per rank one step ahead: the split trains what the explorers made.
        "ahead_data_parallel": AHEAD, "ahead_split": {**AHEAD, "sequence_parallel_size": 2},
        # A mixture-of-experts policy with its load-balancing loss: router statistics of the group.
        "moe_data_parallel": MOE, "moe_split": {**MOE, "sequence_parallel_size": 2}}
TAGS = ("train/policy_loss", "train/entropy", "train/kl_loss", "train/actor_grad_norm")

pytestmark = pytest.mark.dist


def tiny_moe(toy_model, out):
    """A random Qwen3-MoE policy (4 experts, top 2; 2 query and 2 key/value heads, so a row splits
    over 2 ranks) with the toy task's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    tokenizer = AutoTokenizer.from_pretrained(toy_model)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=2, head_dim=32, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=64, max_position_embeddings=512,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def runs(toy, tmp_path_factory):
    root = tmp_path_factory.mktemp("sequence_parallel")
    critic = {"critic_pretrain": toy["model"]}
    moe = tiny_moe(toy["model"], root / "moe_model")
    flags = [grpo_flags(toy, root / name, **{**COMMON, **(critic if "gae" in name else {}),
                                             **{k: (moe if v == "{moe}" else v) for k, v in extra.items()}})
             for name, extra in RUNS.items()]
    # Saved after step 1 with the row split over 2 ranks, resumed unsplit for step 2.
    flags += [grpo_flags(toy, root / "resumed", **{**COMMON, "max_steps": 1, "save_steps": 1,
                                                   "sequence_parallel_size": 2}),
              grpo_flags(toy, root / "resumed", **{**COMMON, "load_checkpoint": True})]
    outputs = run_torchrun_many(flags, root)
    return {name: (root / name, output) for name, output in zip([*RUNS, "saved", "resumed"], outputs)}


@pytest.mark.parametrize("name", ["split_zero2", "split_zero3", "gae_split", "ahead_split"])
def test_a_split_run_trains_like_the_data_parallel_one(runs, name):
    from safetensors.torch import load_file

    reference, _ = runs[name.split("_")[0] + "_data_parallel" if name.startswith(("gae", "ahead", "moe"))
                        else "data_parallel"]
    out, stdout = runs[name]
    assert summary_line(stdout)["step"] == 2
    expected = {t: dict(s) for t, s in tensorboard_scalars(reference / "tb").items()}
    got = {t: dict(s) for t, s in tensorboard_scalars(out / "tb").items()}
    assert got["rollout/reward"] == expected["rollout/reward"]          # the same samples
    extra_tags = (("train/critic_loss",) if "gae" in name else ()) + (("train/aux_loss",) if "moe" in name else ())
    for tag in TAGS + extra_tags:
        for step in (1, 2):
            assert got[tag][step] == pytest.approx(expected[tag][step], rel=1e-4, abs=1e-6), (tag, step)
    assert expected["train/actor_grad_norm"][1] > 0.1 and expected["train/kl_loss"][2] > 1e-3
    if name == "ahead_split":       # step 2 trained batch 1, made by the explorers from version 0
        assert dict(tensorboard_scalars(out / "tb")["rollout/staleness_max"]) == {1: 0.0, 2: 1.0}
    final, split = load_file(reference / "model" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    # Two Adam steps at lr 1e-3 move a weight by up to 2e-3; Adam's per-element normalisation turns
    # the reduction-order rounding of a near-zero gradient entry into up to ~2e-5 of it, by CPU
    # (2.1e-5 seen for ZeRO-3 against ZeRO-2 on a 2-core x86 runner). A wrong split is ~1e-3 off.
    assert max((final[k] - split[k]).abs().max().item() for k in final) < 5e-5


def test_a_split_moe_run_trains_with_the_rows_load_balancing_loss(runs):
    """--aux_loss_coef with a split row: each rank's load-balancing loss is its row's (router
    statistics summed over the group) and its gradient part counts once per row. The loss, weighted
    1.0 here, dominates the gradient: a rank's own statistics give a loss 4% off, and the row's
    parts not scaled to rows halve the gradient norm."""
    reference, _ = runs["moe_data_parallel"]
    out, stdout = runs["moe_split"]
    assert summary_line(stdout)["step"] == 2
    expected = {t: dict(s) for t, s in tensorboard_scalars(reference / "tb").items()}
    got = {t: dict(s) for t, s in tensorboard_scalars(out / "tb").items()}
    assert got["rollout/reward"] == expected["rollout/reward"]
    for step in (1, 2):
        assert expected["train/aux_loss"][step] > 1.0
        for tag in ("train/policy_loss", "train/entropy", "train/kl_loss"):
            assert got[tag][step] == pytest.approx(expected[tag][step], rel=1e-4, abs=1e-6), (tag, step)
        # Float rounding of the split attention can flip a near-tie top-2 choice of the router,
        # which moves the loss by ~1e-4 of itself (measured 8e-5 and 6e-6; grad norm 5e-5, 2e-4).
        for tag in ("train/aux_loss", "train/actor_grad_norm"):
            assert got[tag][step] == pytest.approx(expected[tag][step], rel=1e-3), (tag, step)


def test_a_split_run_resumes_unsplit(runs):
    from safetensors.torch import load_file

    reference, _ = runs["data_parallel"]
    out, stdout = runs["resumed"]
    assert "resumed from" in stdout and summary_line(stdout)["step"] == 2
    expected = {t: dict(s) for t, s in tensorboard_scalars(reference / "tb").items()}
    got = {t: dict(s) for t, s in tensorboard_scalars(out / "tb").items()}
    assert got["rollout/reward"][2] == expected["rollout/reward"][2]
    assert got["train/actor_grad_norm"][2] == pytest.approx(expected["train/actor_grad_norm"][2], rel=1e-4)
    final, resumed = load_file(reference / "model" / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    assert max((final[k] - resumed[k]).abs().max().item() for k in final) < 2e-5


def test_a_group_that_does_not_divide_the_ranks_is_refused(toy, tmp_path):
    proc = run_torchrun(["lightrft.cli.train_ppo", *grpo_flags(toy, tmp_path, sequence_parallel_size=2,
                                                                 packing_samples=True)],
                        nproc=1, module=True, check=False)
    assert proc.returncode != 0
    assert "--sequence_parallel_size 2 must divide the number of ranks (1)" in proc.stdout + proc.stderr


BASE = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "math", "--advantage_estimator",
        "group_norm", "--n_samples_per_prompt", "4", "--sequence_parallel_size", "2"]


def test_a_split_run_without_packing_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        train_ppo.parse_args(BASE)
    assert "--sequence_parallel_size 2 splits packed rows: add --packing_samples" in capsys.readouterr().err
    train_ppo.parse_args(BASE + ["--packing_samples", "--image_key", "image"])      # images split too
