"""The record of every prompt of a decoupled run.

`PromptLedger`: which prompts were generated, dropped as too stale, and trained at which step.
It travels in every checkpoint, so a resumed run knows exactly which prompts its weights have
seen; a prompt trained twice in one episode is an error, not a silent duplicate.
"""

from lightrft.explorers.batches import RolloutBatch


class PromptLedger:
    """Every rollout batch's fate: received from an explorer, dropped as too stale, trained at a
    step. `trained` holds, per rollout batch, the dataset rows trained at its step (one batch per
    step, or with dynamic sampling the batches its refills took, filtered groups included); what a
    checkpoint holds is exactly what its weights have learned from."""

    def __init__(self):
        self.received = 0
        self.dropped = 0
        self.trained: list[dict] = []    # {"step", "batch", "episode", "version", "prompts"}

    def record_trained(self, step: int, batch: RolloutBatch) -> None:
        seen = {p for entry in self.trained if entry["episode"] == batch.episode for p in entry["prompts"]}
        twice = sorted(seen.intersection(batch.prompt_ids))
        if twice:
            raise RuntimeError(f"prompt ledger: rows {twice[:5]} of episode {batch.episode} would be trained a second "
                               f"time at step {step} (rollout batch {batch.batch}); this is a bug, please report it")
        self.trained.append({"step": step, "batch": batch.batch, "episode": batch.episode, "version": batch.version,
                             "prompts": list(batch.prompt_ids)})

    def state_dict(self) -> dict:
        return {"received": self.received, "dropped": self.dropped, "trained": list(self.trained)}

    def load_state_dict(self, state: dict) -> None:
        self.received, self.dropped = state["received"], state["dropped"]
        self.trained = list(state["trained"])

    @staticmethod
    def merged(states: list[dict]) -> dict:
        """The ledger of a job whose ranks saved `states` (one per rank, in rank order), for a
        resume on another number of ranks: each step's trained prompts are those any rank recorded
        (every trainer records its batch's rows, so the ranks agree; a row listed by several is
        listed once), in rank order; the batches received and dropped are rank 0's (every trainer
        takes its share of each batch)."""
        steps: dict[tuple[int, int], dict] = {}      # (step, batch): a dynamic-sampling step takes several
        for state in states:
            for entry in state["trained"]:
                merged = steps.setdefault((entry["step"], entry["batch"]), {**entry, "prompts": []})
                known = set(merged["prompts"])
                merged["prompts"] = merged["prompts"] + [p for p in entry["prompts"] if p not in known]
        return {"received": states[0]["received"], "dropped": states[0]["dropped"],
                "trained": [steps[key] for key in sorted(steps)]}
