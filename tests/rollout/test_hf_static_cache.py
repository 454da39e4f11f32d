"""HFEngine with a static KV cache (`--hf_kv_cache static`) and a compiled decoding step
(`--hf_compile_decode`). On the CPU they sample what the dynamic cache samples: the same tokens,
masks, stop flags, versions and routes, and log-probs within float32 rounding, for greedy and
sampled decoding, left-padded prompts of three lengths, n samples sharing one prompt forward,
min_new_tokens, EOS stops, micro-batch chunks that split groups, several architectures (sliding
windows, soft-caps, learned positions), a vision-language model's rotary rows and images, and a
weight switch in the middle of decoding. The combinations that cannot run are refused, naming the
flag to change."""

import copy
import os
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3NextConfig

from lightrft.config import ConfigError, PPORunConfig
from lightrft.config.sections import RolloutConfig
from lightrft.datasets.images import ImagePrompts
from lightrft.datasets.prompt_record import PromptRecord
from lightrft.datasets.toy_images import draw_disc
from lightrft.models import ActorLanguage
from lightrft.models.families import family_of
from lightrft.rollout import RolloutOutput, SamplingParams, hf_engine_for
from lightrft.rollout.hf_engine import STATIC_CACHE_MULTIPLE
from lightrft.utils.tiny import (TINY_WINDOW, build_char_tokenizer, build_tiny_arch, build_tiny_qwen_vl,
                                 build_tiny_qwen_vl_processor, tiny_tokenizer)
from tests.rollout.contract import PROMPTS, build_contract_model
from tests.rollout.test_partial_rollouts import switch_at

# The compiled step's inductor kernels are cached per machine, as the vLLM tests' are: 20-40 s the
# first time on 2 CPU cores, a few seconds after.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser("~/.cache/lightrft/inductor"))

LOGPROB_ATOL = 1e-5  # float32: a forward over the static cache's masked extra slots rounds differently
LONG_PROMPT = "a prompt longer than the sliding window"  # 39 characters, TINY_WINDOW = 8


def assert_same_samples(static: RolloutOutput, dynamic: RolloutOutput) -> None:
    assert torch.equal(static.sequences, dynamic.sequences)
    assert torch.equal(static.attention_mask, dynamic.attention_mask)
    assert torch.equal(static.action_mask, dynamic.action_mask)
    assert torch.equal(static.truncated, dynamic.truncated)
    assert (static.versions is None) == (dynamic.versions is None)
    if static.versions is not None:
        assert torch.equal(static.versions, dynamic.versions)
    torch.testing.assert_close(static.rollout_log_probs, dynamic.rollout_log_probs, atol=LOGPROB_ATOL, rtol=0)


def both(model, tokenizer, prompts, params, seeds=None, **options) -> tuple[RolloutOutput, RolloutOutput]:
    """(static, dynamic): the same call through an engine of each cache."""
    static = hf_engine_for(model, tokenizer, kv_cache="static", **options).generate(prompts, params, seeds=seeds)
    dynamic = hf_engine_for(model, tokenizer, **options).generate(prompts, params, seeds=seeds)
    return static, dynamic


@pytest.fixture(scope="module")
def contract():
    """The contract's tiny Qwen2 (peaked, EOS likely: responses end at different lengths), its
    tokenizer and three prompts of different lengths."""
    tokenizer, model = build_contract_model()
    return tokenizer, model, [tokenizer.encode(p) for p in PROMPTS]


PARAMS = [
    SamplingParams(temperature=0.0, max_new_tokens=12, n=1),
    SamplingParams(temperature=0.0, max_new_tokens=12, n=3),
    SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=21),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=10, n=3, seed=22),
    SamplingParams(temperature=1.2, max_new_tokens=10, min_new_tokens=4, n=2, seed=23),
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-n{p.n}-min{p.min_new_tokens}")
@pytest.mark.parametrize("micro_batch_size", [None, 4])
def test_static_cache_samples_as_the_dynamic_cache(contract, params, micro_batch_size):
    tokenizer, model, prompts = contract
    static, dynamic = both(model, tokenizer, prompts, params, seeds=[41, 42, 43], micro_batch_size=micro_batch_size)
    assert_same_samples(static, dynamic)
    lengths = static.action_mask.sum(dim=1)
    assert lengths.min() >= params.min_new_tokens
    if params.n > 1 and not params.greedy and not params.min_new_tokens:
        # Some responses stop at EOS, others run to the limit: both ends of the loop are compared.
        assert static.truncated.any() and not static.truncated.all(), lengths


def test_static_steps_keep_one_shape_after_a_shared_prompt_prefill(contract):
    """The prefill sees the distinct prompts once, into a StaticCache; every step after it feeds
    one token per sample with the whole mask, as long as the cache: the shapes never change."""
    tokenizer, model, prompts = contract
    seen = []

    def record(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        seen.append((tuple(kwargs["input_ids"].shape), tuple(kwargs["attention_mask"].shape), type(cache).__name__))
    handle = model.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = hf_engine_for(model, tokenizer, kv_cache="static").generate(
            prompts, SamplingParams(max_new_tokens=5, min_new_tokens=5, n=4, seed=0))
    finally:
        handle.remove()
    slots = STATIC_CACHE_MULTIPLE
    assert out.prompt_len + 5 <= slots
    prefill, step = ((3, out.prompt_len), (3, out.prompt_len), "StaticCache"), ((12, 1), (12, slots), "StaticCache")
    assert seen == [prefill] + [step] * 4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gpt2"])
def test_static_cache_on_other_architectures(arch):
    """Grouped-query attention (Llama), one full and one sliding-window layer (Qwen2), alternating
    windows with soft-caps (Gemma 2) and learned positions (GPT-2); a prompt longer than the
    window and chunks that split groups."""
    tokenizer = tiny_tokenizer(arch)
    model = build_tiny_arch(arch, tokenizer).eval()
    prompts = [tokenizer.encode(p) for p in [*PROMPTS, LONG_PROMPT]]
    assert max(map(len, prompts)) > TINY_WINDOW
    params = SamplingParams(temperature=1.0, max_new_tokens=16, n=3, seed=3)
    assert_same_samples(*both(model, tokenizer, prompts, params, micro_batch_size=5))


def test_static_cache_with_a_vision_language_model():
    """Qwen2.5-VL: images in the prefill and multimodal rotary positions (3 rows per token) that
    continue by one per step."""
    processor = build_tiny_qwen_vl_processor(version="2.5")
    model = build_tiny_qwen_vl("2.5", processor.tokenizer, seed=3).eval()
    images = ImagePrompts(processor, family_of(model))
    rng = random.Random(1)
    pictures = [draw_disc("r", rng).resize((56, 84)), draw_disc("g", rng)]
    texts = [(f"Left {images.marker}: round?", pictures[:1]), (f"{images.marker}Colour?", pictures[1:]),
             ("No picture here.", [])]
    records = [PromptRecord(text, images.expand(text, pics, True), pics, images.media(pics) if pics else None,
                            images.marker_ids(text, True)) for text, pics in texts]
    prompts, media = [list(r.token_ids) for r in records], [r.media for r in records]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2)
    outputs = [hf_engine_for(model, processor.tokenizer, family=family_of(model), kv_cache=kv_cache).generate(
        prompts, params, seeds=[5, 6, 7], media=media) for kv_cache in ("static", "dynamic")]
    assert_same_samples(*outputs)


@pytest.fixture(scope="module")
def policies(contract):
    """The contract model (version 0) and a perturbed copy of it (version 1)."""
    tokenizer, model, prompts = contract
    newer = copy.deepcopy(model)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for param in newer.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=generator) * param.abs().mean())
    return tokenizer, model, newer, prompts


def switched_run(tokenizer, module, newer, prompts, at_step: int, **options) -> RolloutOutput:
    """A rollout with `module` whose weights change to `newer`'s before decoding step `at_step`
    (partial rollouts)."""
    engine = hf_engine_for(module, tokenizer, **options)
    engine.weight_switch = switch_at(engine, module, newer, at_step)
    return engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=5))


def test_a_weight_switch_refills_the_static_cache(policies):
    """After new weights arrive the static cache is emptied and refilled from prompt and response
    so far under them, as the dynamic cache is rebuilt: the same tokens, versions and log-probs."""
    tokenizer, model, newer, prompts = policies
    static = switched_run(tokenizer, copy.deepcopy(model), newer, prompts, 4, kv_cache="static")
    dynamic = switched_run(tokenizer, copy.deepcopy(model), newer, prompts, 4)
    assert_same_samples(static, dynamic)
    assert set(static.versions[static.action_mask].tolist()) == {0, 1}


def test_the_compiled_step_samples_as_the_dynamic_cache(policies):
    """torch.compile on the CPU (inductor; the test's one compilation, tens of seconds): every
    decoding step runs compiled, the prefill and the refill after a weight switch eagerly, and the
    samples, versions and log-probs are the dynamic cache's."""
    tokenizer, model, newer, prompts = policies
    # Each forward writes whether it runs compiled into a tensor (a Python list would be guarded
    # on its length, and every step would compile anew).
    module = copy.deepcopy(model)
    compiled, forwards = torch.zeros(16, dtype=torch.bool), torch.zeros((), dtype=torch.long)

    def mark(inner, args):
        compiled.index_fill_(0, forwards.view(1), torch.compiler.is_compiling())
        forwards.add_(1)
    module.model.register_forward_pre_hook(mark)
    static = switched_run(tokenizer, module, newer, prompts, 3, kv_cache="static", compile_decode=True)
    dynamic = switched_run(tokenizer, copy.deepcopy(model), newer, prompts, 3)
    assert_same_samples(static, dynamic)
    assert set(static.versions[static.action_mask].tolist()) == {0, 1}
    # A forward per step: the prefill, steps 1-2, the refill at step 3 (new weights), then steps 4 on.
    assert int(forwards) == static.num_actions
    assert compiled[:int(forwards)].tolist() == [False, True, True, False] + [True] * (int(forwards) - 4)


def test_routes_are_recorded_alike_with_a_static_cache():
    """Routing replay's recording (eager decoding) sees the same experts with either cache."""
    tokenizer = tiny_tokenizer("qwen3_moe")
    actor = ActorLanguage(build_tiny_arch("qwen3_moe", tokenizer).eval(), routing_replay="rollout")
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    static, dynamic = both(actor.model, tokenizer, prompts, SamplingParams(max_new_tokens=6, n=2, seed=1))
    assert_same_samples(static, dynamic)
    assert static.routes is not None and torch.equal(static.routes, dynamic.routes)


# ------------------------------------------------------------------ refused combinations
def test_a_compiled_step_needs_the_static_cache(contract):
    tokenizer, model, _ = contract
    with pytest.raises(ValueError, match=r"--hf_compile_decode .*add --hf_kv_cache static"):
        hf_engine_for(model, tokenizer, compile_decode=True)
    with pytest.raises(ValueError, match=r"--hf_kv_cache\) must be one of dynamic, static, got 'paged'"):
        hf_engine_for(model, tokenizer, kv_cache="paged")
    with pytest.raises(ConfigError, match=r"--hf_compile_decode .*add --hf_kv_cache static"):
        RolloutConfig(hf_compile_decode=True)


RUN = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "math", "--advantage_estimator", "group_norm",
       "--n_samples_per_prompt", "4", "--rollout_batch_size", "8", "--train_batch_size", "32"]


@pytest.mark.parametrize("flags, message", [
    (["--hf_kv_cache", "static", "--rollout_engine", "vllm"], r"--rollout_engine vllm holds its own weights and KV "
                                                              r"cache and does not use them: drop them"),
    (["--hf_kv_cache", "static", "--hf_compile_decode", "--routing_replay", "rollout"],
     r"--hf_compile_decode cannot be combined with --routing_replay rollout \(.*--routing_replay old"),
    (["--hf_kv_cache", "static", "--hf_compile_decode", "--zero_stage", "3"],
     r"--hf_compile_decode cannot be combined with --zero_stage 3 \(.*CUDA graph cannot replay"),
])
def test_a_run_refuses_the_flags_where_they_cannot_run(flags, message):
    parser = PPORunConfig.build_parser("train_ppo")
    with pytest.raises(ConfigError, match=message):
        PPORunConfig.from_namespace(parser.parse_args(RUN + flags))


def test_explorer_ranks_may_compile_their_step_under_zero3():
    """Explorer ranks decode with their own whole policy copy, not the partitioned actor."""
    parser = PPORunConfig.build_parser("train_ppo")
    config = PPORunConfig.from_namespace(parser.parse_args(RUN + ["--hf_kv_cache", "static", "--hf_compile_decode",
                                                                  "--zero_stage", "3", "--explorer_ranks", "1"]))
    assert config.rollout.hf_compile_decode and config.rollout.hf_kv_cache == "static"


def test_a_compiled_step_cannot_record_routes():
    tokenizer = tiny_tokenizer("qwen3_moe")
    actor = ActorLanguage(build_tiny_arch("qwen3_moe", tokenizer), routing_replay="rollout")
    with pytest.raises(ValueError, match=r"--hf_compile_decode cannot record .*--routing_replay old"):
        hf_engine_for(actor.model, tokenizer, kv_cache="static", compile_decode=True)
    hf_engine_for(actor.model, tokenizer, kv_cache="static")     # eager decoding records them (test above)


def test_a_model_with_recurrent_cache_layers_is_refused_a_static_cache_and_decodes_with_the_dynamic_one():
    """Qwen3-Next's linear-attention layers keep a state per row, not a slot per token: no static
    cache; the dynamic cache decodes n samples per prompt by prefilling each sample's prompt (its
    rows cannot be copied), with log-probs equal to a teacher-forced forward of the samples."""
    tokenizer = build_char_tokenizer()
    config = Qwen3NextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_value_heads=2,
                             linear_num_key_heads=1, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=2,
                             num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"--hf_kv_cache static: Qwen3NextForCausalLM has recurrent cache layers"):
        hf_engine_for(model, tokenizer, kv_cache="static")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    engine = hf_engine_for(model, tokenizer)
    out = engine.generate([tokenizer.encode(p) for p in PROMPTS[:3]], SamplingParams(n=2, max_new_tokens=6),
                          seeds=[11, 12, 13])
    assert out.sequences.shape[0] == 6 and not torch.equal(out.sequences[0], out.sequences[1])
    with torch.no_grad():
        forced = ActorLanguage(model)(out.sequences, out.num_actions, attention_mask=out.attention_mask)
    torch.testing.assert_close(out.rollout_log_probs[out.action_mask], forced[out.action_mask], atol=1e-5, rtol=0)

