"""Prompts with images: every accepted way of giving an image reads the same pixels, the prompt's
ids are the processor's with each image's placeholders expanded, chat content parts equal image
markers, bad rows name the file, row and field, and a prompt record survives pickling."""

import base64
import dataclasses
import io
import json
import pickle

import pytest
import torch

from lightrft.builders.datasets import build_image_prompts
from lightrft.config import ConfigError, PPORunConfig
from lightrft.datasets import DatasetRowError, PromptDataset
from lightrft.datasets.images import ImagePrompts
from lightrft.datasets.prompt_record import PromptRecord, prompt_images, prompt_media, prompt_text, prompt_token_ids
from lightrft.datasets.toy_images import colour_splits, draw_disc
from lightrft.models.families import family_of
from lightrft.models.tokenizer import build_tokenizer
from lightrft.utils.tiny import build_tiny_idefics3_processor, save_tiny_idefics3, save_tiny_model
from tests.conftest import to_flags


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = save_tiny_idefics3(tmp_path_factory.mktemp("vlm") / "model")
    tokenizer = build_tokenizer(str(folder), padding_side="left")
    return folder, tokenizer, build_image_prompts(str(folder), tokenizer)


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_every_way_of_giving_an_image_reads_the_same_pixels_and_ids(vlm, tmp_path):
    folder, tokenizer, images = vlm
    import random

    picture = draw_disc("g", random.Random(3))
    (tmp_path / "img").mkdir()
    picture.save(tmp_path / "img" / "a.png")
    data = png_bytes(picture)
    b64 = base64.b64encode(data).decode()
    in_file = ["img/a.png", str(tmp_path / "img" / "a.png"), b64, f"data:image/png;base64,{b64}",
               {"path": "img/a.png"}]
    in_memory = [str(tmp_path / "img" / "a.png"), data, {"bytes": data, "path": None}, picture]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"input": "<image>Colour?", "images": [form], "label": "g"}) + "\n"
                            for form in in_file))
    from_file = PromptDataset(path, tokenizer, label_key="label", image_key="images", images=images,
                              prompt_max_len=64)
    from_rows = PromptDataset([{"input": "<image>Colour?", "images": form, "label": "g"} for form in in_memory],
                              tokenizer, label_key="label", image_key="images", images=images, prompt_max_len=64)
    processor = build_tiny_idefics3_processor()
    expected = processor(text=["<image>Colour?"], images=[[picture]], return_tensors="pt")
    items = [from_file[i] for i in range(len(from_file))] + [from_rows[i] for i in range(len(from_rows))]
    assert len(items) == len(in_file) + len(in_memory)
    for prompt, label in items:
        assert isinstance(prompt, PromptRecord) and prompt.text == "<image>Colour?" and label == "g"
        assert list(prompt_token_ids(prompt)) == expected["input_ids"][0].tolist()
        # 4 <image> placeholders (one image of 4 tokens) between the image markers
        assert prompt.token_ids.count(tokenizer.convert_tokens_to_ids("<image>")) == 4
        torch.testing.assert_close(prompt_media(prompt)["pixel_values"], expected["pixel_values"][0])
        torch.testing.assert_close(prompt_media(prompt)["pixel_attention_mask"], expected["pixel_attention_mask"][0])


def test_chat_image_parts_equal_image_markers_and_text_rows_carry_ids_only(vlm, tmp_path):
    _, tokenizer, images = vlm
    colour_splits(tmp_path, n_train=4, n_eval=1)
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    image = str(tmp_path / "images" / "train_00000.png")
    rows = [{"q": parts, "images": [image]}, {"q": "<image>Colour?", "images": image}, {"q": "Just text"}]
    dataset = PromptDataset(rows, tokenizer, input_key="q", apply_chat_template=True, image_key="images",
                            images=images, prompt_max_len=64)
    (a, _), (b, _), (c, _) = dataset[0], dataset[1], dataset[2]
    assert a.text == b.text == "user: <image>Colour?\nassistant: " and a.token_ids == b.token_ids
    torch.testing.assert_close(a.media["pixel_values"], b.media["pixel_values"])
    assert c.images == () and prompt_media(c) is None and prompt_images(c) is None
    assert prompt_token_ids(c) == tuple(tokenizer("user: Just text\nassistant: ", add_special_tokens=False)["input_ids"])
    assert dataset.texts() == [a.text, b.text, c.text] and dataset.token_ids() == [a.token_ids, b.token_ids, c.token_ids]


def test_bad_image_rows_name_the_file_row_and_field(vlm, tmp_path):
    _, tokenizer, images = vlm
    colour_splits(tmp_path, n_train=2, n_eval=1)
    (tmp_path / "broken.png").write_bytes(b"not an image at all")
    rows = [
        {"input": "<image>ok", "images": ["images/train_00000.png"]},
        {"input": "<image>missing", "images": ["images/nope.png"]},
        {"input": "<image>broken", "images": ["broken.png"]},
        {"input": "<image><image>two markers", "images": ["images/train_00000.png"]},
        {"input": "no marker", "images": ["images/train_00000.png"]},
        {"input": "<image>" + "x" * 60, "images": ["images/train_00001.png"]},
        {"input": "<image>odd", "images": [{"url": "http://x"}]},
        {"input": "<image>number", "images": [12]},
        {"input": [{"role": "user", "content": [{"type": "video"}]}], "images": []},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = [
        (1, "images[0]", "no image file"),
        (2, "images[0]", "not a readable image"),
        (3, "input", "marks 2 image(s)"),
        (4, "input", "marks 0 image(s)"),
        (5, "input", "over --prompt_max_len 64 (a prompt with images is never truncated"),
        (6, "images[0]", "needs 'bytes' or 'path'"),
        (7, "images[0]", "expected a path, bytes, base64 or an image object, got int"),
    ]
    for row, field, reason in expected:
        case = tmp_path / f"case{row}.jsonl"
        case.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[row]) + "\n")
        with pytest.raises(DatasetRowError) as err:
            PromptDataset(case, tokenizer, image_key="images", images=images, prompt_max_len=64)
        assert err.value.row == 1 and err.value.field == field and reason in str(err.value), str(err.value)
        assert str(case) in str(err.value)
    two = tmp_path / "two.jsonl"
    two.write_text(json.dumps({"input": "<image><image>x", "images": ["images/train_00000.png"] * 2}) + "\n")
    with pytest.raises(DatasetRowError, match=r"row 0, field 'images': holds 2 images, over --max_images_per_prompt 1"):
        PromptDataset(two, tokenizer, image_key="images", images=images, max_images=1)
    assert len(PromptDataset(two, tokenizer, image_key="images", images=images, max_images=2)) == 1
    with pytest.raises(DatasetRowError, match=r"field 'input\[0\]\.content\[0\]': a content part must be"):
        PromptDataset([rows[8]], tokenizer, image_key="images", images=images, apply_chat_template=True)
    skipped = PromptDataset(path, tokenizer, image_key="images", images=images, prompt_max_len=64,
                            on_bad_row="skip", apply_chat_template=False, input_key="input")
    assert len(skipped) == 1 and skipped.skipped == 8


def test_a_prompt_record_pickles_whole_and_is_read_by_its_fields(vlm):
    record = PromptRecord("<image>Colour?", [5, 6, 7], [draw_disc("r", __import__("random").Random(0))],
                          {"pixel_values": torch.ones(1, 3, 56, 56)})
    again = pickle.loads(pickle.dumps(record))
    assert again == record and again.token_ids == (5, 6, 7) and len(again.images) == 1
    assert torch.equal(again.media["pixel_values"], record.media["pixel_values"])
    # Frozen and no string: nothing can drop its ids or images by treating it as text.
    with pytest.raises(TypeError):
        record + "!"
    with pytest.raises(AttributeError):
        record.strip()
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.text = "other"
    assert str(record) == prompt_text(record) == "<image>Colour?" and prompt_text("plain") == "plain"
    assert "1 image(s)" in repr(record) and record != PromptRecord("<image>Colour?", [5, 6, 8])


def test_image_flags_are_refused_where_they_cannot_work(vlm, tmp_path):
    folder, tokenizer, _ = vlm
    text_model = save_tiny_model(tmp_path / "text")
    with pytest.raises(ValueError, match=r"--image_key is set but --pretrain .* 'qwen2' model, a model that takes no "
                                         "images"):
        build_image_prompts(str(text_model), tokenizer)
    no_processor = tmp_path / "no_processor"
    no_processor.mkdir()
    (no_processor / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="its processor could not be loaded"):
        build_image_prompts(str(no_processor), tokenizer)
    with pytest.raises(ValueError, match="--image_key images: the model's processor is needed"):
        PromptDataset([{"input": "x"}], tokenizer, image_key="images")
    base = dict(pretrain=folder, prompt_data="p.jsonl", remote_rm_url="exact", image_key="images",
                advantage_estimator="group_norm", n_samples_per_prompt=4, rollout_batch_size=8, train_batch_size=32)
    argv = to_flags({**base, "prompt_data": None, "recorded_data": "r.jsonl"})
    with pytest.raises(ConfigError, match="--image_key images cannot be combined with --recorded_data"):
        PPORunConfig.from_namespace(PPORunConfig.build_parser("train_ppo").parse_args(argv))
    # Multi-turn workflows take images (tests/agents/test_workflow_images.py).
    PPORunConfig.from_namespace(PPORunConfig.build_parser("train_ppo").parse_args(to_flags({**base, "workflow": "w.py"})))


def test_a_run_with_images_takes_a_vision_language_teacher_only(tmp_path):
    from lightrft.builders.models import check_scorers_take_images
    from lightrft.utils.tiny import save_tiny_idefics3, save_tiny_model

    text, vision = save_tiny_model(tmp_path / "text", arch="qwen2"), save_tiny_idefics3(tmp_path / "vlm")

    def config(**flags):
        values = dict(pretrain=vision, prompt_data="p.jsonl", remote_rm_url="exact", advantage_estimator="group_norm",
                      n_samples_per_prompt=4, rollout_batch_size=8, train_batch_size=32, distill_mode="loss", **flags)
        return PPORunConfig.from_namespace(PPORunConfig.build_parser("train_ppo").parse_args(to_flags(values)))

    check_scorers_take_images(config(image_key="images", teacher_pretrain=vision))
    check_scorers_take_images(config(teacher_pretrain=text))
    with pytest.raises(ValueError, match=r"--teacher_pretrain .*text is a text model \(qwen2\) and the prompts carry "
                                         r"images \(--image_key"):
        check_scorers_take_images(config(image_key="images", teacher_pretrain=text))


def test_image_prompts_need_a_processor_with_an_image_token():
    with pytest.raises(ValueError, match="names no image token"):
        ImagePrompts(object(), family_of(torch.nn.Linear(1, 1)))


def test_only_raster_images_of_bounded_size_are_opened(tmp_path, monkeypatch):
    # An EPS image is PostScript that Pillow runs through Ghostscript: refused unopened, however
    # it comes (a path, bytes, base64). A small PNG can claim a huge canvas; a huge file named .png
    # would be read whole before failing: both are refused from what is known before decoding.
    from PIL import EpsImagePlugin, Image

    from lightrft.datasets.images import MAX_IMAGE_BYTES, open_image

    def ghostscript(*args, **kwargs):
        raise AssertionError("Ghostscript was run")
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", ghostscript)
    eps = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n%%EndComments\n"
           b"newpath 0 0 moveto 8 8 lineto stroke\nshowpage\n%%EOF\n")
    (tmp_path / "art.png").write_bytes(eps)
    for value in ("art.png", eps, base64.b64encode(eps).decode()):
        with pytest.raises(DatasetRowError, match="not a readable image in a format lightrft opens \\(PNG, JPEG"):
            open_image(value, tmp_path, "data.jsonl", 3, "images[0]")
    with Image.open(io.BytesIO(eps)) as opened:      # opened by other code: refused before it decodes
        with pytest.raises(DatasetRowError, match="an image in EPS format, which lightrft does not open"):
            open_image(opened, tmp_path, "data.jsonl", 3, "images[0]")

    canvas = io.BytesIO()
    Image.new("1", (12500, 12500)).save(canvas, format="PNG")
    assert len(canvas.getvalue()) < 100_000        # a small file...
    with pytest.raises(DatasetRowError, match="12500 x 12500 pixels, over the 36,000,000"):
        open_image(canvas.getvalue(), tmp_path, "data.jsonl", 3, "images[0]")

    huge = tmp_path / "huge.png"
    with open(huge, "wb") as f:                    # sparse: nothing is written, nothing should be read
        f.truncate(2 * 2**30)
    with pytest.raises(DatasetRowError, match=f"is 2048 MiB, over the {MAX_IMAGE_BYTES // 2**20} MiB"):
        open_image("huge.png", tmp_path, "data.jsonl", 3, "images[0]")
    ok = io.BytesIO()
    Image.new("RGB", (64, 48), "red").save(ok, format="PNG")
    assert open_image(ok.getvalue(), tmp_path, "data.jsonl", 3, "images[0]").size == (64, 48)
