"""Launched by test_smollm2_paths.py under torchrun (3 ranks, gloo). argv: result.json, model folder.

SmolLM2-135M-Instruct (9 query heads, 3 key/value heads: 3 is the only group size above 1 that
divides both) with a packed row of three chat answers split over the three ranks, against the same
row unsplit on each rank: log-probs, entropies, a PPO + KL + entropy loss, and the weight gradients
summed over the ranks. Rank 0 writes the largest differences and their scales.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from lightrft.models import ActorLanguage
from lightrft.models.sequence_parallel import SequenceParallel
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from lightrft.utils.program import run_program
from tests.models.dist_sequence_parallel import losses, max_diff
from tests.real_model.test_smollm2 import QUESTIONS

ANSWERS = ["The capital of France is Paris.", "3 plus 4 is 7.", "Blue is a primary colour."]


def packed_row(tokenizer) -> tuple[torch.Tensor, list[int], list[int]]:
    ids, lens, actions = [], [], []
    for question, answer in zip(QUESTIONS, ANSWERS):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        response = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids += list(prompt) + response
        lens.append(len(prompt) + len(response))
        actions.append(len(response))
    return torch.tensor([ids]), lens, actions


def main() -> None:
    result, folder = Path(sys.argv[1]), sys.argv[2]
    strategy = DeepspeedStrategy(StrategyConfig(zero_stage=0, seed=0, sequence_parallel_size=3))
    strategy.setup_distributed()
    ids, lens, actions = packed_row(AutoTokenizer.from_pretrained(folder))
    mask = (torch.arange(max(actions)).unsqueeze(0) < torch.tensor(actions).unsqueeze(1)).float()
    base = -2.0 + torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3))
    reference, split = ActorLanguage(folder), ActorLanguage(folder)
    split.use_sequence_parallel(strategy.sequence_parallel)
    assert isinstance(split.sequence_parallel, SequenceParallel)
    out = {}
    for key, actor in (("reference", reference), ("split", split)):
        actor.train()
        log_probs, output = actor(ids, actions, packed_seq_lens=lens, return_output=True, return_entropy=True)
        total, kl = losses(log_probs, output["entropy"], base, advantages, mask)
        total.backward()
        grads = {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
        out[key] = (log_probs * mask, output["entropy"] * mask, total, grads)
    for grad in out["split"][3].values():
        dist.all_reduce(grad)
    ref_grads = out["reference"][3]
    record = {"tokens": sum(lens), "actions": sum(actions),
              "log_probs": max_diff(out["split"][0], out["reference"][0]),
              "entropy": max_diff(out["split"][1], out["reference"][1]),
              "loss": max_diff(out["split"][2], out["reference"][2]),
              "grads": max(max_diff(out["split"][3][n], g) for n, g in ref_grads.items()),
              "grad_scale": max(g.abs().max().item() for g in ref_grads.values()),
              "log_prob_scale": out["reference"][0].abs().max().item()}
    if strategy.is_rank_0():
        result.write_text(json.dumps(record))
    strategy.close()


if __name__ == "__main__":
    run_program(main)
