"""PPOTrainer built by hand trains with the options it is given: `algo` unless a classic keyword
overrides it."""

from types import SimpleNamespace

import pytest
import torch

from lightrft.config.sections import AlgorithmConfig
from lightrft.rollout import HFEngine
from lightrft.trainer.ppo_trainer import PPOTrainer


TOKENIZER = SimpleNamespace(pad_token_id=0, eos_token_id=1)
ENGINE = SimpleNamespace(capabilities=HFEngine.capabilities)
SOURCES = [lambda queries, prompts, labels: torch.zeros(len(queries))]


def build_args(actor=None, critic=None) -> tuple:
    """The classic positionals: a one-rank strategy stand-in, the actor, the critic, no other model."""
    config = SimpleNamespace(seed=0, zero_stage=0, bf16=False)
    strategy = SimpleNamespace(config=config, world_size=1, rank=0, device="cpu", unwrap_model=lambda model: model)
    return (strategy, actor if actor is not None else torch.nn.Linear(1, 1), critic, *[None] * 7)


def build(critic=None, **kwargs) -> PPOTrainer:
    return PPOTrainer(*build_args(critic=critic), tokenizer=TOKENIZER, rollout_engine=ENGINE, reward_sources=SOURCES,
                      **kwargs)


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
        "overlong": (services.scorer.overlong_buffer_len, services.scorer.overlong_penalty_factor),
        "on_policy": trainer.on_policy(), "processor": trainer.processor,
        "eval_generate": trainer.eval_generate_kwargs, "buffer_limit": trainer.replay_buffer.limit,
    }


def test_from_config_and_the_classic_constructor_build_the_same_trainer():
    from lightrft.cli.train_ppo import parse_args
    from lightrft.trainer.assembly import build_ppo_parts
    from lightrft.trainer.ppo_config import PPOModels, rollout_generate_kwargs

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
                               device="cpu", unwrap_model=lambda model: model)
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    engine = SimpleNamespace(capabilities=HFEngine.capabilities)
    actor = torch.nn.Linear(1, 1)
    processor = SimpleNamespace(name="a vision-language processor")
    built = PPOTrainer.from_config(strategy, PPOModels(actor), config, tokenizer=tokenizer, rollout_engine=engine,
                                   reward_sources=source, processor=processor)
    classic = PPOTrainer(strategy, actor, None, None, None, None, None, None, None, None, ema_beta=0.9,
                         micro_train_batch_size=2, micro_rollout_batch_size=4, max_epochs=2, max_norm=0.5,
                         tokenizer=tokenizer, prompt_max_len=64, save_hf_ckpt=True, algo=config.algorithm,
                         rollout_engine=engine, reward_sources=source, packing_samples=True,
                         gradient_checkpointing=True, preemption_grace=30, apply_chat_template=True, max_ckpt_num=2,
                         engine_logprob_gap_threshold=0.3, engine_logprob_gap_action="warn", sync_bucket_mb=64,
                         max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=5, processor=processor)
    earlier = PPOTrainer.from_config(config, strategy, actor, None, None, None, None, None, None, None, None,
                                     tokenizer=tokenizer, rollout_engine=engine, reward_sources=source,
                                     processor=processor)
    # The third way: the parts built first (what every constructor ends in), then handed over.
    parts = build_ppo_parts(strategy, PPOModels(actor), config, tokenizer=tokenizer, rollout_engine=engine,
                            reward_sources=source, processor=processor,
                            generate_kwargs=rollout_generate_kwargs(config.rollout))
    from_parts = PPOTrainer.from_parts(parts)
    assert fingerprint(built) == fingerprint(classic) == fingerprint(earlier) == fingerprint(from_parts)
    # the trainer holds the very parts it was handed: nothing rebuilt, nothing set afterwards
    assert from_parts.experience_services is parts.services and from_parts.rollout is parts.rollout
    assert from_parts.experience_services.generator.engine is parts.rollout
    assert built.processor is processor and built.on_policy() is False    # --max_epochs 2: not on-policy
    # and the options are the config's, not defaults that happen to agree
    assert fingerprint(built)["generate"] == {"max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9, "top_k": 5}
    assert (built.ema_beta, built.max_epochs, built.engine_gap.threshold, built.weight_stream.bucket_mb) == (
        0.9, 2, 0.3, 64)
    assert built.algo.init_kl_coef == 0.02 and built.kl_ctl.value == 0.02


def test_the_on_policy_shortcut_is_chosen_when_the_trainer_is_built():
    # One epoch and no active dropout: the first update is exactly on-policy, so the experience
    # builder skips the rollout-time actor forward; a second epoch, dropout, or the class saying
    # otherwise turns it off. The builder is told when it is made, not when the run starts.
    class Dropping(torch.nn.Module):
        def __init__(self, p):
            super().__init__()
            self.linear, self.dropout = torch.nn.Linear(1, 1), torch.nn.Dropout(p)

    class FullPath(PPOTrainer):
        reuse_old_log_probs = False

    grpo_algo = grpo()
    assert build(algo=grpo_algo).experience_services.builder.reuse_policy_log_probs is True
    assert build(algo=grpo_algo, max_epochs=2).on_policy() is False
    assert build(algo=grpo_algo).on_policy() is True
    trainer = PPOTrainer(*build_args(actor=Dropping(0.1)), algo=grpo_algo, tokenizer=TOKENIZER,
                         rollout_engine=ENGINE, reward_sources=SOURCES)
    assert trainer.on_policy() is False
    trainer = PPOTrainer(*build_args(actor=Dropping(0.0)), algo=grpo_algo, tokenizer=TOKENIZER,
                         rollout_engine=ENGINE, reward_sources=SOURCES)
    assert trainer.on_policy() is True
    trainer = FullPath(*build_args(), algo=grpo_algo, tokenizer=TOKENIZER, rollout_engine=ENGINE,
                       reward_sources=SOURCES)
    assert trainer.experience_services.builder.reuse_policy_log_probs is False


def test_from_config_takes_about_a_dozen_parameters_and_reads_sections():
    import inspect

    from lightrft.trainer.ppo_config import PPOTrainerConfig

    named = [p for p in inspect.signature(PPOTrainer.from_config).parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert len(named) <= 14, [p.name for p in named]
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


# ---------- the trainer receives its parts: construction stays small ----------

def test_the_trainer_assigns_parts_built_elsewhere():
    """Construction inside `PPOTrainer` (its constructors and `assign`) stays under 80 lines and
    no method over 50: the parts are built by `lightrft.trainer.assembly.build_ppo_parts`; the
    trainer module imports at most 15 lightrft modules."""
    import ast
    from pathlib import Path

    from tests.test_layering import import_graph

    path = Path(__file__).resolve().parents[2] / "lightrft/trainer/ppo_trainer.py"
    cls = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "PPOTrainer")
    lengths = {f.name: f.end_lineno - f.lineno + 1 for f in cls.body if isinstance(f, ast.FunctionDef)}
    construction = sum(lengths[name] for name in ("__init__", "from_config", "from_parts", "assign"))
    assert construction <= 80, lengths
    assert max(lengths.values()) <= 50, lengths
    assert "setup" not in lengths                 # the former constructor body is the parts builder now
    assert len(import_graph()["lightrft.trainer.ppo_trainer"]) <= 15
