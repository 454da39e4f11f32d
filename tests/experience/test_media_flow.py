"""A prompt's images travel with its samples: from the prompt record through the generator and the
Hugging Face engine, the experience, the replay buffer (shuffled) and its padded or packed
micro-batches, to the actor's forward, which gives each sample the log-probs it has alone."""

import random
from types import SimpleNamespace

import pytest
import torch

from lightrft.algorithms.kl import FixedKLController
from lightrft.datasets.images import ImagePrompts
from lightrft.datasets.prompt_record import PromptRecord
from lightrft.datasets.toy_images import draw_disc
from lightrft.experience.builder import ExperienceBuilder
from lightrft.experience.generation import Generator
from lightrft.experience.replay_buffer import NaiveReplayBuffer
from lightrft.experience.samples import collate_samples
from lightrft.models import ActorLanguage
from lightrft.models.families import family_of
from lightrft.models.hf_utils import VARLEN_ATTENTION
from lightrft.rewards.batch import RewardBatch
from lightrft.rollout.base import EngineCapabilities, SamplingParams
from lightrft.rollout.hf_engine import hf_engine_for
from lightrft.rollout.manager import RolloutManager
from lightrft.utils.tiny import (build_tiny_idefics3, build_tiny_idefics3_processor, build_tiny_qwen_vl,
                                 build_tiny_qwen_vl_processor)


def build_family(name: str):
    """(processor, model) of a tiny vision-language model of `name`."""
    if name == "idefics3":
        processor = build_tiny_idefics3_processor()
        return processor, build_tiny_idefics3(processor.tokenizer, seed=1)
    version = {"qwen2_vl": "2", "qwen2_5_vl": "2.5", "qwen3_vl": "3"}[name]
    processor = build_tiny_qwen_vl_processor(version=version)
    return processor, build_tiny_qwen_vl(version, processor.tokenizer, seed=1)


@pytest.fixture(scope="module", params=["idefics3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def setup(request):
    processor, model = build_family(request.param)
    tokenizer = processor.tokenizer
    images = ImagePrompts(processor, family_of(model))
    rng = random.Random(0)
    prompts = []

    def record(text, pictures):
        return PromptRecord(text, images.expand(text, pictures, True), pictures, images.media(pictures),
                            images.marker_ids(text, True))

    for colour in ("r", "b"):        # equal text and ids, different images
        prompts.append(record(f"{images.marker}Colour?", [draw_disc(colour, rng)]))
    prompts.append("Colour? (no picture)")
    # Two images of other sizes (Qwen-VL: 6 and 16 tokens, text between and after them): their
    # multimodal positions differ from the token count.
    prompts.append(record(f"Left {images.marker} right {images.marker}?",
                          [draw_disc("g", rng).resize((56, 84)), draw_disc("r", rng).resize((112, 112))]))
    return tokenizer, model, prompts


def test_images_reach_every_forward_in_their_samples_order(setup):
    tokenizer, model, prompts = setup
    actor = ActorLanguage(model)
    engine = hf_engine_for(model, tokenizer, family=family_of(model))
    generator = Generator(engine, tokenizer, prompt_max_len=64, seed=3)
    n = 3
    generation = generator.generate(prompts, None, SamplingParams(max_new_tokens=4, n=n), call=1)
    rollout = generation.rollout
    assert len(rollout.media) == len(prompts) * n
    for i, prompt in enumerate(prompts):
        for j in range(n):
            assert rollout.media[i * n + j] is getattr(prompt, "media", None)
    assert rollout.prompt_len >= len(prompts[0].token_ids)

    builder = ExperienceBuilder(actor, None, None, FixedKLController(0.0), SimpleNamespace(device="cpu"),
                                advantage_estimator="group_norm", micro_rollout_batch_size=4)
    total = len(prompts) * n
    scores = torch.arange(total, dtype=torch.float32) % 2
    exp = builder.experience_from_rollout(rollout, RewardBatch(scores, torch.ones(total, dtype=torch.bool)), n)[0]
    assert exp.media is rollout.media
    # The experience forward (micro-batches of 4 that cut across prompts) gives each sample what
    # it gets alone, with its own prompt's images.
    alone = torch.zeros_like(exp.action_log_probs)
    for row in range(total):
        one = rollout.rows(row, row + 1)
        with torch.no_grad():
            lp = actor(one.sequences, one.num_actions, attention_mask=one.attention_mask, media=one.media[0])
        alone[row, :one.num_actions] = lp[0]
    mask = exp.action_mask
    torch.testing.assert_close(exp.action_log_probs * mask, alone * mask, atol=1e-5, rtol=0)
    # The engine samples from the same module with the placeholder banned, and the trainer's
    # policy is that distribution too: the same log-probs.
    torch.testing.assert_close(exp.rollout_log_probs * mask, exp.action_log_probs * mask, atol=1e-5, rtol=0)

    buffer = NaiveReplayBuffer(sample_batch_size=4)
    buffer.append(exp)
    order = list(range(len(buffer)))
    random.Random(1).shuffle(order)
    samples = [buffer[i] for i in order]
    expected = exp.action_log_probs[order]
    # Packed rows with transformers' mask from restarting positions (sdpa) and with lightrft's
    # varlen attention (the trainer's default), which the vision tower then uses too.
    for packing, attention in ((False, "sdpa"), (True, "sdpa"), (True, VARLEN_ATTENTION)):
        model.set_attn_implementation(attention)
        batch = collate_samples(samples, tokenizer.pad_token_id, packing)
        assert batch.media == [exp.media[i] for i in order]
        with torch.no_grad():
            got = actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask,
                        packed_seq_lens=batch.packed_seq_lens, media=batch.merged_media)
        torch.testing.assert_close(got * batch.action_mask, expected * batch.action_mask, atol=1e-5, rtol=0)
        # The guard has teeth: the two images swapped give other log-probs.
        swap = {id(prompts[0].media): prompts[1].media, id(prompts[1].media): prompts[0].media}
        swapped = collate_samples(samples, tokenizer.pad_token_id, packing)
        swapped.media = [swap.get(id(m), m) for m in swapped.media]
        with torch.no_grad():
            wrong = actor(swapped.sequences, swapped.num_actions, attention_mask=swapped.attention_mask,
                          packed_seq_lens=swapped.packed_seq_lens, media=swapped.merged_media)
        assert (wrong - expected).abs().max() > 1e-3
    model.set_attn_implementation("sdpa")


def test_a_text_only_batch_of_a_vision_model_runs_its_tower_on_a_blank_with_no_effect(setup):
    """ZeRO-3 needs every rank to run the same modules: a batch without images still calls the
    vision tower (on a blank image, weight 0), changing neither log-probs nor gradients."""
    tokenizer, model, prompts = setup
    actor = ActorLanguage(model)
    ids = torch.tensor([tokenizer.encode("Colour? (no picture) r")])
    calls = []
    tower = model.get_submodule(family_of(model).vision_modules(model)[0])
    hook = tower.register_forward_hook(lambda *_: calls.append(1))
    try:
        log_probs = actor(ids, 2, attention_mask=torch.ones_like(ids))
    finally:
        hook.remove()
    assert calls == [1]
    log_probs.sum().backward()
    vision_grads = [p.grad for p in tower.parameters()]
    assert all(g is not None and torch.count_nonzero(g) == 0 for g in vision_grads)
    model.zero_grad()
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, -3:-1]
        banned = torch.tensor(family_of(model).banned_token_ids(model.config))
        plain = logits.index_fill(-1, banned, float("-inf")).log_softmax(-1)
    expected = plain.gather(-1, ids[:, -2:, None])[..., 0]
    torch.testing.assert_close(log_probs.detach(), expected, atol=1e-6, rtol=0)


def test_an_engine_without_images_refuses_prompts_that_carry_them(setup):
    tokenizer, model, prompts = setup

    class TextEngine:
        capabilities = EngineCapabilities(weight_syncs=frozenset({"live"}))

        def generate(self, *args, **kwargs):
            raise AssertionError("not reached")

    manager = RolloutManager(TextEngine())
    generator = Generator(manager, tokenizer, prompt_max_len=64)
    with pytest.raises(ValueError, match=r"TextEngine takes token ids only, and these prompts carry images: "
                                         r"pick a rollout engine that takes images \(--rollout_engine hf\)"):
        generator.generate(prompts, None, SamplingParams(max_new_tokens=2, n=1), call=1)
