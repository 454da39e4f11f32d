"""Prompts for reinforcement fine-tuning: items are (prompt, label), each prompt a `PromptRecord`
(`lightrft.datasets.prompt_record`: its text, its ids encoded once, its images)."""

from pathlib import Path
from typing import Any, Sequence

from torch.utils.data import Dataset

from lightrft.config.sections import check_input_template
from lightrft.datasets.chat import render_chat, require_chat_template, to_messages
from lightrft.datasets.images import ImagePrompts, flatten_image_parts, image_values, open_image
from lightrft.datasets.loaders import resolve_rows
from lightrft.datasets.prompt_record import PromptRecord
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

    Items are `(PromptRecord, label)` in row order: each prompt is encoded once, here, and the
    record carries its text and ids (`lightrft.datasets.prompt_record`); `collate_fn` turns a batch
    into `(list[PromptRecord], list[label])`. `flag` is the option a path came from, for error
    messages.

    With `image_key` (and `images`, the model's `ImagePrompts`) a row may carry images in that
    field (`lightrft.datasets.images`: paths relative to the data file, bytes, base64); its prompt
    marks each with an `{"type": "image"}` content part or the image marker, and becomes a
    `PromptRecord` whose `token_ids` hold the expanded placeholders. Such a prompt is never
    truncated (that would cut an image's placeholders): over `prompt_max_len` it is a bad row, as
    is one with more than `max_images` images. The
    images are checked when the dataset is built and decoded again, with their model inputs
    (`media`), when an item is fetched, so memory holds only a batch's pixels."""

    def __init__(self, rows_or_path: str | Path | Sequence[dict], tokenizer: Any, input_key: str = "input",
                 label_key: str | None = None, apply_chat_template: bool = False, prompt_max_len: int = 1024,
                 on_bad_row: str = "error", source_name: str | None = None, input_template: str | None = None,
                 truncate_long_prompts: bool = False, max_samples: int | None = None, flag: str = "--prompt_data",
                 image_key: str | None = None, images: ImagePrompts | None = None, max_images: int | None = None):
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
        if image_key and images is None:
            raise ValueError(f"--image_key {image_key}: the model's processor is needed to read images "
                             "(PromptDataset(images=ImagePrompts(processor, family)))")
        self.image_key, self.images, self.max_images = image_key, images, max_images
        # Relative image paths are read from the data file's folder (a saved dataset's own folder).
        self.base_dir = None
        if isinstance(rows_or_path, (str, Path)):
            path = Path(rows_or_path).expanduser()
            self.base_dir = path if path.is_dir() else path.parent
        rows, source = resolve_rows(rows_or_path, source_name, max_samples, flag)
        self.source = source
        self.items, self.row_indices, self.skip_report = process_rows(rows, self._build, source, on_bad_row)

    @property
    def skipped(self) -> int:
        return self.skip_report.skipped

    def _build(self, index: int, row: Any) -> tuple:
        kind = "text_or_messages" if self.apply_chat_template else "text"
        if self.image_key and isinstance(row, dict) and isinstance(row.get(self.input_key), list):
            row = {**row, self.input_key: flatten_image_parts(row[self.input_key], self.images.marker,
                                                              self.input_key, self.source, index)}
        value = check_field(row, self.input_key, kind, self.source, index)
        label = None if self.label_key is None else check_field(row, self.label_key, "any", self.source, index)
        prompt = self._render(value, index)
        if self.image_key:
            prompt = self.images.with_markers(prompt)
            sources = image_values(row, self.image_key, self.source, index)
            if sources or self.images.count_markers(prompt):
                return self._build_with_images(index, prompt, sources), label
        return self._fit(prompt, index), label

    def _render(self, value: Any, index: int) -> str:
        if self.apply_chat_template:
            messages = to_messages(value, self.input_key, self.source, index)
            return render_chat(self.tokenizer, messages, True, self.input_key, self.source, index)
        return value if self.input_template is None else self.input_template.format(value)

    def _build_with_images(self, index: int, prompt: str, sources: list) -> tuple[str, tuple[int, ...], list]:
        """(prompt text, its expanded ids, the image entries) of a row with images, checked."""
        if self.max_images is not None and len(sources) > self.max_images:
            raise DatasetRowError(self.source, index, self.image_key,
                                  f"holds {len(sources)} images, over --max_images_per_prompt {self.max_images}",
                                  "raise --max_images_per_prompt or skip such rows with --on_bad_row skip",
                                  kind="too many images")
        images = [open_image(value, self.base_dir, self.source, index, f"{self.image_key}[{i}]")
                  for i, value in enumerate(sources)]
        markers = self.images.count_markers(prompt)
        if markers != len(images):
            raise DatasetRowError(self.source, index, self.input_key,
                                  f"the prompt marks {markers} image(s) ({self.images.marker!r} or "
                                  f"{{'type': 'image'}} parts) but {self.image_key!r} holds {len(images)}",
                                  "mark each image once where it goes in the prompt", kind="image count")
        ids = self.images.expand(prompt, images, add_special_tokens=not self.apply_chat_template)
        if len(ids) > self.prompt_max_len:
            raise DatasetRowError(self.source, index, self.input_key,
                                  f"the prompt is {len(ids)} tokens with its images' placeholders, over "
                                  f"--prompt_max_len {self.prompt_max_len} (a prompt with images is never "
                                  "truncated: that would cut an image's placeholders)",
                                  "raise --prompt_max_len or skip such rows with --on_bad_row skip", kind="over-long")
        return prompt, tuple(ids), sources

    def _fit(self, prompt: str, index: int) -> PromptRecord:
        """The record of a text prompt: encoded as rollouts encode it, once; an over-long one keeps
        its last `prompt_max_len` ids (the question is usually last) and the text of those."""
        ids = encode_prompts(self.tokenizer, [prompt], self.apply_chat_template)[0]
        if len(ids) <= self.prompt_max_len:
            return PromptRecord(prompt, ids)
        if self.truncate_long_prompts:
            kept = ids[-self.prompt_max_len:]
            return PromptRecord(self.tokenizer.decode(kept, skip_special_tokens=False), kept)
        raise DatasetRowError(self.source, index, self.input_key,
                              f"the prompt is {len(ids)} tokens after tokenization, over --prompt_max_len "
                              f"{self.prompt_max_len}",
                              "raise --prompt_max_len or skip such rows with --on_bad_row skip (in code, "
                              "truncate_long_prompts=True keeps their last tokens)", kind="over-long")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> tuple[PromptRecord, Any]:
        prompt, label = self.items[idx]
        if isinstance(prompt, tuple):      # a prompt with images: its pictures decoded on fetch
            text, ids, sources = prompt
            row = self.row_indices[idx]
            images = [open_image(value, self.base_dir, self.source, row, f"{self.image_key}[{i}]")
                      for i, value in enumerate(sources)]
            prompt = PromptRecord(text, ids, images, self.images.media(images) if images else None,
                                  self.images.marker_ids(text, add_special_tokens=not self.apply_chat_template))
        return prompt, label

    def texts(self) -> list[str]:
        """Every prompt's text, without decoding images."""
        return [p[0] if isinstance(p, tuple) else p.text for p, _ in self.items]

    def token_ids(self) -> list[tuple[int, ...]]:
        """Every prompt's token ids (as encoded when the dataset was built), without decoding images."""
        return [p[1] if isinstance(p, tuple) else p.token_ids for p, _ in self.items]

    @staticmethod
    def collate_fn(batch: list[tuple[PromptRecord, Any]]) -> tuple[list[PromptRecord], list[Any]]:
        prompts, labels = zip(*batch)
        return list(prompts), list(labels)
