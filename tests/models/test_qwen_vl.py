"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (tiny, random): lightrft's multimodal rotary positions against
transformers' own (`get_rope_index` and the model's forward computing them from
`mm_token_type_ids`), in left-padded batches, packed rows and the Hugging Face engine's decoding;
the trap they guard against (1-D positions run silently, with other log-probs); the processor
without torchvision; the data path from a saved folder."""

import importlib.util
import json
import random

import pytest
import torch

from lightrft.builders.datasets import build_image_prompts
from lightrft.datasets import PromptDataset
from lightrft.datasets.images import ImagePrompts
from lightrft.datasets.prompt_record import PromptRecord
from lightrft.datasets.toy_images import draw_disc
from lightrft.models import ActorLanguage
from lightrft.models.families import family_for, family_of, load_model
from lightrft.models.families.qwen_vl import mrope_positions
from lightrft.models.hf_utils import VARLEN_ATTENTION
from lightrft.models.tokenizer import build_tokenizer
from lightrft.rollout.base import SamplingParams
from lightrft.rollout.hf_engine import hf_engine_for
from lightrft.utils.tiny import build_tiny_qwen_vl, build_tiny_qwen_vl_processor, save_tiny_qwen_vl

VERSIONS = ["2", "2.5", "3"]


@pytest.fixture(scope="module", params=VERSIONS, ids=lambda v: f"qwen{v}-vl")
def case(request):
    processor = build_tiny_qwen_vl_processor(version=request.param)
    model = build_tiny_qwen_vl(request.param, processor.tokenizer, seed=3)
    images = ImagePrompts(processor, family_of(model))
    rng = random.Random(1)
    pictures = [draw_disc("r", rng).resize((56, 84)), draw_disc("g", rng).resize((112, 112)), draw_disc("b", rng)]
    texts = [(f"Left {images.marker} and {images.marker}: same?", pictures[:2]),
             (f"{images.marker}Colour?", pictures[2:]),
             ("No picture here, just text.", [])]
    records = [PromptRecord(text, images.expand(text, pics, True), pics, images.media(pics) if pics else None,
                            images.marker_ids(text, True)) for text, pics in texts]
    return processor, model, records


def own_forward(model, ids: torch.Tensor, media) -> torch.Tensor:
    """transformers' forward on one unpadded sequence (1, T), positions computed by the model
    from `mm_token_type_ids` and the image grids. Returns log-probs of the next token (T, V)."""
    inputs = {"input_ids": ids, "mm_token_type_ids": (ids == model.config.image_token_id).int()}
    if media:
        inputs.update(pixel_values=media["pixel_values"], image_grid_thw=media["image_grid_thw"])
    with torch.no_grad():
        return model(**inputs).logits[0].float().log_softmax(-1)


def test_positions_are_transformers_own_in_padded_batches(case):
    processor, model, records = case
    family = family_of(model)
    rows = [list(r.token_ids) for r in records]
    width = max(map(len, rows))
    ids = torch.tensor([[processor.tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width) >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    media = family.merge_media([r.media for r in records])
    kwargs = family.padded_inputs(model, ids, mask, media)
    assert kwargs["position_ids"].shape == (4, 3, width)
    mm = (ids == model.config.image_token_id).int()
    reference, deltas = model.model.get_rope_index(ids, mm, image_grid_thw=media["image_grid_thw"], attention_mask=mask)
    real = mask.bool()
    assert torch.equal(kwargs["position_ids"][1:][:, real], reference[:, real])
    # The image prompts' text runs ahead of the token count (the 2 x 3 image moves on by 3, not 6).
    assert deltas[:, 0].tolist()[:2] == [(3 - 6) + (4 - 16), 2 - 4] and deltas[2, 0] == 0
    with torch.no_grad():
        logits = model(**kwargs).logits.float().log_softmax(-1)
    for row, record in enumerate(records):
        alone = own_forward(model, torch.tensor([record.token_ids]), record.media)
        torch.testing.assert_close(logits[row, real[row]], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", ["sdpa", VARLEN_ATTENTION])
def test_packed_rows_give_each_sequence_its_own_log_probs(case, attention):
    processor, model, records = case
    model.set_attn_implementation(attention)
    try:
        actor = ActorLanguage(model)
        answers = [processor.tokenizer.encode(a) for a in ("yes", "r", "fine")]
        sequences = [list(r.token_ids) + a for r, a in zip(records, answers)]
        packed = torch.tensor([sum(sequences, [])])
        media = family_of(model).merge_media([r.media for r in records])
        with torch.no_grad():
            got = actor(packed, [len(a) for a in answers], packed_seq_lens=[len(s) for s in sequences], media=media)
        banned = torch.tensor(family_of(model).banned_token_ids(model.config))
        for row, (record, seq, answer) in enumerate(zip(records, sequences, answers)):
            own = own_forward(model, torch.tensor([seq]), record.media).index_fill(-1, banned, float("-inf"))
            expected = own.log_softmax(-1)[len(seq) - len(answer) - 1:-1].gather(-1, torch.tensor(answer)[:, None])[:, 0]
            torch.testing.assert_close(got[row, :len(answer)], expected, atol=1e-5, rtol=0)
    finally:
        model.set_attn_implementation("sdpa")


def test_one_d_positions_run_silently_with_other_log_probs(case):
    """The trap: given plain 1-D positions the model raises nothing and computes other log-probs."""
    processor, model, records = case
    record = records[0]
    ids = torch.tensor([record.token_ids])
    media = record.media
    with torch.no_grad():
        flat = model(input_ids=ids, position_ids=torch.arange(ids.size(1))[None], **media).logits[0].log_softmax(-1)
    assert (flat - own_forward(model, ids, media)).abs().max() > 0.05


def test_engine_decodes_at_the_multimodal_positions(case):
    """The Hugging Face engine's log-probs (prefill with images, then one token at a time) equal
    transformers' forward on prompt + response with its own positions."""
    processor, model, records = case
    engine = hf_engine_for(model, processor.tokenizer, family=family_of(model))
    banned = torch.tensor(family_of(model).banned_token_ids(model.config))
    out = engine.generate([list(r.token_ids) for r in records], SamplingParams(max_new_tokens=6, n=2),
                          seeds=[5, 6, 7], media=[r.media for r in records])
    for row in range(out.sequences.size(0)):
        record = records[row // 2]
        sequence = out.sequences[row][out.attention_mask[row].bool()]
        logits = own_forward(model, sequence[None], record.media).index_fill(-1, banned, float("-inf")).log_softmax(-1)
        start = len(record.token_ids)
        expected = logits[start - 1:-1].gather(-1, sequence[start:, None])[:, 0]
        assert len(expected) == int(out.action_mask[row].sum()) >= 1
        torch.testing.assert_close(out.rollout_log_probs[row, :len(expected)], expected, atol=1e-5, rtol=0)


def test_mrope_positions_in_a_packed_row_restart_per_sequence():
    """Hand-computed: image token id 9, merge 2, a 1 x 4 x 6 grid (2 x 3 merged: 6 tokens) after
    two text tokens; the next sequence starts fresh."""
    ids = torch.tensor([[1, 2] + [9] * 6 + [3, 4] + [1, 2, 3]])
    positions = torch.tensor([list(range(10)) + [0, 1, 2]])
    rope = mrope_positions(ids, positions, torch.tensor([[1, 4, 6]]), image_token_id=9, merge=2)
    assert rope[0, 0].tolist() == [0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 0, 1, 2]
    assert rope[1, 0].tolist() == [0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 0, 1, 2]
    assert rope[2, 0].tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 0, 1, 2]
    with pytest.raises(ValueError, match=r"the batch has 6 <\|image_pad\|> tokens for 1 images of 4 tokens"):
        mrope_positions(ids, positions, torch.tensor([[1, 4, 4]]), image_token_id=9, merge=2)


def test_a_saved_folder_reads_image_rows_without_torchvision(tmp_path):
    folder = save_tiny_qwen_vl(tmp_path / "qwen", "2.5", seed=0)
    model = load_model(folder, dtype=torch.float32)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    tokenizer = build_tokenizer(str(folder), padding_side="left")
    images = build_image_prompts(str(folder), tokenizer)
    if importlib.util.find_spec("torchvision") is None:
        assert type(images.processor).__name__ == "QwenVLImageText"
    draw_disc("r", random.Random(0)).resize((84, 56)).save(tmp_path / "a.png")
    rows = [{"prompt": "<image>Colour?", "images": ["a.png"]},                          # verl's marker
            {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
             "images": ["a.png"]},
            {"prompt": "<image><image>Two?", "images": ["a.png"]}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = PromptDataset(str(data), tokenizer, input_key="prompt", image_key="images", images=images,
                            prompt_max_len=64, on_bad_row="skip", apply_chat_template=False)
    assert len(dataset) == 1 and dataset.skipped == 2    # chat parts need the chat template; two markers, one image
    record = dataset[0][0]
    assert str(record) == "<|vision_start|><|image_pad|><|vision_end|>Colour?"
    grid = record.media["image_grid_thw"].tolist()
    assert grid == [[1, 4, 6]] and list(record.token_ids).count(model.config.image_token_id) == 6
    assert list(record.marker_ids).count(model.config.image_token_id) == 1
    export = tmp_path / "export"
    images.processor.save_pretrained(export)
    assert (export / "preprocessor_config.json").is_file() and (export / "tokenizer_config.json").is_file()
    assert json.loads((export / "processor_config.json").read_text()) == {"processor_class": "Qwen2_5_VLProcessor"}
    assert family_for(model.config).context_length(model.config) == 512


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision imports here")
def test_vllm_rollouts_without_torchvision_stop_before_building(tmp_path):
    from lightrft.builders.engines import check_engine_serves_family
    from lightrft.config import ConfigError, PPORunConfig
    from tests.conftest import to_flags

    folder = save_tiny_qwen_vl(tmp_path / "qwen", "2", seed=0)

    def run_config(engine: str) -> PPORunConfig:
        values = dict(pretrain=folder, prompt_data="p.jsonl", remote_rm_url="exact", image_key="images",
                      advantage_estimator="group_norm", n_samples_per_prompt=4, rollout_batch_size=8,
                      train_batch_size=32, rollout_engine=engine)
        return PPORunConfig.from_namespace(PPORunConfig.build_parser("train_ppo").parse_args(to_flags(values)))

    with pytest.raises(ConfigError, match=r"--rollout_engine vllm: --pretrain .* is a Qwen2-VL / Qwen2.5-VL model "
                                          r"\(model_type 'qwen2_vl'\); vLLM's Qwen-VL model modules import "
                                          r"torchvision, .*: only hf can serve it; pass --rollout_engine hf"):
        check_engine_serves_family(run_config("vllm"))
    check_engine_serves_family(run_config("hf"))


def test_a_vision_language_model_of_another_kind_is_named_as_not_trained_yet(tmp_path):
    from transformers import LlavaConfig

    LlavaConfig().save_pretrained(tmp_path / "llava")
    with pytest.raises(ValueError, match=r"--image_key is set but --pretrain .* is a 'llava' model, a vision-language "
                                         r"model of a kind lightrft does not train yet"):
        build_image_prompts(str(tmp_path / "llava"), None)
