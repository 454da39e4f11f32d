"""Prompts for reinforcement fine-tuning: items are (prompt text, label)."""

from pathlib import Path
from typing import Any, Sequence

from torch.utils.data import Dataset

from lightrft.config.sections import check_input_template
from lightrft.datasets.chat import render_chat, require_chat_template, to_messages
from lightrft.datasets.loaders import resolve_rows
from lightrft.datasets.validation import DatasetRowError, check_field, process_rows


def encode_prompts(tokenizer: Any, prompts: Sequence[str], templated: bool) -> list[list[int]]:
    """Token ids of prompts exactly as SFT, reward models and length checks see them: templated
    text already holds its special tokens, so only raw text gets the tokenizer's own (a BOS for
    Llama-style tokenizers). Rollouts use this too, so the policy is sampled from the same prompt
    ids it was fine-tuned on."""
    return [list(ids) for ids in tokenizer(list(prompts), add_special_tokens=not templated)["input_ids"]]


class PromptDataset(Dataset):
    """Prompt texts ready for the rollout engine, with the label the reward function receives.

    `rows_or_path`: a data file / saved dataset folder (see `load_rows`) or a sequence of row dicts
    (then `source_name` names them in errors). `input_key` holds a string or a list of chat messages;
    with `apply_chat_template` a string becomes one user message and the tokenizer's template is
    applied with the generation prompt; without it the string is used as is (after
    `input_template.format(text)` when given) and a list of messages is an error. `label_key` is
    optional (labels are then None). A prompt longer than `prompt_max_len` tokens is a bad row, or
    keeps its last `prompt_max_len` tokens with `truncate_long_prompts=True`. `max_samples` keeps
    only the first rows.

    Items are `(prompt_text, label)` in row order; `collate_fn` turns a batch into
    `(list[str], list[label])`. `flag` is the option a path came from, for error messages."""

    def __init__(self, rows_or_path: str | Path | Sequence[dict], tokenizer: Any, input_key: str = "input",
                 label_key: str | None = None, apply_chat_template: bool = False, prompt_max_len: int = 1024,
                 on_bad_row: str = "error", source_name: str | None = None, input_template: str | None = None,
                 truncate_long_prompts: bool = False, max_samples: int | None = None, flag: str = "--prompt_data"):
        if prompt_max_len <= 0:
            raise ValueError(f"--prompt_max_len must be positive, got {prompt_max_len}")
        check_input_template(input_template)
        if apply_chat_template:
            require_chat_template(tokenizer)
        self.tokenizer = tokenizer
        self.input_key = input_key
        self.label_key = label_key
        self.apply_chat_template = apply_chat_template
        self.prompt_max_len = prompt_max_len
        self.input_template = input_template
        self.truncate_long_prompts = truncate_long_prompts
        rows, source = resolve_rows(rows_or_path, source_name, max_samples, flag)
        self.source = source
        self.items, self.row_indices, self.skip_report = process_rows(rows, self._build, source, on_bad_row)

    @property
    def skipped(self) -> int:
        return self.skip_report.skipped

    def _build(self, index: int, row: Any) -> tuple[str, Any]:
        kind = "text_or_messages" if self.apply_chat_template else "text"
        value = check_field(row, self.input_key, kind, self.source, index)
        label = None if self.label_key is None else check_field(row, self.label_key, "any", self.source, index)
        if self.apply_chat_template:
            messages = to_messages(value, self.input_key, self.source, index)
            prompt = render_chat(self.tokenizer, messages, True, self.input_key, self.source, index)
        else:
            prompt = value if self.input_template is None else self.input_template.format(value)
        return self._fit(prompt, index), label

    def _fit(self, prompt: str, index: int) -> str:
        ids = encode_prompts(self.tokenizer, [prompt], self.apply_chat_template)[0]
        if len(ids) <= self.prompt_max_len:
            return prompt
        if self.truncate_long_prompts:
            return self.tokenizer.decode(ids[-self.prompt_max_len:], skip_special_tokens=False)
        raise DatasetRowError(self.source, index, self.input_key,
                              f"the prompt is {len(ids)} tokens after tokenization, over --prompt_max_len "
                              f"{self.prompt_max_len}",
                              "raise --prompt_max_len or skip such rows with --on_bad_row skip (in code, "
                              "truncate_long_prompts=True keeps their last tokens)", kind="over-long")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> tuple[str, Any]:
        return self.items[idx]

    @staticmethod
    def collate_fn(batch: list[tuple[str, Any]]) -> tuple[list[str], list[Any]]:
        prompts, labels = zip(*batch)
        return list(prompts), list(labels)
