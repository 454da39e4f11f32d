"""Supervised fine-tuning samples: token ids with the loss on response tokens only.

A row is either a prompt/response pair (`input_key` + `output_key`) or, with `output_key=None`, a
chat conversation whose assistant turns are all trained on. The full text is tokenized once and
each token is labelled by where its first character falls (response spans come from the chat
template, see `assistant_spans`), so tokens merged across the prompt/response border are handled
the same way the model will see them. EOS is appended unless the text already ends with it.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.utils.data import Dataset

from lightrft.config.sections import check_input_template
from lightrft.datasets.chat import assistant_spans, require_chat_template, to_messages
from lightrft.datasets.loaders import resolve_rows
from lightrft.datasets.padding import right_pad
from lightrft.datasets.validation import DatasetRowError, check_field, process_rows
from lightrft.models.packing import pack_sequences

IGNORE_INDEX = -100


@dataclass
class SFTSample:
    input_ids: torch.Tensor  # (T,) long
    labels: torch.Tensor  # (T,) long, IGNORE_INDEX on prompt tokens


@dataclass
class SFTBatch:
    """A micro-batch for `ActorLanguage.forward(input_ids, num_actions, attention_mask, packed_seq_lens)`.

    Padded: `input_ids`, `attention_mask`, `labels` are (B, T), right-padded; `num_actions = T - 1`
    and the actor returns log-probs of tokens 1..T-1, so `loss_mask` is (B, T - 1).
    Packed: `input_ids`, `attention_mask`, `labels` are (1, P) with `packed_seq_lens` (N lengths);
    `num_actions[i] = packed_seq_lens[i] - 1` and `loss_mask` is (N, max(num_actions)), left-aligned
    like the actor's packed output. Either way `loss_mask[i, j]` says whether the log-prob of token
    j + 1 of sample i is trained on."""

    input_ids: torch.Tensor  # (B, T) or (1, P)
    attention_mask: torch.Tensor  # (B, T) or (1, P)
    labels: torch.Tensor  # (B, T) or (1, P); IGNORE_INDEX on prompt and padding
    loss_mask: torch.Tensor  # (B, A) bool, A = T - 1 (padded) or max(num_actions) (packed)
    num_actions: int | list[int]
    packed_seq_lens: list[int] | None = None

    @property
    def num_samples(self) -> int:
        return self.loss_mask.shape[0]


class SFTDataset(Dataset):
    """Tokenized SFT samples, in row order.

    `input_key` holds the prompt (a string, or chat messages with `apply_chat_template`) and
    `output_key` the response (a string, or assistant messages); with `output_key=None`, `input_key`
    holds a whole conversation and every assistant turn is trained on. Without a chat template the
    text is `prompt + response` (put separators in the data or in `input_template`). A sample longer
    than `max_len` keeps its first `max_len` tokens; one whose response then has no token left is a
    bad row. `flag` is the option a path came from, for error messages."""

    def __init__(self, rows_or_path: str | Path | Sequence[dict], tokenizer: Any, input_key: str = "input",
                 output_key: str | None = "output", apply_chat_template: bool = False, max_len: int = 2048,
                 on_bad_row: str = "error", source_name: str | None = None, input_template: str | None = None,
                 max_samples: int | None = None, flag: str = "--dataset"):
        if max_len < 2:
            raise ValueError(f"--max_len must be at least 2, got {max_len}")
        check_input_template(input_template)
        if output_key is None and not apply_chat_template:
            raise ValueError("training on whole conversations (no --output_key) needs --apply_chat_template")
        if apply_chat_template:
            require_chat_template(tokenizer)
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("SFTDataset needs a fast (Rust) tokenizer for its character offsets; load the tokenizer "
                             "with use_fast=True")
        self.tokenizer = tokenizer
        self.input_key = input_key
        self.output_key = output_key
        self.apply_chat_template = apply_chat_template
        self.max_len = max_len
        self.input_template = input_template
        rows, source = resolve_rows(rows_or_path, source_name, max_samples, flag)
        self.source = source
        self.samples, self.row_indices, self.skip_report = process_rows(rows, self._build, source, on_bad_row)

    @property
    def skipped(self) -> int:
        return self.skip_report.skipped

    def _text_and_spans(self, index: int, row: Any) -> tuple[str, list[tuple[int, int]]]:
        if not self.apply_chat_template:
            prompt = check_field(row, self.input_key, "text", self.source, index)
            response = check_field(row, self.output_key, "text", self.source, index)
            if self.input_template is not None:
                prompt = self.input_template.format(prompt)
            return prompt + response, [(len(prompt), len(prompt) + len(response))]
        if self.output_key is None:
            messages = check_field(row, self.input_key, "messages", self.source, index)
            return assistant_spans(self.tokenizer, [dict(m) for m in messages], 0, self.input_key, self.source, index)
        prompt = check_field(row, self.input_key, "text_or_messages", self.source, index)
        response = check_field(row, self.output_key, "text_or_messages", self.source, index)
        messages = to_messages(prompt, self.input_key, self.source, index)
        if isinstance(response, str):
            answer = [{"role": "assistant", "content": response}]
        else:
            answer = to_messages(response, self.output_key, self.source, index)
        return assistant_spans(self.tokenizer, messages + answer, len(messages), self.output_key, self.source, index)

    def _build(self, index: int, row: Any) -> SFTSample:
        text, spans = self._text_and_spans(index, row)
        train_key = self.output_key or self.input_key
        if not spans:
            raise DatasetRowError(self.source, index, train_key, "has no assistant message to train on",
                                  kind="no response")
        enc = self.tokenizer(text, add_special_tokens=not self.apply_chat_template, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        trained = [any(start <= begin < end for start, end in spans) for begin, _ in enc["offset_mapping"]]
        eos = self.tokenizer.eos_token_id
        # A template that closes each turn with EOS (ChatML's <|im_end|>) renders a newline after it:
        # the turn ends at the EOS, so what follows it in the span is not trained, and no second EOS
        # is appended (a policy stops at the first one and never samples "<|im_end|>\n<|im_end|>").
        for k in range(1, len(ids)):
            if trained[k] and trained[k - 1] and ids[k - 1] == eos:
                trained[k] = False
        last = max((k for k, on in enumerate(trained) if on), default=len(ids) - 1)
        if ids[last] != eos:
            ids.append(eos)
            trained.append(True)
        ids, trained = ids[: self.max_len], trained[: self.max_len]
        # Position 0 is never predicted; leaving it unlabelled also keeps a packed row's labels from
        # asking the previous sample's last token to predict this one's first.
        trained[0] = False
        if not any(trained):
            raise DatasetRowError(self.source, index, self.input_key,
                                  f"the prompt fills all {self.max_len} tokens of --max_len, no response token is "
                                  "left to train on", "raise --max_len or skip such rows with --on_bad_row skip",
                                  kind="over-long")
        input_ids = torch.tensor(ids, dtype=torch.long)
        labels = torch.where(torch.tensor(trained), input_ids, torch.full_like(input_ids, IGNORE_INDEX))
        return SFTSample(input_ids, labels)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> SFTSample:
        return self.samples[idx]

    def collate_fn(self, batch: list[SFTSample]) -> SFTBatch:
        return pad_sft_batch(batch, self.tokenizer.pad_token_id)

    def packing_collate_fn(self, batch: list[SFTSample]) -> SFTBatch:
        return pack_sft_batch(batch)


def pad_sft_batch(batch: list[SFTSample], pad_token_id: int) -> SFTBatch:
    """Right-pads samples to the longest one. Shape: (B, T); loss_mask (B, T - 1)."""
    input_ids, attention_mask = right_pad([s.input_ids for s in batch], pad_token_id)
    labels, _ = right_pad([s.labels for s in batch], IGNORE_INDEX)
    return SFTBatch(input_ids, attention_mask, labels, loss_mask=labels[:, 1:] != IGNORE_INDEX,
                    num_actions=input_ids.shape[1] - 1)


def pack_sft_batch(batch: list[SFTSample]) -> SFTBatch:
    """Concatenates samples into one row of P = sum of lengths tokens. Shape: (1, P); loss_mask (N, A)
    with A = max(len) - 1, row i left-aligned (the actor's packed layout)."""
    packed = pack_sequences([s.input_ids for s in batch])
    seq_lens, input_ids = packed.seq_lens, packed.input_ids  # (1, P)
    labels = torch.cat([s.labels for s in batch]).unsqueeze(0)  # (1, P)
    loss_mask = torch.zeros((len(batch), max(seq_lens) - 1), dtype=torch.bool)
    for i, sample in enumerate(batch):
        loss_mask[i, : seq_lens[i] - 1] = sample.labels[1:] != IGNORE_INDEX
    return SFTBatch(input_ids, torch.ones_like(input_ids), labels, loss_mask,
                    num_actions=[n - 1 for n in seq_lens], packed_seq_lens=seq_lens)
