"""Tiny tokenizers and causal LMs built in code, for tests, benchmarks and the quickstart.

Nothing here downloads anything: the tokenizer is character level over printable ASCII and the
models are transformers built from a small config with seeded weights: Qwen2- or Llama-shaped
(`build_tiny_causal_lm`), or any architecture of `TINY_ARCHS` (`build_tiny_arch`), the model
families the compatibility matrix (tests/models/test_arch_matrix.py, docs/models.md) covers.
"""

import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3MoeConfig,
)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _char_tokenizer(backend: Tokenizer) -> PreTrainedTokenizerFast:
    """The Hugging Face tokenizer around a character-level `backend`, with the special tokens,
    left padding and the chat template every tiny model uses."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>", padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: 4 special tokens, then the 95 printable ASCII characters and
    newline (100 tokens). Decoding concatenates characters, so `decode(encode(s)) == s`.
    Padding is on the left, as generation wants; `pad_token_id=0`, `eos_token_id=2`."""
    chars = list(string.printable[:95]) + ["\n"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return _char_tokenizer(backend)


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
    tie_word_embeddings: bool = False,
) -> torch.nn.Module:
    """A randomly initialised Qwen2- or Llama-shaped causal LM sized for `tokenizer`, in float32.
    `tie_word_embeddings=True` shares one matrix between the input embeddings and the LM head,
    as SmolLM2, Qwen2.5-0.5B and Gemma do.

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
        tie_word_embeddings=tie_word_embeddings,
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


def build_char_tokenizer_with_bos() -> PreTrainedTokenizerFast:
    """`build_char_tokenizer` whose encodings start with "<s>" (id 1), as Llama's and Gemma's
    tokenizers do: `encode("ab") == [1, ...]`, and the chat template sees the same BOS rule."""
    tokenizer = build_char_tokenizer()
    backend = tokenizer.backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    return _char_tokenizer(backend)


# Every tiny architecture: hidden 64, 2 layers, 2 query heads of head_dim 32 (>= 32 so vLLM's CPU
# attention takes the same configs), one KV head where the family has grouped-query attention.
# Sliding windows are 8 tokens, so sequences of 9+ tokens cross them. Weights are drawn with std
# 0.1 (not the usual 0.02) so attention is far from uniform and soft-caps bite: a window or a cap
# that is ignored changes log-probs by tenths of a nat, not by 1e-5.
TINY_WINDOW = 8
TINY_INIT_STD = 0.1
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False,
               initializer_range=TINY_INIT_STD)
_TIED = {**_COMMON, "tie_word_embeddings": True}  # Gemma ties its LM head to the embeddings (vLLM assumes it)


@dataclass(frozen=True)
class TinyArch:
    """A tiny configuration of one model family."""

    name: str  # key in TINY_ARCHS
    family: str  # what users know it as
    config: Callable[[dict], PretrainedConfig]  # token-id kwargs -> config
    bos_tokenizer: bool = False  # the family's tokenizers add BOS (build_char_tokenizer_with_bos)
    features: str = ""  # what this tiny config exercises


def _gpt2(ids: dict) -> PretrainedConfig:
    # GPT-2 keeps its default dropout (0.1 everywhere), which RL must switch off.
    return GPT2Config(n_embd=64, n_layer=2, n_head=2, n_inner=128, n_positions=512,
                      initializer_range=TINY_INIT_STD, **ids)


TINY_ARCHS: dict[str, TinyArch] = {arch.name: arch for arch in [
    TinyArch("llama", "Llama", lambda ids: LlamaConfig(**_COMMON, **ids), bos_tokenizer=True,
             features="grouped-query attention, BOS-adding tokenizer"),
    TinyArch("llama_tied", "Llama, tied embeddings (SmolLM2, Llama 3.2 1B)", lambda ids: LlamaConfig(**_TIED, **ids),
             bos_tokenizer=True, features="one matrix for the input embeddings and the LM head"),
    TinyArch("qwen2", "Qwen2 / Qwen2.5", lambda ids: Qwen2Config(
        **_COMMON, use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=1, **ids),
        features=f"`use_sliding_window`: layer 0 full, layer 1 window {TINY_WINDOW}"),
    TinyArch("qwen3", "Qwen3", lambda ids: Qwen3Config(**_COMMON, head_dim=32, **ids),
             features="QK-norm"),
    TinyArch("qwen3_moe", "Qwen3-MoE", lambda ids: Qwen3MoeConfig(
        **_COMMON, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, **ids),
        features="4 experts, top-2"),
    TinyArch("mixtral", "Mixtral", lambda ids: MixtralConfig(
        **_COMMON, num_local_experts=4, num_experts_per_tok=2, **ids), features="4 experts, top-2"),
    TinyArch("olmoe", "OLMoE", lambda ids: OlmoeConfig(
        **_COMMON, num_experts=4, num_experts_per_tok=2, **ids), features="4 experts, top-2, QK-norm"),
    TinyArch("deepseek_v3", "DeepSeek-V3 (MoE with shared experts, MLA)", lambda ids: DeepseekV3Config(
        **{**_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 2}, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=2, topk_group=1,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, rope_scaling=None,
        **ids), features="a dense first layer, then 4 routed experts top-2 in 2 groups (1 chosen) plus a shared "
                         "expert; multi-head latent attention"),
    TinyArch("mistral", "Mistral", lambda ids: MistralConfig(**_COMMON, sliding_window=TINY_WINDOW, **ids),
             features=f"sliding window {TINY_WINDOW} on every layer"),
    TinyArch("gemma2", "Gemma 2", lambda ids: Gemma2Config(
        **_TIED, head_dim=32, sliding_window=TINY_WINDOW, query_pre_attn_scalar=32,
        attn_logit_softcapping=1.0, final_logit_softcapping=30.0, **ids),
        features=f"alternating window {TINY_WINDOW} / full layers, attention soft-cap 1, final soft-cap 30, tied embeddings"),
    TinyArch("gemma3", "Gemma 3 (text)", lambda ids: Gemma3TextConfig(
        **_TIED, head_dim=32, sliding_window=TINY_WINDOW, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"], **ids), bos_tokenizer=True,
        features=f"window {TINY_WINDOW} / full layers, QK-norm, scaling 16^-0.5, tied embeddings"),
    TinyArch("phi3", "Phi-3", lambda ids: Phi3Config(**_COMMON, sliding_window=TINY_WINDOW, **ids),
             features=f"fused QKV, sliding window {TINY_WINDOW}"),
    TinyArch("gpt_neox", "GPT-NeoX / Pythia", lambda ids: GPTNeoXConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=TINY_INIT_STD, **ids),
        features="partial rotary, parallel residual"),
    TinyArch("gpt2", "GPT-2", _gpt2, features="learned positions, default dropout 0.1"),
]}


def tiny_tokenizer(arch: str) -> PreTrainedTokenizerFast:
    """The character tokenizer that matches `arch` (with BOS where the family adds one)."""
    return build_char_tokenizer_with_bos() if _tiny_arch(arch).bos_tokenizer else build_char_tokenizer()


def _tiny_arch(arch: str) -> TinyArch:
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    return TINY_ARCHS[arch]


def build_tiny_arch(arch: str, tokenizer: PreTrainedTokenizerFast | None = None, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised tiny causal LM of family `arch` (a key of TINY_ARCHS) in float32,
    sized for `tokenizer` (default `tiny_tokenizer(arch)`). Same seed, same weights."""
    spec = _tiny_arch(arch)
    tokenizer = tokenizer or tiny_tokenizer(arch)
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = spec.config(ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.float()


def save_tiny_arch(path: str | Path, arch: str, seed: int = 0) -> Path:
    """`build_tiny_arch` and its tokenizer saved as a Hugging Face folder."""
    path = Path(path)
    tokenizer = tiny_tokenizer(arch)
    build_tiny_arch(arch, tokenizer, seed=seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ------------------------------------------------------------------------- vision-language models
IDEFICS3_IMAGE_TOKENS = ("<image>", "<fake_token_around_image>")


def build_vlm_tokenizer() -> PreTrainedTokenizerFast:
    """`build_char_tokenizer` plus Idefics3's image tokens: `<image>` (id 100), the placeholder one
    image's features replace, and `<fake_token_around_image>` (id 101), which brackets each run."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(IDEFICS3_IMAGE_TOKENS)})
    return tokenizer


def build_tiny_idefics3(tokenizer: PreTrainedTokenizerFast | None = None, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised tiny Idefics3 (the SmolVLM architecture) in float32: a Llama decoder
    (hidden 64, 2 layers, head dimension 32, one KV head) and a SigLIP vision tower (56 x 56
    images, 14-pixel patches, 2 layers) whose pixel shuffle (scale 2) makes 4 `<image>` tokens per
    image. Same seed, same weights."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    tokenizer = tokenizer or build_vlm_tokenizer()
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                max_position_embeddings=256, initializer_range=0.1, pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=14)
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config)
    return model.float().eval()


def build_tiny_idefics3_processor(tokenizer: PreTrainedTokenizerFast | None = None):
    """The processor of `build_tiny_idefics3`: transformers' PIL image processor (no torchvision),
    every image resized to 56 x 56 without splitting, so each becomes one run of 4 `<image>`
    tokens between `<fake_token_around_image>` tokens."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    image_processor = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 56},
                                                max_image_size={"longest_edge": 56})
    return Idefics3Processor(image_processor, tokenizer or build_vlm_tokenizer(), image_seq_len=4)


def save_tiny_idefics3(path: str | Path, seed: int = 0) -> Path:
    """Builds the tiny Idefics3 and its processor (`build_tiny_idefics3_processor`) and saves both
    as a Hugging Face folder that `AutoModelForImageTextToText` and `AutoProcessor` load."""
    path = Path(path)
    tokenizer = build_vlm_tokenizer()
    processor = build_tiny_idefics3_processor(tokenizer)   # adds its own tokens (<end_of_utterance>) first
    build_tiny_idefics3(processor.tokenizer, seed=seed).save_pretrained(path)
    processor.save_pretrained(path)
    return path


QWEN_VL_IMAGE_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def build_qwen_vl_tokenizer() -> PreTrainedTokenizerFast:
    """`build_char_tokenizer` plus Qwen-VL's vision tokens (`<|vision_start|>`, `<|vision_end|>`,
    `<|image_pad|>`, `<|video_pad|>`)."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_VL_IMAGE_TOKENS)})
    return tokenizer


def build_tiny_qwen_vl(version: str = "2.5", tokenizer: PreTrainedTokenizerFast | None = None,
                       seed: int = 0) -> torch.nn.Module:
    """A randomly initialised tiny Qwen2-VL (`version` "2"), Qwen2.5-VL ("2.5") or Qwen3-VL ("3")
    in float32: a decoder (hidden 64, 2 layers, head dimension 32, one KV head, M-RoPE sections
    4/6/6) and a 2-layer ViT (14-pixel patches, 2 x 2 merge; Qwen2.5-VL: window attention in its
    first layer; Qwen3-VL: 16-pixel patches, deepstack features from both layers). Same seed,
    same weights."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration)

    tokenizer = tokenizer or build_qwen_vl_tokenizer()
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in
           zip(("vision_start", "vision_end", "image", "video"), QWEN_VL_IMAGE_TOKENS)}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, initializer_range=0.1,
                tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})
    vision = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                  initializer_range=0.1)
    if version == "2":
        config, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision.update(embed_dim=64, hidden_size=64, mlp_ratio=2)
    elif version == "2.5":
        config, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision.update(hidden_size=64, intermediate_size=128, out_hidden_size=64, window_size=56,
                      fullatt_block_indexes=[1])
    elif version == "3":
        config, model_class = Qwen3VLConfig, Qwen3VLForConditionalGeneration
        text.update(head_dim=32)
        text["rope_parameters"]["mrope_interleaved"] = True
        vision.update(patch_size=16, hidden_size=64, intermediate_size=128, out_hidden_size=64,
                      num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
    else:
        raise ValueError(f"unknown Qwen-VL version {version!r}: choose '2', '2.5' or '3'")
    config = config(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model.float().eval()


def build_tiny_qwen_vl_processor(tokenizer: PreTrainedTokenizerFast | None = None, version: str = "2.5"):
    """The processor of `build_tiny_qwen_vl` of `version`: transformers' PIL image processor (no
    torchvision; each image resized to 2 x 2 to 4 x 4 merged tokens) and the tokenizer, joined by
    `QwenVLImageText`."""
    from transformers import Qwen2VLImageProcessorPil

    from lightrft.utils.qwen_vl_processor import PROCESSOR_CLASSES, QwenVLImageText

    patch = 16 if version == "3" else 14
    block = 2 * patch          # one merged token
    image_processor = Qwen2VLImageProcessorPil(patch_size=patch, temporal_patch_size=2, merge_size=2,
                                               min_pixels=block * block * 4, max_pixels=block * block * 16)
    model_type = {"2": "qwen2_vl", "2.5": "qwen2_5_vl", "3": "qwen3_vl"}[version]
    return QwenVLImageText(tokenizer or build_qwen_vl_tokenizer(), image_processor, PROCESSOR_CLASSES[model_type])


def save_tiny_qwen_vl(path: str | Path, version: str = "2.5", seed: int = 0) -> Path:
    """The tiny Qwen-VL of `version` and its tokenizer and image processor, saved as a Hugging Face
    folder (`AutoModelForImageTextToText`; the family's `load_processor` reads the rest)."""
    path = Path(path)
    processor = build_tiny_qwen_vl_processor(version=version)
    build_tiny_qwen_vl(version, processor.tokenizer, seed=seed).save_pretrained(path)
    processor.save_pretrained(path)
    return path
