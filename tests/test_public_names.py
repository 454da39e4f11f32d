"""The public names of DESIGN.md keep working: imports, call conventions and defaults; names that
moved keep their old imports."""

import inspect
import subprocess
import sys

import torch

from tests.conftest import REPO_ROOT, subprocess_env


def test_import_lightrft_stays_light():
    code = ("import sys, lightrft, lightrft.models, lightrft.trainer, lightrft.algorithms; "
            "heavy = [m for m in ('deepspeed', 'vllm', 'transformers') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_design_imports():
    from lightrft.models import ActorLanguage, GPTLMLoss, PolicyLoss, ValueLoss  # noqa: F401
    from lightrft.models.utils import compute_approx_kl, masked_mean, unpacking_samples  # noqa: F401
    from lightrft.trainer import (AdaptiveKLController, Experience, FixedKLController,  # noqa: F401
                                  NaiveExperienceMaker, NaiveReplayBuffer, PPOTrainer)
    from lightrft.utils.distributed_sampler import DistributedSampler

    assert "consumed_samples" in inspect.signature(DistributedSampler.set_epoch).parameters


def test_ppo_trainer_signature_matches_design():
    from lightrft.trainer import PPOTrainer

    params = inspect.signature(PPOTrainer.__init__).parameters
    positional = ["strategy", "actor", "critic", "reward_model", "initial_model", "ema_model", "actor_optim",
                  "critic_optim", "actor_scheduler", "critic_scheduler"]
    assert list(params)[1:11] == positional
    # The classic PPO options default to None: they take `algo`'s value, and without `algo` the design's
    # 0.001, None, 10000, 0, 0.2, 0.2 (tests/trainer/test_trainer_options.py checks the values trained with).
    defaults = dict(ema_beta=0.992, init_kl_coef=None, kl_target=None, kl_horizon=None, ptx_coef=None,
                    micro_train_batch_size=8, buffer_limit=0, buffer_cpu_offload=True, eps_clip=None, value_clip=None,
                    micro_rollout_batch_size=8, gradient_checkpointing=False, max_epochs=1, max_norm=1.0,
                    tokenizer=None, prompt_max_len=128, dataloader_pin_memory=True, remote_rm_url=None,
                    reward_fn=None, save_hf_ckpt=False, disable_ds_ckpt=False)
    for name, value in defaults.items():
        assert params[name].default == value, name
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())   # **generate_kwargs
    fit = list(inspect.signature(PPOTrainer.fit).parameters)
    assert fit[1:6] == ["args", "prompts_dataloader", "pretrain_dataloader", "consumed_samples",
                        "num_update_steps_per_episodes"]
    for method in ("ppo_train", "training_step", "training_step_actor", "training_step_critic",
                   "save_logs_and_checkpoints"):
        assert callable(getattr(PPOTrainer, method))


def test_loss_fronts_call_conventions():
    from lightrft.models import PolicyLoss, ValueLoss
    from lightrft.models.utils import compute_approx_kl, masked_mean

    logp = torch.tensor([[-1.0, -2.0]])
    old = torch.tensor([[-1.0, -2.0]])
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.tensor([[1, 1]])
    # ratio 1 everywhere: loss = -mean(A) = -(1 - 1) / 2 = 0
    assert PolicyLoss(0.2)(logp, old, adv, action_mask=mask).item() == 0.0
    values, returns = torch.tensor([[0.5, 1.0]]), torch.tensor([[1.5, 1.0]])
    # 0.5 * mean((v - R)^2) = 0.5 * (1 + 0) / 2 = 0.25
    assert ValueLoss(0.2)(values, values, returns, action_mask=mask).item() == 0.25
    assert masked_mean(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([1, 1, 0]), dim=None).item() == 2.0
    kl = compute_approx_kl(torch.tensor([[0.5]]), torch.tensor([[0.25]]), torch.tensor([[1]]), kl_estimator="k2")
    assert kl.item() == 0.25 ** 2 / 2


def test_names_moved_down_a_layer_keep_their_old_imports():
    """The tokenizer builder and `RewardBatch` moved below the packages that use them
    (tests/test_layering.py); research code importing them from their old homes still gets them."""
    from lightrft.builders import build_tokenizer as from_facade
    from lightrft.builders.tokenizer import build_tokenizer, stop_token_ids
    from lightrft.experience.maker import RewardBatch as from_maker
    from lightrft.experience.scorer import RewardBatch as from_scorer
    from lightrft.models import tokenizer
    from lightrft.rewards.batch import RewardBatch

    assert from_facade is build_tokenizer is tokenizer.build_tokenizer
    assert stop_token_ids is tokenizer.stop_token_ids
    assert from_maker is from_scorer is RewardBatch
