"""A look at what the policy generates: every N steps a small table of rollout samples (prompt,
response, reward, policy version, staleness; a multi-turn episode's response is the whole
episode, the environment's parts marked) goes to W&B (a `wandb.Table`) and TensorBoard (a
markdown table in the Text tab). `train_ppo --preview_steps N` adds it."""

from dataclasses import dataclass
from itertools import groupby

from lightrft.trainer.callbacks import TrainerCallback

PREVIEW_COLUMNS = ("step", "prompt", "response", "reward", "policy_version", "staleness")


@dataclass(frozen=True)
class PreviewRow:
    step: int               # the trainer step these samples train (1-based, as the metrics' step)
    prompt: str
    response: str
    reward: float
    policy_version: int     # the step of the weights that generated the sample
    staleness: int          # trainer weights' step - policy_version (0 when synchronous)

    def values(self) -> list:
        return [self.step, self.prompt, self.response, self.reward, self.policy_version, self.staleness]


def response_text(tokenizer, experience, row: int) -> str:
    """Row `row`'s response as text: every attended response token, so a multi-turn episode reads
    whole, with the environment's tokens (not trained) between [env: ...] marks."""
    a = experience.action_mask.size(1)
    n = int(experience.attention_mask[row, experience.attention_mask.size(1) - a:].sum()) if a else 0
    tokens = experience.sequences[row, experience.sequences.size(1) - a:][:n].tolist()
    trains = experience.action_mask[row, :n].tolist()
    parts, position = [], 0
    for trained, run in groupby(trains):
        length = len(list(run))
        text = tokenizer.decode(tokens[position:position + length], skip_special_tokens=True)
        parts.append(text if trained or not text else f"[env: {text}]")
        position += length
    return "".join(parts)


def preview_rows(trainer, experiences: list, max_rows: int) -> list[PreviewRow]:
    """The first `max_rows` samples of this rank's experiences (padded layout, as they come out of
    the experience maker), decoded with `trainer.tokenizer`."""
    rows = []
    weights_step = trainer.global_step  # the optimizer steps taken when these samples were made
    for experience in experiences:
        a = experience.action_mask.size(1)
        versions = experience.info.get("policy_version")
        for i in range(experience.batch_size):
            if len(rows) == max_rows:
                return rows
            prompt_part = experience.sequences[i, :-a] if a else experience.sequences[i]
            prompt_ids = prompt_part[experience.attention_mask[i, :prompt_part.size(0)].bool()].tolist()
            version = int(versions[i]) if versions is not None else weights_step
            rows.append(PreviewRow(step=weights_step + 1,
                                   prompt=trainer.tokenizer.decode(prompt_ids, skip_special_tokens=True),
                                   response=response_text(trainer.tokenizer, experience, i),
                                   reward=float(experience.info["reward"][i]), policy_version=version,
                                   staleness=weights_step - version))
    return rows


class RolloutPreview(TrainerCallback):
    """Logs `rows` rollout samples as the table `rollout/preview` every `every` steps (the
    steps divisible by it), through `trainer.tracker` on rank 0."""

    def __init__(self, every: int, rows: int = 4, name: str = "rollout/preview"):
        if every <= 0:
            raise ValueError(f"--preview_steps must be positive to preview, got {every}")
        if rows <= 0:
            raise ValueError(f"the preview needs at least one row, got {rows}")
        self.every = every
        self.rows = rows
        self.name = name

    def on_rollout_end(self, trainer, experiences: list) -> None:
        step = trainer.global_step + 1
        tracker = getattr(trainer, "tracker", None)
        if step % self.every or tracker is None or not trainer.strategy.is_rank_0():
            return
        rows = preview_rows(trainer, experiences, self.rows)
        tracker.log_table(self.name, PREVIEW_COLUMNS, [r.values() for r in rows], step=step)
