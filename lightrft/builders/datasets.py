"""The prompt set of a run."""

from lightrft.config.sections import PPODataConfig


def build_prompt_dataset(data: PPODataConfig, tokenizer, path: str | None = None, images=None):
    """The `PromptDataset` of `--prompt_data` (or of `path`, e.g. `--eval_data`, read the same way);
    `images` (`build_image_prompts`) reads the `--image_key` field."""
    from lightrft.datasets import PromptDataset

    return PromptDataset(path or data.prompt_data, tokenizer, input_key=data.input_key, label_key=data.label_key,
                         apply_chat_template=data.apply_chat_template, prompt_max_len=data.prompt_max_len,
                         on_bad_row=data.on_bad_row, max_samples=None if path else data.max_samples,
                         truncate_long_prompts=data.truncate_long_prompts,
                         flag="--eval_data" if path else "--prompt_data", image_key=data.image_key, images=images,
                         max_images=data.max_images_per_prompt)


def build_image_prompts(pretrain: str, tokenizer, trust_remote_code: bool = False):
    """The `ImagePrompts` of a vision-language model folder (its processor, with the run's
    `tokenizer`, and its model family), for `--image_key`; an error naming the folder when it is
    not a vision-language model or has no processor files."""
    from transformers import AutoConfig

    from lightrft.datasets.images import ImagePrompts
    from lightrft.models.families import ModelFamily, family_for

    config = AutoConfig.from_pretrained(pretrain, trust_remote_code=trust_remote_code)
    family = family_for(config)
    if type(family).image_media is ModelFamily.image_media:
        what = ("a vision-language model of a kind lightrft does not train yet" if hasattr(config, "vision_config")
                else "a model that takes no images")
        raise ValueError(f"--image_key is set but --pretrain {pretrain} is a {config.model_type!r} model, {what}: "
                         "pass a model of a family docs/vlm.md lists, or drop --image_key")
    try:
        processor = family.load_processor(pretrain, tokenizer, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as err:
        raise ValueError(f"--pretrain {pretrain}: its processor could not be loaded ({type(err).__name__}: {err}); "
                         "a vision-language model folder needs its processor files (processor_config.json or "
                         "preprocessor_config.json, saved with processor.save_pretrained)") from None
    if getattr(processor, "image_processor", None) is None:
        raise ValueError(f"--pretrain {pretrain}: {type(processor).__name__} has no image processor; save the "
                         "model's processor (processor.save_pretrained) into the folder")
    processor.tokenizer = tokenizer          # the run's tokenizer: its pad token and padding side
    return ImagePrompts(processor, family)
