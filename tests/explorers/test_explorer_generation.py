"""An explorer generates and scores exactly as a colocated trainer rank does: same prompts, same
per-prompt seeds, same tokens, log-probs and rewards (it runs the run's own rollout services)."""

import json
import threading

import torch

from lightrft.builders.explorers import build_explorer_parts
from lightrft.config import PPORunConfig
from lightrft.experience.generation import Generator, rollout_generate_kwargs, sampling_params
from lightrft.experience.scorer import Scorer
from lightrft.explorers.batches import DONE, RolloutBatch
from lightrft.explorers.explorer import Explorer
from lightrft.explorers.roles import LocalChannel
from lightrft.explorers.weights import WeightPublisher
from lightrft.models.families import load_model
from lightrft.models.tokenizer import build_tokenizer
from lightrft.rewards import make_reward_source
from lightrft.rollout.hf_engine import hf_engine_for
from lightrft.utils.tiny import save_tiny_model
from tests.conftest import to_flags

REWARD_FILE = """
import torch

def reward_func(queries, prompts, labels):
    # a score that depends on every sampled character
    return torch.tensor([float(sum(map(ord, q)) % 11) for q in queries])
"""


def test_an_explorer_rollout_equals_the_colocated_generators(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"input": f"{i} + {i + 1} =", "label": str(2 * i + 1)}) + "\n"
                                    for i in range(16)))
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    flags = dict(pretrain=str(model_dir), prompt_data=str(prompts_file), remote_rm_url=str(tmp_path / "reward.py"),
                 advantage_estimator="group_norm", n_samples_per_prompt=2, rollout_batch_size=4, train_batch_size=8,
                 micro_rollout_batch_size=4, generate_max_len=8, temperature=1.0, seed=5)
    config = PPORunConfig.from_namespace(PPORunConfig.build_parser("train_ppo").parse_args(to_flags(flags)))
    parts = build_explorer_parts(config, rank=0)

    # The explorer serves trainer rank 1 of 2 (what the one-step-ahead thread of that rank does):
    # global positions 1 and 3 of each batch of 4.
    experience, control = LocalChannel(), LocalChannel()
    explorer = Explorer(config, experience, control, parts, first_position=1, stride=2)
    publisher = WeightPublisher(control, "broadcast", delta=False)
    publisher.publish(0, [(name, p.detach().clone()) for name, p in parts.module.named_parameters()], start_batch=0)
    thread = threading.Thread(target=explorer.run, daemon=True)
    thread.start()
    sent, _ = experience.recv()
    publisher.close(30)
    thread.join(60)
    assert isinstance(sent, RolloutBatch) and sent.batch == 0 and sent.version == 0
    assert experience.recv()[0] == DONE

    # The colocated path on the same prompts: rank 1 of 2, rollout call 1, its own copy of the policy.
    dataset = explorer.prompts
    prompts, labels = dataset.collate_fn([dataset[sent.prompt_ids[p]] for p in (1, 3)])
    tokenizer = build_tokenizer(str(model_dir), padding_side="left")
    policy = load_model(str(model_dir), dtype=torch.float32).eval()
    engine = hf_engine_for(policy, tokenizer, [tokenizer.eos_token_id], 4)
    params = sampling_params(2, **rollout_generate_kwargs(config.rollout))

    def generate(rank: int):
        generator = Generator(engine, tokenizer, prompt_max_len=config.data.prompt_max_len, seed=5, rank=rank,
                              world_size=2)
        with torch.no_grad():
            return generator.generate(prompts, labels, params, call=1)

    colocated = generate(rank=1)
    rollout = colocated.rollout
    assert torch.equal(sent.rollout.sequences, rollout.sequences)
    assert torch.equal(sent.rollout.action_mask, rollout.action_mask)
    assert torch.allclose(sent.rollout.rollout_log_probs, rollout.rollout_log_probs, atol=1e-6, rtol=0)
    scorer = Scorer(tokenizer, reward_sources=[make_reward_source(str(tmp_path / "reward.py"))],
                    eos_token_ids=[tokenizer.eos_token_id])
    rewards = scorer.score_generation(colocated, prompts, labels, params)
    assert torch.equal(sent.scores, rewards.scores) and sent.scores.unique().numel() > 1
    # The seeds are the served rank's: placed as rank 0, the same prompts sample other tokens.
    assert not torch.equal(generate(rank=0).rollout.sequences, rollout.sequences)
