"""The prompt set of a run."""

from lightrft.config.sections import PPODataConfig


def build_prompt_dataset(data: PPODataConfig, tokenizer, path: str | None = None):
    """The `PromptDataset` of `--prompt_data` (or of `path`, e.g. `--eval_data`, read the same way)."""
    from lightrft.datasets import PromptDataset

    return PromptDataset(path or data.prompt_data, tokenizer, input_key=data.input_key, label_key=data.label_key,
                         apply_chat_template=data.apply_chat_template, prompt_max_len=data.prompt_max_len,
                         on_bad_row=data.on_bad_row, max_samples=None if path else data.max_samples,
                         truncate_long_prompts=data.truncate_long_prompts,
                         flag="--eval_data" if path else "--prompt_data")
