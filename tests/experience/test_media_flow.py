"""A prompt's images travel with its samples: from the prompt record through the generator and the
Hugging Face engine, the experience, the replay buffer (shuffled) and its padded or packed
micro-batches, to the actor's forward, which gives each sample the log-probs it has alone."""

import random
from types import SimpleNamespace

import pytest
import torch

from lightrft.algorithms.kl import FixedKLController
from lightrft.datasets.prompt_record import PromptRecord
from lightrft.datasets.toy_images import draw_disc
from lightrft.experience.builder import ExperienceBuilder
from lightrft.experience.generation import Generator
from lightrft.experience.replay_buffer import NaiveReplayBuffer
from lightrft.experience.samples import collate_samples
from lightrft.models import ActorLanguage
from lightrft.models.families import family_of
from lightrft.rewards.batch import RewardBatch
from lightrft.rollout.base import EngineCapabilities, SamplingParams
from lightrft.rollout.hf_engine import hf_engine_for
from lightrft.rollout.manager import RolloutManager
from lightrft.utils.tiny import build_tiny_idefics3, build_tiny_idefics3_processor


@pytest.fixture(scope="module")
def setup():
    processor = build_tiny_idefics3_processor()
    tokenizer = processor.tokenizer
    model = build_tiny_idefics3(tokenizer, seed=1)
    rng = random.Random(0)
    prompts = []
    for colour in ("r", "b"):        # equal text and ids, different images
        image = draw_disc(colour, rng)
        ids = processor(text=["<image>Colour?"], images=[[image]])["input_ids"][0]
        media = {k: v[0] for k, v in processor.image_processor(images=[[image]], return_tensors="pt").items()}
        prompts.append(PromptRecord("<image>Colour?", ids, [image], media))
    prompts.append("Colour? (no picture)")
    return tokenizer, model, prompts


def test_images_reach_every_forward_in_their_samples_order(setup):
    tokenizer, model, prompts = setup
    actor = ActorLanguage(model)
    engine = hf_engine_for(model, tokenizer, family=family_of(model))
    generator = Generator(engine, tokenizer, prompt_max_len=64, seed=3)
    n = 3
    generation = generator.generate(prompts, None, SamplingParams(max_new_tokens=4, n=n), call=1)
    rollout = generation.rollout
    assert len(rollout.media) == 3 * n
    for i, prompt in enumerate(prompts):
        for j in range(n):
            assert rollout.media[i * n + j] is getattr(prompt, "media", None)
    assert rollout.prompt_len >= len(prompts[0].token_ids)

    builder = ExperienceBuilder(actor, None, None, FixedKLController(0.0), SimpleNamespace(device="cpu"),
                                advantage_estimator="group_norm", micro_rollout_batch_size=4)
    scores = torch.arange(3 * n, dtype=torch.float32) % 2
    exp = builder.experience_from_rollout(rollout, RewardBatch(scores, torch.ones(3 * n, dtype=torch.bool)), n)[0]
    assert exp.media is rollout.media
    # The experience forward (micro-batches of 4 that cut across prompts) gives each sample what
    # it gets alone, with its own prompt's images.
    alone = torch.zeros_like(exp.action_log_probs)
    for row in range(3 * n):
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
    for packing in (False, True):
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


def test_a_text_only_batch_of_a_vision_model_runs_its_tower_on_a_blank_with_no_effect(setup):
    """ZeRO-3 needs every rank to run the same modules: a batch without images still calls the
    vision tower (on a blank image, weight 0), changing neither log-probs nor gradients."""
    tokenizer, model, prompts = setup
    actor = ActorLanguage(model)
    ids = torch.tensor([tokenizer.encode("Colour? (no picture) r")])
    calls = []
    hook = model.model.vision_model.register_forward_hook(lambda *_: calls.append(1))
    try:
        log_probs = actor(ids, 2, attention_mask=torch.ones_like(ids))
    finally:
        hook.remove()
    assert calls == [1]
    log_probs.sum().backward()
    vision_grads = [p.grad for p in model.model.vision_model.parameters()]
    assert all(g is not None and torch.count_nonzero(g) == 0 for g in vision_grads)
    model.zero_grad()
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, -3:-1]
        plain = logits.index_fill(-1, torch.tensor([model.config.image_token_id]), float("-inf")).log_softmax(-1)
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
