"""Preference pairs for reward-model training: a chosen and a rejected text per row."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.utils.data import Dataset

from lightrft.datasets.chat import render_chat, require_chat_template, to_messages
from lightrft.datasets.loaders import resolve_rows
from lightrft.datasets.padding import right_pad
from lightrft.datasets.validation import DatasetRowError, check_field, process_rows


@dataclass
class PreferencePair:
    chosen_ids: torch.Tensor  # (Tc,) long, ends with EOS
    rejected_ids: torch.Tensor  # (Tr,) long, ends with EOS
    margin: float | None = None


@dataclass
class PreferenceBatch:
    """Chosen and rejected sequences right-padded to one common width T, so a trainer can score them
    in one (2B, T) forward with `torch.cat`."""

    chosen_ids: torch.Tensor  # (B, T)
    chosen_mask: torch.Tensor  # (B, T)
    rejected_ids: torch.Tensor  # (B, T)
    rejected_mask: torch.Tensor  # (B, T)
    margins: torch.Tensor | None = None  # (B,) float32, when the dataset has a margin key


def encode_for_reward(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a text to score with a reward model: the text's tokens, then EOS unless it already
    ends with it. The reward model reads its score at that last token, so training (here) and serving
    (`lightrft.cli.serve_rm`) must end sequences the same way."""
    ids = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    if not ids or ids[-1] != tokenizer.eos_token_id:
        ids.append(tokenizer.eos_token_id)
    return ids


class PreferenceDataset(Dataset):
    """Rows with `chosen_key` and `rejected_key`, and optionally `prompt_key` and `margin_key`.

    With a prompt key the texts are `prompt + chosen` and `prompt + rejected` (with
    `apply_chat_template`: the prompt as user message(s) and the answer as the assistant message(s));
    without one, chosen and rejected are whole texts (used as they are) or, with
    `apply_chat_template`, whole conversations. Each side ends with EOS;
    a side longer than `max_len` tokens is a bad row, and so is a margin that is not a finite number.
    `flag` is the option a path came from, for error messages."""

    def __init__(self, rows_or_path: str | Path | Sequence[dict], tokenizer: Any, prompt_key: str | None = None,
                 chosen_key: str = "chosen", rejected_key: str = "rejected", apply_chat_template: bool = False,
                 max_len: int = 2048, on_bad_row: str = "error", source_name: str | None = None,
                 margin_key: str | None = None, max_samples: int | None = None, flag: str = "--dataset"):
        if max_len < 2:
            raise ValueError(f"--max_len must be at least 2, got {max_len}")
        if apply_chat_template:
            require_chat_template(tokenizer)
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.chosen_key = chosen_key
        self.rejected_key = rejected_key
        self.apply_chat_template = apply_chat_template
        self.max_len = max_len
        self.margin_key = margin_key
        rows, source = resolve_rows(rows_or_path, source_name, max_samples, flag)
        self.source = source
        self.pairs, self.row_indices, self.skip_report = process_rows(rows, self._build, source, on_bad_row)

    @property
    def skipped(self) -> int:
        return self.skip_report.skipped

    def _build(self, index: int, row: Any) -> PreferencePair:
        kind = "text_or_messages" if self.apply_chat_template else "text"
        prompt = None if self.prompt_key is None else check_field(row, self.prompt_key, kind, self.source, index)
        sides = [check_field(row, key, kind, self.source, index) for key in (self.chosen_key, self.rejected_key)]
        margin = None if self.margin_key is None else check_field(row, self.margin_key, "number", self.source, index)
        chosen, rejected = (self._encode(prompt, answer, key, index)
                            for answer, key in zip(sides, (self.chosen_key, self.rejected_key)))
        return PreferencePair(chosen, rejected, margin)

    def _encode(self, prompt: Any, answer: Any, key: str, index: int) -> torch.Tensor:
        templated = self.apply_chat_template and (prompt is not None or isinstance(answer, list))
        if not templated:
            text = answer if prompt is None else prompt + answer
        else:
            messages = [] if prompt is None else to_messages(prompt, self.prompt_key, self.source, index)
            if isinstance(answer, str):
                messages.append({"role": "assistant", "content": answer})
            else:
                messages += to_messages(answer, key, self.source, index)
            text = render_chat(self.tokenizer, messages, False, key, self.source, index)
        ids = encode_for_reward(self.tokenizer, text, add_special_tokens=not templated)
        if len(ids) > self.max_len:
            raise DatasetRowError(self.source, index, key,
                                  f"the text is {len(ids)} tokens with EOS, over --max_len {self.max_len}",
                                  "raise --max_len or skip such rows with --on_bad_row skip", kind="over-long")
        return torch.tensor(ids, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, idx: int) -> PreferencePair:
        return self.pairs[idx]

    def collate_fn(self, batch: list[PreferencePair]) -> PreferenceBatch:
        return pad_preference_batch(batch, self.tokenizer.pad_token_id)


def pad_preference_batch(batch: list[PreferencePair], pad_token_id: int) -> PreferenceBatch:
    width = max(max(len(p.chosen_ids), len(p.rejected_ids)) for p in batch)
    chosen_ids, chosen_mask = right_pad([p.chosen_ids for p in batch], pad_token_id, width)
    rejected_ids, rejected_mask = right_pad([p.rejected_ids for p in batch], pad_token_id, width)
    margins = None
    if batch[0].margin is not None:
        margins = torch.tensor([p.margin for p in batch], dtype=torch.float32)
    return PreferenceBatch(chosen_ids, chosen_mask, rejected_ids, rejected_mask, margins)
