"""The generation service: prompt texts in, sampled responses (or multi-turn episodes) out.

    Generator.generate(prompts, labels, params, call)  ->  Generation(rollout, rewards, unscored)

It owns what turning prompts into samples needs and nothing else: the rollout engine (through the
trainer's `RolloutManager`, which keeps it synced), the tokenizer with the chat template and the
prompt length cap, the run seed and this rank's place in the global batch (per-prompt seeds,
`lightrft.rollout.seeds`), and the workflow runner of multi-turn runs (--workflow). It keeps no
count of rollouts: the caller passes `call`, the rollout number of the sampling seeds, so the one
counter lives with whoever draws the prompts (the experience source, which checkpoints it).
"""

from dataclasses import dataclass, replace
from typing import Optional

from torch import Tensor

from lightrft.datasets.prompt_dataset import encode_prompts
from lightrft.datasets.prompt_record import Prompt, prompt_images, prompt_media, prompt_token_ids
from lightrft.rewards.batch import RewardBatch
from lightrft.rollout.base import RolloutOutput, SamplingParams
from lightrft.rollout.seeds import request_seeds


def encode_rollout_prompts(tokenizer, prompts: list[Prompt], apply_chat_template: bool,
                           prompt_max_len: int) -> list[list[int]]:
    """The token ids a rollout engine is given for `prompts`: a `PromptRecord`'s own ids (the
    dataset encoded it once, and cut or rejected it there), whole; a plain string is encoded here
    (through the chat template when asked) and cut to its last `prompt_max_len` tokens, the
    question being usually last."""
    texts = [(i, p) for i, p in enumerate(prompts) if prompt_token_ids(p) is None]
    encoded = encode_prompts(tokenizer, [p for _, p in texts], apply_chat_template) if texts else []
    rows = [list(prompt_token_ids(p) or ()) for p in prompts]
    for (i, _), ids in zip(texts, encoded):
        rows[i] = ids[-prompt_max_len:]
    return rows


def rollout_generate_kwargs(rollout) -> dict:
    """The sampling parameters of a rollout section (`lightrft.config.RolloutConfig`), as generate
    kwargs: what every rollout of a run samples with, colocated or on an explorer."""
    return dict(max_new_tokens=rollout.generate_max_len, temperature=rollout.temperature, top_p=rollout.top_p,
                top_k=rollout.top_k)


def sampling_params(n: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 64,
                    min_new_tokens: int = 0, **unused) -> SamplingParams:
    """`SamplingParams` of `n` responses per prompt from a run's generate kwargs (other keys,
    such as an engine's own options, are ignored); the randomness comes from per-prompt seeds."""
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                          min_new_tokens=min_new_tokens, n=n)


@dataclass
class Generation:
    """What one generation call made: the samples (`params.n` per prompt, a prompt's samples in
    contiguous rows) and, for multi-turn episodes, the workflow's own scores with the rows it
    left to the reward sources (`unscored`, Shape: (B,) bool). One-response rollouts carry no
    scores (`rewards` and `unscored` None): every row goes to the reward sources."""

    rollout: RolloutOutput
    rewards: Optional[RewardBatch] = None
    unscored: Optional[Tensor] = None


class Generator:
    """Samples responses to prompt texts with the rollout engine (see the module docstring).

    `engine` is the trainer's `RolloutManager` (or any object with the engine's `generate`);
    `rank` and `world_size` place this rank's prompts in the global batch for their seeds."""

    def __init__(self, engine, tokenizer, *, prompt_max_len: int, apply_chat_template: bool = False, seed: int = 0,
                 rank: int = 0, world_size: int = 1, workflow_runner=None):
        self.engine, self.tokenizer = engine, tokenizer
        self.prompt_max_len, self.apply_chat_template = prompt_max_len, apply_chat_template
        self.seed, self.rank, self.world_size = seed, rank, world_size
        # Runs multi-turn episodes instead of one response per prompt (`lightrft.agents`, --workflow).
        self.workflow_runner = workflow_runner

    def at(self, rank: int, world_size: int) -> "Generator":
        """This generator placed at another position of the global batch: its prompts are global
        positions `rank`, `rank + world_size`, ... (what an explorer generates for the trainer
        ranks it serves, with the seeds a colocated rank would draw)."""
        return Generator(self.engine, self.tokenizer, prompt_max_len=self.prompt_max_len,
                         apply_chat_template=self.apply_chat_template, seed=self.seed, rank=rank,
                         world_size=world_size, workflow_runner=self.workflow_runner)

    def tokenize(self, prompts: list[Prompt]) -> list[list[int]]:
        """The token ids the engine is given for `prompts` (`encode_rollout_prompts`)."""
        return encode_rollout_prompts(self.tokenizer, prompts, self.apply_chat_template, self.prompt_max_len)

    @staticmethod
    def engine_inputs(prompts: list[Prompt]) -> dict:
        """What an engine takes beside the prompts' ids: for prompts with images, `media` (their
        tensors) and `images` (`PromptImages`), one entry per prompt (None for a text prompt);
        {} when no prompt has images."""
        media = [prompt_media(p) for p in prompts]
        if not any(media):
            return {}
        return {"media": media, "images": [prompt_images(p) for p in prompts]}

    @staticmethod
    def with_media(rollout: RolloutOutput, media: Optional[list], n: int) -> RolloutOutput:
        """`rollout` (n samples per prompt) with each sample holding its prompt's `media` (the
        `engine_inputs` entry) for the trainer's forwards; as it is for None (no images)."""
        if media is None:
            return rollout
        return replace(rollout, media=[m for m in media for _ in range(n)])

    def seeds(self, count: int, call: int, stream: str = "train") -> list[int]:
        """The seeds of this rank's `count` prompts in rollout number `call` (1-based) of `stream`:
        each prompt draws from its own stream, derived from the run seed, `call` and the prompt's
        position in the global batch, so samples are independent across prompts and a resumed
        run draws what the uninterrupted one would have. DistributedSampler deals global
        position k to rank k % R."""
        return request_seeds(self.seed, call, self.rank, count, stream, stride=self.world_size)

    def generate(self, prompts: list[Prompt], labels: Optional[list], params: SamplingParams, call: int,
                 stream: str = "train") -> Generation:
        """`params.n` samples per prompt in one engine call, or with a workflow one multi-turn
        episode each, scored by the workflow where it can (`labels` go to the workflow)."""
        seeds = self.seeds(len(prompts), call, stream)
        inputs = self.engine_inputs(prompts)
        if self.workflow_runner is None:
            rollout = self.engine.generate(self.tokenize(prompts), params, seeds=seeds, **inputs)
            return Generation(self.with_media(rollout, inputs.get("media"), params.n))
        batch = self.workflow_runner.run(self.engine, self.tokenize(prompts), prompts, labels, params, seeds)
        return Generation(batch.rollout, batch.rewards, batch.unscored)
