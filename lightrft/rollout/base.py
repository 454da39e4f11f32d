"""What every rollout engine takes, returns and declares.

An engine turns tokenised prompts into sampled responses plus the engine's own log-probabilities
of the sampled tokens. The trainer only sees `RolloutOutput`, so the Hugging Face engine and the
vLLM engine are interchangeable behind the `RolloutEngine` protocol. What an engine can do besides
(how weights reach it, sleep, tensor parallelism, ...) it declares in its `EngineCapabilities`,
which the code that drives it consults instead of the engine's name or its attributes.
"""

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from lightrft.rollout.seeds import mix_seed


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses.

    - `temperature == 0` means greedy decoding (log-probs are then reported at temperature 1).
    - `top_k == 0` and `top_p == 1.0` switch those filters off.
    - `n` samples are drawn per prompt; they are contiguous in the output (rows i*n ... i*n+n-1).
    - `min_new_tokens` forbids end-of-sequence tokens before that many tokens were generated.
    - `seed` seeds this call's sampling when `generate` gets no per-request `seeds`: request i
      then gets `mix_seed(seed, i)`. Each rank must pass a different seed (for example
      `base_seed + rank`) or all ranks draw the same samples for the same prompts. With `seed=None`
      the engine draws a seed from torch's global generator, so a run seeded with
      `torch.manual_seed` stays reproducible. Training passes per-request `seeds` instead
      (`lightrft.rollout.seeds.request_seeds`), which do not depend on how prompts are chunked.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    n: int = 1
    min_new_tokens: int = 0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1.0 switches it off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 switches it off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {self.n}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# How the trainer's weights can reach an engine (`EngineCapabilities.weight_syncs`).
WEIGHT_SYNC_KINDS = ("live", "full", "delta", "adapter")


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine kind can do, declared once per kind (`lightrft.rollout.register_engine`) and
    exposed by every instance as `engine.capabilities`. `RolloutManager`, the builders, explorers
    and the doctor ask these questions rather than compare engine names or probe attributes, so a
    new engine changes none of them.

    - `weight_syncs`: how the trainer's weights reach it, a subset of WEIGHT_SYNC_KINDS. "live":
      it decodes with the trainer's own module, so nothing is ever sent (and nothing else can be
      declared with it). Otherwise it holds a copy of the weights, exposes `sync_bucket_mb` (MB per
      `update_weights` call) and `weight_sync` (its --weight_sync mode) and takes some of: "full",
      `update_weights` with every layer; "delta", `update_weights` with only the layers that changed
      (it then exposes `weight_dtype`, the dtype the sender compares in); "adapter", `load_adapter`
      with a LoRA actor's adapter (it then exposes `lora_rank`, 0 when built without LoRA).
    - `lora`: it serves a LoRA actor (live, or through "adapter").
    - `tensor_parallel`: one replica may span several ranks (`tensor_parallel_size`), whose ranks
      `RolloutManager` makes generate together.
    - `sleep`: `sleep()` frees accelerator memory while the trainer runs; `RolloutManager` calls
      `sleep` and `wake_up` only on such an engine. `keeps_weights_asleep`: they come back bit for
      bit, so a delta sync after a sleep may still skip unchanged layers.
    - `multimodal`: it takes model inputs (images) beside the prompt's token ids.
    - `rollout_log_probs`: it reports the log-probs of the sampled tokens (`RolloutOutput`), which
      the trainer's engine check and truncated importance sampling compare with its own.
    - `needs_shutdown`: `shutdown()` must run on every rank once training is done and before the
      process group closes (vLLM's teardown destroys the group).
    - `one_per_process`: it takes over process-wide state (vLLM: the distributed environment), so
      a process holds one; an explorer thread cannot build a second beside the trainer's.
    - `memory_options`: the rollout-section options that bound its memory while generating, which
      the doctor recommends when generation runs out.
    - `routes`: it records the experts a mixture-of-experts policy routed each token to
      (`RolloutOutput.routes`), what `--routing_replay rollout` replays.
    - `weight_switch`: it takes newer weights in the middle of a `generate` call through its
      `weight_switch` attribute (a callable that loads them and returns their version, or None)
      and tags each token with its version (`RolloutOutput.versions`): `--partial_rollouts`.
    """

    weight_syncs: frozenset[str]
    lora: bool = False
    tensor_parallel: bool = False
    sleep: bool = False
    keeps_weights_asleep: bool = False
    multimodal: bool = False
    rollout_log_probs: bool = True
    needs_shutdown: bool = False
    one_per_process: bool = False
    memory_options: tuple[str, ...] = ()
    routes: bool = False
    weight_switch: bool = False

    def __post_init__(self):
        kinds = frozenset(self.weight_syncs)
        object.__setattr__(self, "weight_syncs", kinds)
        unknown = sorted(kinds - set(WEIGHT_SYNC_KINDS))
        if not kinds or unknown:
            raise ValueError(f"EngineCapabilities.weight_syncs must be a non-empty subset of {WEIGHT_SYNC_KINDS}, "
                             f"got {sorted(kinds)}")
        if "live" in kinds and len(kinds) > 1:
            raise ValueError("EngineCapabilities.weight_syncs: an engine that decodes with the trainer's live module "
                             f"receives no weights, so 'live' stands alone; got {sorted(kinds)}")

    @property
    def shares_live_weights(self) -> bool:
        """It decodes with the trainer's module: never synced, and built over the actor rather than
        from a checkpoint folder."""
        return "live" in self.weight_syncs


@dataclass(frozen=True)
class PromptImages:
    """A prompt's images as an engine that expands image placeholders itself (vLLM) takes them:
    the decoded images (PIL), the prompt's ids with one image marker per image (`marker_ids`), and
    the ids the trainer holds, every placeholder expanded (`token_ids`), which the engine's own
    expansion must reproduce."""

    images: tuple
    marker_ids: tuple[int, ...]
    token_ids: tuple[int, ...]


@dataclass
class RolloutOutput:
    """Sampled sequences, prompts left-padded and responses right-padded.

    B = number of prompts x n, with the n samples of a prompt contiguous. A is the longest
    response in this batch. A response ends with its first end-of-sequence token (included in
    `action_mask`); everything after it is padding with `action_mask == 0` and log-prob 0.
    `rollout_log_probs` are those of the distribution each token was drawn from (after the
    temperature, top-k/top-p and the `min_new_tokens` ban; see `lightrft.rollout.sampling`).
    A multi-turn episode (`from_episodes`) is one response holding every turn and the
    environment's tokens between them: all attended to, with `action_mask` False on the
    environment's tokens (holes) and log-prob 0 there.
    """

    sequences: torch.Tensor  # (B, T) long, T = prompt_len + A
    attention_mask: torch.Tensor  # (B, T) long, 1 on real prompt tokens and on response tokens
    action_mask: torch.Tensor  # (B, A) bool, 1 on response tokens up to and including the first EOS
    rollout_log_probs: torch.Tensor  # (B, A) float32, engine log-probs of the sampled tokens, 0 on padding
    prompt_len: int  # length of the (left-padded) prompt part of `sequences`
    # (B,) bool, True where the response hit max_new_tokens without an EOS token. None only from
    # producers written before the field existed.
    truncated: torch.Tensor | None = None
    # Per sample (B entries), the model inputs its prompt carries beside the token ids (a
    # vision-language model's images, `PromptRecord.media`), None for a text-only sample; None
    # when no sample has any. Several samples of one prompt hold the same dict.
    media: list[dict[str, torch.Tensor] | None] | None = None
    # (B, T, L, K) int8/int16: per token of `sequences`, the K experts each of a mixture-of-experts
    # policy's L MoE layers sent it to while sampling, -1 where none was recorded (padding, a
    # response's last token); what routing replay (`lightrft.utils.routing`) replays in the
    # trainer's forwards. None unless the engine records routes.
    routes: torch.Tensor | None = None
    # (B, A) int32: per response token, the policy version of the weights that sampled it (and
    # whose log-prob `rollout_log_probs` holds); -1 on padding. A response may span versions when
    # the engine took new weights while it was generating (partial rollouts, docs/async.md). None
    # when one set of weights sampled everything.
    versions: torch.Tensor | None = None

    @property
    def num_actions(self) -> int:
        """A, the width of the response part."""
        return self.action_mask.shape[1]

    @property
    def response_lengths(self) -> torch.Tensor:
        """Tokens in each response, EOS included. Shape: (B,)."""
        return self.action_mask.sum(dim=-1)

    @property
    def responses(self) -> torch.Tensor:
        """The response part of `sequences`. Shape: (B, A)."""
        return self.sequences[:, self.prompt_len:]

    def to(self, device: torch.device | str) -> "RolloutOutput":
        """This rollout with every tensor on `device` (the tensors themselves where already there)."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})

    def select(self, rows: Sequence[int]) -> "RolloutOutput":
        """The given samples of this rollout, widths kept."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        return RolloutOutput(self.sequences[index], self.attention_mask[index], self.action_mask[index],
                             self.rollout_log_probs[index], self.prompt_len,
                             None if self.truncated is None else self.truncated[index],
                             None if self.media is None else [self.media[i] for i in index.tolist()],
                             None if self.routes is None else self.routes[index],
                             None if self.versions is None else self.versions[index])

    @classmethod
    def from_token_lists(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        log_probs: Sequence[Sequence[float]],
        pad_token_id: int,
        eos_token_ids: Iterable[int],
        versions: Sequence[Sequence[int]] | None = None,
    ) -> "RolloutOutput":
        """Pads per-sample token lists into a `RolloutOutput`.

        `prompts`, `responses` and `log_probs` hold one entry per sample (B entries, prompts
        already repeated n times). A response is cut after its first EOS token; a response without
        EOS was stopped by the length limit and keeps all its tokens (`truncated` is True).
        `versions` (partial rollouts), one policy version per response token, becomes `versions`,
        cut alike (-1 past each response).
        """
        if not len(prompts) == len(responses) == len(log_probs):
            raise ValueError(
                f"prompts, responses and log_probs must have one entry per sample, got "
                f"{len(prompts)}, {len(responses)} and {len(log_probs)}"
            )
        eos = set(eos_token_ids)
        cut_responses, cut_log_probs = [], []
        for i, (resp, lp) in enumerate(zip(responses, log_probs)):
            if len(resp) != len(lp):
                raise ValueError(f"sample {i}: {len(resp)} response tokens but {len(lp)} log-probs")
            end = next((j + 1 for j, tok in enumerate(resp) if tok in eos), len(resp))
            cut_responses.append(list(resp[:end]))
            cut_log_probs.append(list(lp[:end]))
        truncated = [len(r) == 0 or r[-1] not in eos for r in cut_responses]
        out = cls.from_episodes(prompts, cut_responses, [[True] * len(r) for r in cut_responses], cut_log_probs,
                                truncated, pad_token_id)
        if versions is None:
            return out
        tagged = torch.full(out.action_mask.shape, -1, dtype=torch.int32)
        for row, (response, row_versions) in enumerate(zip(cut_responses, versions)):
            tagged[row, :len(response)] = torch.tensor(row_versions[:len(response)], dtype=torch.int32)
        return dataclasses.replace(out, versions=tagged)

    @classmethod
    def from_episodes(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        loss_masks: Sequence[Sequence[bool]],
        log_probs: Sequence[Sequence[float]],
        truncated: Sequence[bool],
        pad_token_id: int,
    ) -> "RolloutOutput":
        """Pads multi-turn episodes into a `RolloutOutput`, nothing cut: each response is every
        token after its prompt (the policy's turns and the environment's tokens between them, all
        attended to), and `action_mask` is its loss mask, with holes on the environment's tokens
        (their log-probs are 0). One entry per sample in each list."""
        if not len(prompts) == len(responses) == len(loss_masks) == len(log_probs) == len(truncated):
            raise ValueError("from_episodes() needs one prompt, response, loss mask, log-prob list and truncated "
                             "flag per sample")
        batch = len(prompts)
        prompt_len = max((len(p) for p in prompts), default=0)
        num_actions = max((len(r) for r in responses), default=0)
        sequences = torch.full((batch, prompt_len + num_actions), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, prompt_len + num_actions), dtype=torch.long)
        action_mask = torch.zeros((batch, num_actions), dtype=torch.bool)
        rollout_log_probs = torch.zeros((batch, num_actions), dtype=torch.float32)
        for i, (prompt, resp, mask, lp) in enumerate(zip(prompts, responses, loss_masks, log_probs)):
            if not len(resp) == len(mask) == len(lp):
                raise ValueError(f"episode {i}: {len(resp)} response tokens, {len(mask)} loss-mask entries and "
                                 f"{len(lp)} log-probs")
            start, end = prompt_len - len(prompt), prompt_len + len(resp)
            sequences[i, start:end] = torch.tensor(list(prompt) + list(resp), dtype=torch.long)
            attention_mask[i, start:end] = 1
            action_mask[i, :len(resp)] = torch.tensor(list(mask), dtype=torch.bool)
            rollout_log_probs[i, :len(resp)] = torch.tensor(list(lp), dtype=torch.float32)
        return cls(sequences, attention_mask, action_mask, rollout_log_probs, prompt_len,
                   torch.tensor(list(truncated), dtype=torch.bool))

    def rows(self, start: int, stop: int) -> "RolloutOutput":
        """Samples `start` ... `stop - 1` as a rollout of their own, with the padding only other
        samples needed removed: the prompt part as wide as their longest prompt, the response
        part as their longest response. Equal to generating just these samples."""
        sequences, attention = self.sequences[start:stop], self.attention_mask[start:stop]
        actions = self.action_mask[start:stop]
        prompt_attention = attention[:, :self.prompt_len]
        # Prompts are right-aligned at prompt_len: the widest one starts at the first column with a 1.
        prompt_len = int(prompt_attention.sum(-1).max().item()) if len(sequences) else 0
        # Response slots are those attended to (a multi-turn episode's loss mask has holes).
        num_actions = int(attention[:, self.prompt_len:].sum(-1).max().item()) if len(sequences) else 0
        cols = slice(self.prompt_len - prompt_len, self.prompt_len + num_actions)
        truncated = None if self.truncated is None else self.truncated[start:stop]
        return RolloutOutput(sequences[:, cols], attention[:, cols], actions[:, :num_actions],
                             self.rollout_log_probs[start:stop, :num_actions], prompt_len, truncated,
                             None if self.media is None else self.media[start:stop],
                             None if self.routes is None else self.routes[start:stop, cols],
                             None if self.versions is None else self.versions[start:stop, :num_actions])

    @classmethod
    def concat(cls, parts: Sequence["RolloutOutput"], pad_token_id: int) -> "RolloutOutput":
        """Concatenates rollouts of different prompt and response widths along the batch.

        Prompts are left-padded to the widest prompt and responses right-padded to the longest
        response, keeping the layout `sequences[:, prompt_len:]` = responses. `truncated` is
        kept when every part has it."""
        if len(parts) == 0:
            raise ValueError("RolloutOutput.concat needs at least one part")
        if len(parts) == 1:
            return parts[0]
        prompt_len = max(p.prompt_len for p in parts)
        width = max(p.num_actions for p in parts)

        def pad(x: torch.Tensor, left: int, right: int, value) -> torch.Tensor:
            return torch.nn.functional.pad(x, (left, right), value=value)

        sequences, attention, actions, log_probs = [], [], [], []
        for p in parts:
            left, right = prompt_len - p.prompt_len, width - p.num_actions
            sequences.append(pad(p.sequences, left, right, pad_token_id))  # (B_i, prompt_len + width)
            attention.append(pad(p.attention_mask, left, right, 0))
            actions.append(pad(p.action_mask, 0, right, False))
            log_probs.append(pad(p.rollout_log_probs, 0, right, 0.0))
        truncated = None
        if all(p.truncated is not None for p in parts):
            truncated = torch.cat([p.truncated for p in parts])
        media = None
        if any(p.media is not None for p in parts):
            media = [m for p in parts for m in (p.media if p.media is not None else [None] * p.sequences.size(0))]
        versions = None
        if any(p.versions is not None for p in parts):   # a part without tags: one unknown version (-1)
            versions = torch.cat([pad(p.versions if p.versions is not None
                                      else torch.full(p.action_mask.shape, -1, dtype=torch.int32), 0,
                                      width - p.num_actions, -1) for p in parts])
        return cls(torch.cat(sequences), torch.cat(attention), torch.cat(actions), torch.cat(log_probs),
                   prompt_len, truncated, media, cls._concat_routes(parts, prompt_len, width), versions)

    @staticmethod
    def _concat_routes(parts: Sequence["RolloutOutput"], prompt_len: int, width: int) -> torch.Tensor | None:
        """The parts' routes padded like their sequences (-1: no record), parts without routes all
        -1; None when no part has any."""
        shaped = next((p.routes for p in parts if p.routes is not None), None)
        if shaped is None:
            return None
        out = []
        for p in parts:
            routes = p.routes
            if routes is None:
                routes = shaped.new_full((p.sequences.size(0), p.sequences.size(1), *shaped.shape[2:]), -1)
            left, right = prompt_len - p.prompt_len, width - p.num_actions
            out.append(torch.nn.functional.pad(routes, (0, 0, 0, 0, left, right), value=-1))
        return torch.cat(out)


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses for the trainer.

    `generate` samples `params.n` responses per prompt in one call (the engine chunks internally);
    `seeds` has one entry per prompt (`lightrft.rollout.seeds.request_seeds`) and sample j of
    prompt i is drawn from `sample_seed(seeds[i], j)`, so samples do not depend on batching.
    `update_weights` receives `(name, tensor)` pairs named as in the Hugging Face model's
    `named_parameters()`; it may be called several times per update, each call with whole modules
    (all parameters of a decoder layer together: engines fuse q/k/v and gate/up projections).
    `sleep` frees accelerator memory while the trainer runs; `wake_up` brings it back before the
    next `generate`. `RolloutManager` owns that order; trainers call it rather than the engine.
    `capabilities` declares what else the engine does and which further attributes it has
    (`EngineCapabilities`); an engine that shares live weights needs no `update_weights`.
    """

    capabilities: EngineCapabilities

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> RolloutOutput:
        """A `multimodal` engine also takes `media=` (per prompt, its model inputs, the images'
        tensors, or None) and `images=` (per prompt, its `PromptImages` or None)."""
        ...

    def update_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        ...

    def sleep(self) -> None:
        ...

    def wake_up(self) -> None:
        ...


def switch_weights(engine) -> bool:
    """Partial rollouts: asks `engine.weight_switch` for newer weights; True when it loaded some,
    with `engine.version` moved to theirs (the switch may set it itself while it loads)."""
    before = engine.version
    version = engine.weight_switch()
    if version is None or version == before:
        return False
    engine.version = int(version)
    return True


def request_seeds_for(prompt_token_ids: list[list[int]], params: SamplingParams,
                      seeds: Sequence[int] | None) -> list[int]:
    """One seed per prompt: `seeds` checked against the prompts, or, without them, seeds derived
    from `params.seed` (from torch's global generator when that is None too)."""
    if seeds is not None:
        if len(seeds) != len(prompt_token_ids):
            raise ValueError(f"generate() got {len(seeds)} seeds for {len(prompt_token_ids)} prompts: "
                             "pass one seed per prompt (lightrft.rollout.seeds.request_seeds) or seeds=None")
        return [int(s) for s in seeds]
    base = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
    return [mix_seed(base, i) for i in range(len(prompt_token_ids))]


def validate_prompts(prompt_token_ids: list[list[int]]) -> None:
    """Raises a ValueError naming the first prompt that is not a non-empty list of token ids."""
    if len(prompt_token_ids) == 0:
        raise ValueError("generate() got no prompts: pass a non-empty list of token-id lists")
    for i, prompt in enumerate(prompt_token_ids):
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise ValueError(f"prompt {i} must be a list of token ids, got {type(prompt).__name__}; "
                             "tokenise prompts before calling generate()")
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
