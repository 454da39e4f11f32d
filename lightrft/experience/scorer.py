"""Scoring a rollout: every reward model and reward source, combined into one score per sample.

A `Scorer` is the reward half of making experience, on its own: the colocated experience maker
holds one, and explorer ranks score with one (they train nothing, so they need no forwards)."""

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from lightrft.datasets.prompt_record import Prompt, prompt_text
from lightrft.experience.placement import arrive
from lightrft.models.media import media_keywords
from lightrft.models.utils import accepts_keyword
from lightrft.rewards.base import call_reward_source
from lightrft.rewards.batch import RewardBatch
from lightrft.rewards.shaping import overlong_penalty
from lightrft.rollout.base import RolloutOutput


def truncated_rows(rollout: RolloutOutput, eos_token_ids: Sequence[int]) -> Tensor:
    """Which responses were cut at the length limit rather than ended by an EOS token (an empty
    response counts as cut): the engine's own flags, else read off the last token (an engine that
    does not report them). Shape: (B,) bool."""
    if rollout.truncated is not None:
        return rollout.truncated.bool().cpu()
    lengths = rollout.action_mask.sum(dim=1)                                     # (B,)
    a = rollout.action_mask.size(1)
    if a == 0:
        return torch.ones(lengths.shape, dtype=torch.bool)
    last = rollout.sequences[:, -a:].gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    return (lengths == 0) | ~torch.isin(last, torch.tensor(list(eos_token_ids), dtype=last.dtype))


class Scorer:
    """Scores samples with reward models (micro-batched forwards on `device`) and reward sources
    (HTTP servers, reward files, rules, given the decoded texts), combined by `reward_fn` over
    the (K, B) columns (default: their sum), then shaped by the overlong penalty.

    Without any reward model or source it refuses, unless `task_reward_optional` (a run that
    distils from a teacher, `--teacher_pretrain`, whose signal is per token): every task score is
    then 0 (before the overlong shaping)."""

    def __init__(self, tokenizer, *, reward_models: Sequence = (), reward_sources: Sequence = (),
                 reward_fn: Optional[Callable] = None, micro_batch_size: int = 1, device=None,
                 overlong_buffer_len: int = 0, overlong_penalty_factor: float = 1.0,
                 eos_token_ids: Optional[Sequence[int]] = None, task_reward_optional: bool = False):
        if not reward_models and not reward_sources and not task_reward_optional:
            raise ValueError("no reward: pass --reward_pretrain (a reward model) or --remote_rm_url "
                             "(an http(s) URL, a .py file defining reward_func, or a builtin rule name), or "
                             "--teacher_pretrain to distil from a teacher without a task reward")
        self.tokenizer = tokenizer
        self.reward_models = reward_models          # the caller's lists: sources added later count too
        self.reward_sources = reward_sources
        self.reward_fn = reward_fn
        self.micro_batch_size = micro_batch_size
        self.device = device
        self.overlong_buffer_len = overlong_buffer_len
        self.overlong_penalty_factor = overlong_penalty_factor
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids else [tokenizer.eos_token_id]

    def eval_models(self) -> None:
        """The reward models in eval mode (no dropout while scoring)."""
        for model in self.reward_models:
            model.eval()

    def decode(self, rollout: RolloutOutput, prompts: list[Prompt], n: int) -> tuple[list[str], list[str]]:
        """Query texts (prompt + response) and the prompt of each sample, for text reward sources.
        A response is its row's attended response slots, decoded in one batch call."""
        a = rollout.action_mask.size(1)
        rows = (rollout.sequences[:, -a:] if a else rollout.sequences[:, :0]).tolist()
        # The response's slots are those attended to: the action mask's prefix for one response,
        # the whole episode (environment tokens included) for a multi-turn one.
        lengths = rollout.attention_mask[:, rollout.attention_mask.size(1) - a:].sum(dim=1).tolist()
        tokens = [row[:length] for row, length in zip(rows, lengths)]
        responses = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        sample_prompts = [prompt_text(p) for p in prompts for _ in range(n)]
        return [p + r for p, r in zip(sample_prompts, responses)], sample_prompts

    @torch.no_grad()
    def score(self, rollout: RolloutOutput, prompts: list[Prompt], labels: Optional[list], n: int,
              max_new_tokens: Optional[int] = None, shaping: bool = True) -> RewardBatch:
        """Scores every sample with every reward source and combines them with `reward_fn`.
        `max_new_tokens` is the generation limit the overlong penalty measures against;
        `shaping=False` reports the task reward alone (evaluation)."""
        rollout = arrive(rollout)
        batch = rollout.sequences.size(0)
        columns, valid = [], torch.ones(batch, dtype=torch.bool)
        for model in self.reward_models:
            scores = []
            # The prompt columns, so that the samples of one prompt share its forward (RewardModel).
            shared = {"prompt_len": rollout.prompt_len} if accepts_keyword(model, "prompt_len") else {}
            for i in range(0, batch, self.micro_batch_size):
                rows = slice(i, i + self.micro_batch_size)
                seq, mask = rollout.sequences[rows].to(self.device), rollout.attention_mask[rows].to(self.device)
                # A vision-language reward model scores the samples with their images.
                extra = media_keywords(rollout.media[rows] if rollout.media is not None else None)
                scores.append(model(seq, attention_mask=mask, **shared, **extra).float().cpu())
            columns.append(torch.cat(scores))
        if self.reward_sources:
            queries, sample_prompts = self.decode(rollout, prompts, n)
            sample_labels = [lab for lab in (labels if labels is not None else [None] * len(prompts))
                             for _ in range(n)]
            truncated = truncated_rows(rollout, self.eos_token_ids).tolist()
            for source in self.reward_sources:
                result = call_reward_source(source, queries, sample_prompts, sample_labels, truncated)
                if hasattr(result, "valid"):
                    valid &= result.valid.cpu().bool()
                    result = result.rewards
                columns.append(torch.as_tensor(result, dtype=torch.float32).cpu().reshape(batch))
        if columns:
            stacked = torch.stack(columns)                                 # (K, B)
            scores = self.reward_fn(stacked) if self.reward_fn is not None else stacked.sum(dim=0)
        else:                               # no task reward (distillation only): a zero score each
            scores = torch.zeros(batch)
        scores = torch.where(valid, scores, torch.zeros_like(scores))
        if shaping and self.overlong_buffer_len > 0:
            if max_new_tokens is None:
                raise ValueError("overlong reward shaping needs the generation limit (--generate_max_len)")
            scores = scores + overlong_penalty(rollout.action_mask.sum(dim=1), max_new_tokens,
                                               self.overlong_buffer_len, self.overlong_penalty_factor)
        return RewardBatch(scores=scores.float(), valid=valid)

    def score_generation(self, generation, prompts: list[Prompt], labels: Optional[list], params,
                         shaping: bool = True) -> RewardBatch:
        """The rewards of a `lightrft.experience.generation.Generation` made with `params`: every
        sample scored by `score`, or, for multi-turn episodes, the workflow's own scores, with
        the rows it left unscored scored by the reward sources (unshaped: an episode's length is
        not one response's)."""
        if generation.rewards is None:
            return self.score(generation.rollout, prompts, labels, params.n, params.max_new_tokens, shaping=shaping)
        rollout, rewards = arrive(generation.rollout, generation.rewards)
        if bool(generation.unscored.any()):
            scored = self.score(rollout, prompts, labels, params.n, shaping=False)
            rewards.scores = torch.where(generation.unscored, scored.scores, rewards.scores)
            rewards.valid &= scored.valid | ~generation.unscored
        return rewards
