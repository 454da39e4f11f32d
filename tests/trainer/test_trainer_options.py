"""PPOTrainer built by hand trains with the options it is given: `algo` unless a classic keyword
overrides it."""

from types import SimpleNamespace

import pytest
import torch

from lightrft.config.sections import AlgorithmConfig
from lightrft.rollout import HFEngine
from lightrft.trainer.ppo_trainer import PPOTrainer


def build(critic=None, **kwargs) -> PPOTrainer:
    config = SimpleNamespace(seed=0, zero_stage=0, bf16=False)
    strategy = SimpleNamespace(config=config, world_size=1, rank=0, device="cpu")
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    return PPOTrainer(strategy, torch.nn.Linear(1, 1), critic, None, None, None, None, None, None, None,
                      tokenizer=tokenizer, rollout_engine=SimpleNamespace(capabilities=HFEngine.capabilities),
                      reward_sources=[lambda queries, prompts, labels: torch.zeros(len(queries))], **kwargs)


def grpo(**fields) -> AlgorithmConfig:
    return AlgorithmConfig(advantage_estimator="group_norm", n_samples_per_prompt=2, **fields)


def test_algo_values_are_the_ones_trained_with():
    algo = grpo(init_kl_coef=0.05, eps_clip=0.3, value_clip=0.4, kl_horizon=500, ptx_coef=0.1, kl_target=6.0)
    trainer = build(algo=algo)
    assert trainer.algo == algo
    assert trainer.kl_ctl.value == 0.05 and trainer.kl_ctl.target == 6.0 and trainer.kl_ctl.horizon == 500
    assert trainer.actor_loss_fn.eps_clip_low == trainer.actor_loss_fn.eps_clip_high == 0.3


def test_an_explicit_classic_keyword_still_overrides_algo():
    trainer = build(algo=grpo(init_kl_coef=0.05, eps_clip=0.3), init_kl_coef=0.002, value_clip=0.5)
    assert (trainer.algo.init_kl_coef, trainer.algo.eps_clip, trainer.algo.value_clip) == (0.002, 0.3, 0.5)
    assert trainer.kl_ctl.value == 0.002


def test_without_algo_the_classic_defaults_apply():
    trainer = build(critic=torch.nn.Linear(1, 1))      # the default estimator, gae, needs one
    algo = trainer.algo
    assert (algo.init_kl_coef, algo.kl_target, algo.kl_horizon, algo.ptx_coef, algo.eps_clip, algo.value_clip) == (
        0.001, None, 10000, 0.0, 0.2, 0.2)
    assert build(critic=torch.nn.Linear(1, 1), eps_clip=0.25).actor_loss_fn.eps_clip_high == pytest.approx(0.25)


# ---------- from_config and the classic constructor build the same trainer ----------

def fingerprint(trainer: PPOTrainer) -> dict:
    """Every option a built trainer acts on, read back from the parts that act on it."""
    services = trainer.experience_services
    return {
        "algo": trainer.algo, "kl": (trainer.kl_ctl.value, getattr(trainer.kl_ctl, "target", None)),
        "clip": (trainer.actor_loss_fn.eps_clip_low, trainer.actor_loss_fn.eps_clip_high),
        "ema_beta": trainer.ema_beta, "epochs": trainer.max_epochs, "max_norm": trainer.max_norm,
        "micro_train": trainer.micro_train_batch_size, "micro_rollout": services.builder.micro_rollout_batch_size,
        "scorer_micro": services.scorer.micro_batch_size, "prompt_max_len": services.generator.prompt_max_len,
        "chat_template": services.generator.apply_chat_template, "seed": services.generator.seed,
        "generate": trainer.generate_kwargs, "packing": trainer.replay_buffer.packing_samples,
        "hf_ckpt": trainer.save_hf_ckpt, "ds_ckpt": trainer.disable_ds_ckpt,
        "grad_ckpt": trainer.gradient_checkpointing, "max_ckpt_num": trainer.services.max_ckpt_num,
        "grace": trainer.services.preemption.grace_seconds, "gap": (trainer.engine_gap.threshold, trainer.engine_gap.action),
        "bucket_mb": trainer.weight_stream.bucket_mb, "estimator": services.builder.estimator,
        "kl_estimator": services.builder.kl_estimator, "sources": len(services.scorer.reward_sources),
    }


def test_from_config_and_the_classic_constructor_build_the_same_trainer():
    from lightrft.cli.train_ppo import parse_args
    from lightrft.trainer.ppo_config import PPOModels

    config = parse_args(["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "math",
                         "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4",
                         "--init_kl_coef", "0.02", "--eps_clip", "0.25", "--ema_beta", "0.9", "--max_epochs", "2",
                         "--max_norm", "0.5", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4",
                         "--prompt_max_len", "64", "--apply_chat_template", "--generate_max_len", "12",
                         "--temperature", "0.7", "--top_p", "0.9", "--top_k", "5", "--save_hf_ckpt",
                         "--max_ckpt_num", "2", "--preemption_grace", "30", "--packing_samples",
                         "--engine_logprob_gap_threshold", "0.3", "--engine_logprob_gap_action", "warn",
                         "--vllm_sync_bucket_mb", "64", "--gradient_checkpointing", "--seed", "0"])
    source = [lambda queries, prompts, labels: torch.zeros(len(queries))]
    strategy = SimpleNamespace(config=SimpleNamespace(seed=0, zero_stage=0, bf16=False), world_size=1, rank=0,
                               device="cpu")
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    engine = SimpleNamespace(capabilities=HFEngine.capabilities)
    actor = torch.nn.Linear(1, 1)
    built = PPOTrainer.from_config(strategy, PPOModels(actor), config, tokenizer=tokenizer, rollout_engine=engine,
                                   reward_sources=source)
    classic = PPOTrainer(strategy, actor, None, None, None, None, None, None, None, None, ema_beta=0.9,
                         micro_train_batch_size=2, micro_rollout_batch_size=4, max_epochs=2, max_norm=0.5,
                         tokenizer=tokenizer, prompt_max_len=64, save_hf_ckpt=True, algo=config.algorithm,
                         rollout_engine=engine, reward_sources=source, packing_samples=True,
                         gradient_checkpointing=True, preemption_grace=30, apply_chat_template=True, max_ckpt_num=2,
                         engine_logprob_gap_threshold=0.3, engine_logprob_gap_action="warn", sync_bucket_mb=64,
                         max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=5)
    earlier = PPOTrainer.from_config(config, strategy, actor, None, None, None, None, None, None, None, None,
                                     tokenizer=tokenizer, rollout_engine=engine, reward_sources=source)
    assert fingerprint(built) == fingerprint(classic) == fingerprint(earlier)
    # and the options are the config's, not defaults that happen to agree
    assert fingerprint(built)["generate"] == {"max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9, "top_k": 5}
    assert (built.ema_beta, built.max_epochs, built.engine_gap.threshold, built.weight_stream.bucket_mb) == (
        0.9, 2, 0.3, 64)
    assert built.algo.init_kl_coef == 0.02 and built.kl_ctl.value == 0.02


def test_from_config_takes_about_a_dozen_parameters_and_reads_sections():
    import inspect

    from lightrft.trainer.ppo_config import PPOTrainerConfig

    named = [p for p in inspect.signature(PPOTrainer.from_config).parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert len(named) <= 13, [p.name for p in named]
    # the sections it reads are sections of the run config, with the same types
    from lightrft.config.run import PPORunConfig

    sections = PPORunConfig.sections()
    for name, section in PPOTrainerConfig.__annotations__.items():
        assert sections[name].__name__ == section if isinstance(section, str) else sections[name] is section


# ---------- the update and checkpoint parts declare what they read ----------

def self_reads(path: str, class_name: str) -> tuple[set[str], set[str], set[str]]:
    """(attributes `self.` reads in the class that it neither defines nor assigns, its declared
    annotations, the attributes it assigns)."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parents[2] / path).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    defined = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    defined |= {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    declared = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and n.value is None}
    defined |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and n.value is not None}
    reads, stores = set(), set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (stores if isinstance(node.ctx, ast.Store) else reads).add(node.attr)
    return reads - defined - stores, declared, stores


@pytest.mark.parametrize("path, name", [("lightrft/trainer/ppo_update.py", "PPOUpdate"),
                                        ("lightrft/trainer/ppo_checkpoints.py", "PPOCheckpoints")])
def test_update_and_checkpoint_parts_read_only_what_they_declare(path, name):
    foreign, declared, _ = self_reads(path, name)
    assert foreign - declared == set(), f"{name} reads undeclared trainer attributes"
    assert declared - foreign == set(), f"{name} declares attributes it never reads"
    # and the trainer sets every one of them
    _, _, set_by_trainer = self_reads("lightrft/trainer/ppo_trainer.py", "PPOTrainer")
    assert declared - set_by_trainer == set()
