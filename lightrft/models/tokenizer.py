"""The tokenizer of a model folder, set up the same way for every command, and its stop tokens.

It sits with the models, below everything that loads a model folder: the run's builders, the
reward judge's local model and the served policy all load its tokenizer through here."""

import json
from pathlib import Path
from typing import Optional


# The tokenizer classes that load a folder's tokenizer.json as it is written.
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def declared_tokenizer_class(path: str) -> Optional[str]:
    """The `tokenizer_class` a local folder's tokenizer_config.json names, else None."""
    config = Path(path) / "tokenizer_config.json"
    try:
        return json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def build_tokenizer(path: str, trust_remote_code: bool = False, padding_side: Optional[str] = None,
                    flag: str = "--pretrain"):
    """`AutoTokenizer` of `path` with a pad token (the EOS token when the tokenizer has none).
    `padding_side="left"` for prompts that a rollout engine continues (the PPO run).

    A folder whose tokenizer_config.json declares the generic backend (a tokenizer built in code,
    such as `lightrft.utils.tiny`'s) loads as that: transformers 5 would otherwise pick the model
    type's tokenizer class (Qwen2's for a qwen2 config), whose own pre-tokenizer drops the spaces
    and newlines the saved tokenizer.json keeps. A missing folder or a Hub id that cannot be
    reached is an error naming `flag` and the path (`resolve_pretrained`, `explain_load_errors`)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from lightrft.models.hf_utils import explain_load_errors, resolve_pretrained

    path = resolve_pretrained(path, flag)
    with explain_load_errors(path, flag):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if declared_tokenizer_class(path) in GENERIC_TOKENIZERS and type(tokenizer).__name__ not in GENERIC_TOKENIZERS:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
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
