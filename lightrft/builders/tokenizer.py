"""The tokenizer of a model folder, set up the same way for every command, and its stop tokens."""

from typing import Optional


def build_tokenizer(path: str, trust_remote_code: bool = False, padding_side: Optional[str] = None):
    """`AutoTokenizer` of `path` with a pad token (the EOS token when the tokenizer has none).
    `padding_side="left"` for prompts that a rollout engine continues (the PPO run)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if padding_side is not None:
        tokenizer.padding_side = padding_side
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(tokenizer, model_path: str) -> list[int]:
    """The ids that end a response, the same for every engine: the tokenizer's EOS plus the
    model's generation config EOS ids (instruct models often stop on an end-of-turn token)."""
    from transformers import GenerationConfig

    ids = [tokenizer.eos_token_id]
    try:
        extra = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):
        extra = None
    for token in [extra] if isinstance(extra, int) else (extra or []):
        if token not in ids:
            ids.append(token)
    return ids
