"""Pictures from the environment in multi-turn episodes: an environment message (or a tool's
result) shows the policy a picture between turns. Its placeholders enter the sequence (attended
to, never trained), its model inputs join the episode's media in placeholder order, the next
turn is sampled seeing it, and the trainer's forward over the episode gives the engine's log-probs."""

import asyncio
import io
import random
import textwrap

import pytest
import torch

from lightrft.agents import Workflow, WorkflowRunner
from lightrft.agents.tools import ToolRunner, parse_tool_calls, tool_message
from lightrft.datasets.images import ImagePrompts
from lightrft.datasets.prompt_record import PromptRecord
from lightrft.datasets.toy_images import draw_disc
from lightrft.models import ActorLanguage
from lightrft.models.families import family_of
from lightrft.rollout.base import SamplingParams
from lightrft.rollout.hf_engine import hf_engine_for
from lightrft.utils.pyfile import import_python_file
from lightrft.utils.tiny import (build_tiny_idefics3, build_tiny_idefics3_processor, build_tiny_qwen_vl,
                                 build_tiny_qwen_vl_processor)


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class ShowPicture(Workflow):
    """A turn, then a user message with a picture (PNG bytes from the label), then a turn."""

    async def run(self, episode):
        await episode.generate()
        episode.add_messages({"role": "user", "content": [{"type": "image", "image": episode.label},
                                                          {"type": "text", "text": "Colour?"}]})
        await episode.generate()
        return 1.0


@pytest.fixture(scope="module", params=["idefics3", "qwen2_5_vl", "qwen3_vl"])
def case(request):
    if request.param == "idefics3":
        processor = build_tiny_idefics3_processor()
        model = build_tiny_idefics3(processor.tokenizer, seed=5)
    else:
        version = {"qwen2_5_vl": "2.5", "qwen3_vl": "3"}[request.param]
        processor = build_tiny_qwen_vl_processor(version=version)
        model = build_tiny_qwen_vl(version, processor.tokenizer, seed=5)
    images = ImagePrompts(processor, family_of(model))
    rng = random.Random(3)
    pictures = [draw_disc(c, rng) for c in "rgb"]
    text = f"user: {images.marker}What is it?\nassistant: "
    record = PromptRecord(text, images.expand(text, pictures[:1], False), pictures[:1], images.media(pictures[:1]),
                          images.marker_ids(text, False))
    prompts = [record, "user: Wait for a picture.\nassistant: "]
    labels = [png(pictures[1]), png(pictures[2])]
    return processor, model, images, prompts, labels


def run(case, workflow, n=2):
    processor, model, images, prompts, labels = case
    runner = WorkflowRunner(workflow, processor.tokenizer, max_turns=3, max_episode_tokens=80,
                            eos_token_ids=[processor.tokenizer.eos_token_id], images=images)
    prompt_ids = [list(p.token_ids) if isinstance(p, PromptRecord) else processor.tokenizer.encode(p, add_special_tokens=False)
                  for p in prompts]
    engine = hf_engine_for(model, processor.tokenizer, family=family_of(model))
    return runner.run(engine, prompt_ids, prompts, labels, SamplingParams(max_new_tokens=4, n=n), [7, 8])


def test_a_picture_between_turns_is_in_the_sequence_and_in_the_engine_and_trainer_forwards(case):
    processor, model, images, prompts, labels = case
    batch = run(case, ShowPicture())
    rollout, family = batch.rollout, family_of(model)
    for row, record in enumerate(batch.records):
        picture_tokens = family.banned_token_ids(model.config)[0]
        placeholders = [i for i, t in enumerate(record.response_ids) if t == picture_tokens]
        assert placeholders and not any(record.loss_mask[i] for i in placeholders)     # attended, never trained
        pictures_in_prompt = 1 if row < 2 else 0
        key = "image_grid_thw" if "image_grid_thw" in record.media else "pixel_values"
        assert record.media[key].size(0) == pictures_in_prompt + 1
        assert rollout.media[row] is record.media

    actor = ActorLanguage(model)
    seen = torch.zeros_like(rollout.rollout_log_probs)
    for row in range(rollout.sequences.size(0)):
        one = rollout.rows(row, row + 1)
        with torch.no_grad():
            seen[row, :one.num_actions] = actor(one.sequences, one.num_actions, attention_mask=one.attention_mask,
                                                media=rollout.media[row])[0]
    mask = rollout.action_mask
    torch.testing.assert_close(seen * mask, rollout.rollout_log_probs * mask, atol=1e-5, rtol=0)

    # The picture matters: another one in its place moves the second turn's log-probs.
    other = images.media([draw_disc("y", random.Random(9))])
    row = 2                                              # a text prompt: its only picture came from the environment
    one = rollout.rows(row, row + 1)
    with torch.no_grad():
        moved = actor(one.sequences, one.num_actions, attention_mask=one.attention_mask, media=other)[0]
    assert ((moved - seen[row, :one.num_actions]) * mask[row, :one.num_actions]).abs().max() > 1e-3


def test_a_picture_after_the_last_turn_is_dropped_with_its_tokens(case):
    class PictureLast(Workflow):
        async def run(self, episode):
            await episode.generate()
            episode.add_messages({"role": "user", "content": [{"type": "image", "image": episode.label}]})
            return 0.5

    batch = run(case, PictureLast(), n=1)
    with_prompt_picture, text_only = batch.records
    assert batch.rollout.media[1] is None and text_only.media is None
    key = "image_grid_thw" if "image_grid_thw" in with_prompt_picture.media else "pixel_values"
    assert with_prompt_picture.media[key].size(0) == 1     # the prompt's own


def test_pictures_need_a_vision_language_run_and_well_formed_parts(case):
    processor, model, images, prompts, labels = case

    class Bad(Workflow):
        def __init__(self, message):
            self.message = message

        async def run(self, episode):
            await episode.generate()
            episode.add_messages(self.message)
            return 1.0

    runner = WorkflowRunner(Bad({"role": "user", "content": [{"type": "image", "image": labels[0]}]}),
                            processor.tokenizer, max_turns=2, max_episode_tokens=40,
                            eos_token_ids=[processor.tokenizer.eos_token_id])       # no images: a text run
    engine = hf_engine_for(model, processor.tokenizer, family=family_of(model))
    ids = [processor.tokenizer.encode("user: hi\nassistant: ", add_special_tokens=False)]
    with pytest.raises(RuntimeError, match=r"an environment message holds an image, but this run takes none: train "
                                           r"a vision-language model with --image_key"):
        runner.run(engine, ids, ["hi"], [None], SamplingParams(max_new_tokens=2, n=1), [1])
    for part, expected in (({"type": "image", "image": b"not a picture"}, r"content\[0\]: not a readable image"),
                           ({"type": "video"}, r"content\[0\] must be \{'type': 'text'")):
        runner = WorkflowRunner(Bad({"role": "user", "content": [part]}), processor.tokenizer, max_turns=2,
                                max_episode_tokens=40, eos_token_ids=[processor.tokenizer.eos_token_id], images=images)
        with pytest.raises(RuntimeError, match=expected):
            runner.run(engine, ids, ["hi"], [None], SamplingParams(max_new_tokens=2, n=1), [1])


def test_an_episode_showing_more_pictures_than_the_limit_names_the_flag(case):
    processor, model, images, prompts, labels = case
    runner = WorkflowRunner(ShowPicture(), processor.tokenizer, max_turns=3, max_episode_tokens=80,
                            eos_token_ids=[processor.tokenizer.eos_token_id], images=images, max_images=1)
    engine = hf_engine_for(model, processor.tokenizer, family=family_of(model))
    batch = runner.run(engine, [list(prompts[0].token_ids), processor.tokenizer.encode(prompts[1])], prompts, labels,
                       SamplingParams(max_new_tokens=2, n=1), [1, 2])
    over, fine = batch.records      # the prompt's picture and the environment's: 2 > 1; the text prompt's one fits
    assert over.stop_reason == "workflow_error" and not over.valid
    assert "the episode would show 2 pictures, over --max_images_per_prompt 1" in over.extra["error"]
    assert fine.stop_reason == "done" and fine.valid


def test_a_tool_that_returns_a_picture_shows_it_to_the_policy(tmp_path):
    (tmp_path / "draw.py").write_text(textwrap.dedent('''
        from PIL import Image

        def draw(colour: str):
            """Draws a square of the colour."""
            return [Image.new("RGB", (28, 28), colour), f"a {colour} square"]
    '''))
    draw = import_python_file(tmp_path / "draw.py", "draw_tools").draw
    call = parse_tool_calls('<tool_call>{"name": "draw", "arguments": {"colour": "red"}}</tool_call>')[0]
    with ToolRunner({"draw": draw}, timeout=30, max_output_chars=200, workers=1) as runner:
        result = asyncio.run(runner.call(call))
    assert result.error is None and result.output == "a red square" and len(result.images) == 1
    from PIL import Image

    picture = Image.open(io.BytesIO(result.images[0]))
    assert picture.size == (28, 28) and picture.convert("RGB").getpixel((3, 3)) == (255, 0, 0)
    message = tool_message(call, result)
    assert message["content"] == [{"type": "image", "image": result.images[0]}, {"type": "text", "text": "a red square"}]
    wrapped = tool_message(call, result, role="user")["content"]
    assert wrapped[1]["text"] == "<tool_response>\na red square\n</tool_response>"
