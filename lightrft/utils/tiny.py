"""Tiny tokenizers and causal LMs built in code, for tests, benchmarks and the quickstart.

Nothing here downloads anything: the tokenizer is character level over printable ASCII and the
models are Qwen2- or Llama-shaped transformers built from a small config with seeded weights.
"""

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: 4 special tokens, then the 95 printable ASCII characters and
    newline (100 tokens). Decoding concatenates characters, so `decode(encode(s)) == s`.
    Padding is on the left, as generation wants; `pad_token_id=0`, `eos_token_id=2`."""
    chars = list(string.printable[:95]) + ["\n"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_causal_lm(
    tokenizer: PreTrainedTokenizerFast,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> torch.nn.Module:
    """A randomly initialised Qwen2- or Llama-shaped causal LM sized for `tokenizer`, in float32.

    The weights depend only on `seed` and the sizes, so two calls give identical models."""
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    if arch == "qwen2":
        config, model_cls = Qwen2Config(**kwargs), Qwen2ForCausalLM
    elif arch == "llama":
        config, model_cls = LlamaConfig(**kwargs), LlamaForCausalLM
    else:
        raise ValueError(f"unknown tiny model arch {arch!r}; choose 'qwen2' or 'llama'")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.float()


def save_tiny_model(path: str | Path, arch: str = "qwen2", seed: int = 0, **sizes) -> Path:
    """Builds the character tokenizer and a tiny model and saves both as a Hugging Face folder
    that `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load."""
    path = Path(path)
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, arch=arch, seed=seed, **sizes)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
