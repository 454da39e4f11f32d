"""Rollouts with the live Hugging Face model: works on any device, under any ZeRO stage.

The engine decodes with the model object it was given (the actor's `.model`), so it always
samples from the current policy and needs no weight transfer. The decoding loop is written here
rather than delegated to `model.generate` so that the sampled tokens come from an explicit seeded
`torch.Generator` and the log-probs of the sampled tokens are computed one step at a time, without
keeping (A, B, V) logits around.
"""

import inspect
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from lightrft.rollout.base import RolloutOutput, SamplingParams, validate_prompts
from lightrft.rollout.sampling import sample_next_tokens
from lightrft.utils.distributed import get_world_size


class HFEngine:
    """Batched sampling with a live Hugging Face causal LM.

    Args:
        model: a Hugging Face causal LM (or a PEFT wrapper of one) taking `input_ids`,
            `attention_mask`, `position_ids`, `past_key_values` and `use_cache`.
        pad_token_id: token written after a response ends.
        eos_token_id: one id or a list of ids that end a response.
        synced_gpus: keep every rank running forward passes until all ranks have finished. Needed
            under DeepSpeed ZeRO-3 with more than one rank: each forward gathers parameter shards
            from all ranks, so a rank that stopped early would leave the others waiting forever.

    Position ids follow the left padding: `cumsum(attention_mask) - 1`, as the actor computes
    them for its teacher-forced forward, so the rollout log-probs and the actor's agree.
    """

    # It decodes with the trainer's own module, so there are no weights to push after a step.
    shares_live_weights = True

    def __init__(self, model: torch.nn.Module, pad_token_id: int, eos_token_id: int | Sequence[int],
                 synced_gpus: bool = False):
        if eos_token_id is None:
            raise ValueError("HFEngine needs an eos_token_id: set tokenizer.eos_token_id or pass it explicitly")
        if pad_token_id is None:
            raise ValueError("HFEngine needs a pad_token_id: set tokenizer.pad_token_id (often to the EOS id)")
        self.model = model
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]
        self.synced_gpus = synced_gpus
        # Asking for the last position's logits only keeps the prefill from building (B, T, V) logits.
        self._keep_last_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """Samples `params.n` responses for each prompt. See `RolloutOutput` for the layout."""
        validate_prompts(prompt_token_ids)
        device = self.device
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        generator = torch.Generator(device=device).manual_seed(seed)

        repeated = [list(p) for p in prompt_token_ids for _ in range(params.n)]  # B = prompts x n
        prompt_len = max(len(p) for p in repeated)
        input_ids = torch.full((len(repeated), prompt_len), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((len(repeated), prompt_len), dtype=torch.long)
        for i, prompt in enumerate(repeated):
            input_ids[i, prompt_len - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            prompt_mask[i, prompt_len - len(prompt):] = 1
        input_ids, prompt_mask = input_ids.to(device), prompt_mask.to(device)

        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                tokens, log_probs, action_mask = self._decode(input_ids, prompt_mask, params, generator)
        finally:
            self.model.train(was_training)

        # Trim the columns no response of this rank reaches (synced ranks may decode further).
        num_actions = int(action_mask.sum(dim=-1).max().item())
        tokens, log_probs = tokens[:, :num_actions], log_probs[:, :num_actions]
        action_mask = action_mask[:, :num_actions]
        return RolloutOutput(
            sequences=torch.cat([input_ids, tokens], dim=1),
            attention_mask=torch.cat([prompt_mask, action_mask.long()], dim=1),
            action_mask=action_mask,
            rollout_log_probs=log_probs,
            prompt_len=prompt_len,
        )

    def _decode(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cached decoding loop. Returns tokens (B, S) long, log-probs (B, S) float32 and
        the action mask (B, S) bool, where S is the number of steps decoded."""
        batch = input_ids.shape[0]
        device = input_ids.device
        eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=device)
        position_ids = (prompt_mask.cumsum(dim=-1) - 1).clamp(min=0)  # (B, Tp)
        attention_mask = prompt_mask
        step_ids, step_positions = input_ids, position_ids
        past_key_values = None
        unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        tokens, log_probs, is_action = [], [], []
        extra = {"logits_to_keep": 1} if self._keep_last_logits else {}

        for step in range(params.max_new_tokens):
            out = self.model(input_ids=step_ids, attention_mask=attention_mask, position_ids=step_positions,
                             past_key_values=past_key_values, use_cache=True, **extra)
            past_key_values = out.past_key_values
            banned = eos if step < params.min_new_tokens else None
            next_tokens, next_log_probs = sample_next_tokens(
                out.logits[:, -1, :], params.temperature, params.top_k, params.top_p, generator, banned)
            # Rows that already ended get padding: action mask 0 and log-prob 0.
            next_tokens = torch.where(unfinished, next_tokens, self.pad_token_id)
            tokens.append(next_tokens)
            log_probs.append(torch.where(unfinished, next_log_probs, 0.0))
            is_action.append(unfinished.clone())
            attention_mask = torch.cat([attention_mask, unfinished.long().unsqueeze(1)], dim=1)  # (B, Tp + step + 1)
            unfinished = unfinished & ~torch.isin(next_tokens, eos)
            step_ids = next_tokens.unsqueeze(1)  # (B, 1)
            step_positions = step_positions[:, -1:] + 1  # (B, 1)
            if not self._any_rank_unfinished(unfinished):
                break
        return torch.stack(tokens, dim=1), torch.stack(log_probs, dim=1), torch.stack(is_action, dim=1)

    def _any_rank_unfinished(self, unfinished: torch.Tensor) -> bool:
        """Whether decoding must go on: on this rank, or on any rank when `synced_gpus` is set."""
        flag = unfinished.any().to(torch.int32)
        if self.synced_gpus and get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def update_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to do: the engine decodes with the live module, which already holds the
        trainer's latest weights."""

    def sleep(self) -> None:
        """Nothing to free: the engine owns no memory besides the live module."""

    def wake_up(self) -> None:
        """Nothing to restore (see `sleep`)."""
