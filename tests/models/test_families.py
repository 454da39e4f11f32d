"""Model families (lightrft/models/families): the registry; the RoBERTa decoder family, whose
positions count from pad_token_id + 1; Idefics3, whose images are encoded apart from the decoder.
Each is checked against the model's own forward.

The model's own forward (no position ids given) computes RoBERTa's positions itself, so it is the
independent reference: the actor, critic, shared-prompt rows and the rollout engine must agree
with it, padded and packed, and must not when the family is taken away (the check can fail).
"""

import pytest
import torch
from transformers import RobertaConfig, RobertaForCausalLM, RobertaModel

from lightrft.builders.engines import build_rollout_engine, check_engine_serves_family
from lightrft.config import ConfigError, PPORunConfig
from lightrft.models import ActorLanguage, Critic, RewardModel
from lightrft.models.families import (CAUSAL_LM, MODEL_FAMILIES, ModelFamily, family_for, family_of, merge_media,
                                      register_family)
from lightrft.models.families.idefics3 import Idefics3
from lightrft.models.families.roberta import RobertaDecoder
from lightrft.models.hf_utils import value_model_class
from lightrft.models.packing import prompt_group_ids
from lightrft.rollout import SamplingParams, hf_engine_for
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm, build_tiny_idefics3, build_vlm_tokenizer
from tests.conftest import to_flags
from tests.device.elsewhere import DeviceMixError, elsewhere

TEXTS = ("12+34=46", "7+8=15", "12+34=47")


def tiny_roberta(tokenizer, is_decoder: bool = True, seed: int = 0) -> RobertaForCausalLM:
    torch.manual_seed(seed)
    config = RobertaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=128, max_position_embeddings=64, is_decoder=is_decoder,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                           bos_token_id=None, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return RobertaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def roberta(tokenizer):
    return tiny_roberta(tokenizer)


def own_log_probs(model, ids: torch.Tensor, actions: int) -> torch.Tensor:
    """The model's log-probs of the last `actions` tokens of one unpadded sequence, from its own
    forward (RoBERTa derives its positions from the ids). Shape: (L,) -> (actions,)"""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[1:, None])[-actions:, 0]


def left_padded(seqs: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids, mask = torch.full((len(seqs), width), pad), torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq):], mask[row, width - len(seq):] = seq, 1
    return ids, mask


def test_registry_answers_by_model_type_and_refuses_clashes(tokenizer, roberta):
    assert family_for(roberta.config) is MODEL_FAMILIES["roberta"] and isinstance(family_of(roberta), RobertaDecoder)
    llama = build_tiny_causal_lm(tokenizer, arch="llama")
    assert family_of(llama) is CAUSAL_LM and CAUSAL_LM.decoding_positions(llama) is None   # nothing to apply
    assert family_of(torch.nn.Linear(2, 2)) is CAUSAL_LM
    with pytest.raises(ValueError, match="'roberta' is already served by the 'RoBERTa decoder' family"):
        register_family(RobertaDecoder())
    with pytest.raises(ValueError, match="names no model_types"):
        register_family(ModelFamily())
    with pytest.raises(TypeError, match="ModelFamily instance"):
        register_family(RobertaDecoder)


def test_positions_count_from_pad_plus_one(roberta):
    family = family_of(roberta)
    positions = torch.tensor([[0, 0, 1, 2], [0, 1, 2, 3]])
    assert torch.equal(family.position_ids(roberta.config, positions), positions + roberta.config.pad_token_id + 1)
    assert family.context_length(roberta.config) == 64 - (roberta.config.pad_token_id + 1)
    assert CAUSAL_LM.context_length(roberta.config) == 64


def test_actor_log_probs_are_the_models_own_padded_and_packed(tokenizer, roberta):
    seqs = [torch.tensor(tokenizer.encode(text)) for text in TEXTS]
    expected = torch.stack([own_log_probs(roberta, s, 3) for s in seqs])               # (3, 3)
    actor = ActorLanguage(roberta, packing_samples=True)
    ids, mask = left_padded(seqs, tokenizer.pad_token_id)
    with torch.no_grad():
        padded = actor(ids, num_actions=3, attention_mask=mask)                         # (3, 3)
        packed = actor(torch.cat(seqs)[None], num_actions=[3] * 3, packed_seq_lens=[len(s) for s in seqs])
    torch.testing.assert_close(padded, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)

    # Without the family the actor feeds positions from 0: every token reads another position's
    # embedding and the log-probs are not the model's.
    actor.family = CAUSAL_LM
    with torch.no_grad():
        unmapped = actor(ids, num_actions=3, attention_mask=mask)
    assert (unmapped - expected).abs().max() > 0.01


def test_shared_prompt_rows_map_positions_too(tokenizer, roberta):
    """Two samples of one prompt in a packed row share its forward (the shared row has its own
    position ids, built by the family): the same log-probs as the unshared row."""
    seqs = [torch.tensor(tokenizer.encode(text)) for text in TEXTS]
    lens, actions = [len(s) for s in seqs], [2, 2, 2]
    groups = prompt_group_ids(seqs, actions)
    assert groups[0] == groups[2] != groups[1]               # "12+34=4" twice
    actor = ActorLanguage(roberta, packing_samples=True)
    with torch.no_grad():
        shared = actor(torch.cat(seqs)[None], num_actions=actions, packed_seq_lens=lens, prompt_groups=groups)
    assert actor.prompt_sharing.reason is None
    expected = torch.stack([own_log_probs(roberta, s, 2) for s in seqs])
    torch.testing.assert_close(shared, expected, atol=1e-5, rtol=0)


def test_critic_values_packed_equal_padded(tokenizer, roberta, tmp_path):
    roberta.save_pretrained(tmp_path / "decoder")
    critic = Critic(str(tmp_path / "decoder"), packing_samples=True)
    assert isinstance(critic.family, RobertaDecoder)
    seqs = [torch.tensor(tokenizer.encode(text)) for text in TEXTS]
    ids, mask = left_padded(seqs, tokenizer.pad_token_id)
    with torch.no_grad():
        padded = critic(ids, num_actions=3, attention_mask=mask)
        packed = critic(torch.cat(seqs)[None], num_actions=[3] * 3, packed_seq_lens=[len(s) for s in seqs])
        # The backbone's own forward on one unpadded sequence (positions computed by RoBERTa).
        own = critic.model.roberta(input_ids=seqs[1][None]).last_hidden_state
        own_values = getattr(critic.model, critic.value_head_prefix)(own).squeeze(-1)[0, -4:-1]
    torch.testing.assert_close(packed[:, :3], padded, atol=1e-5, rtol=0)
    torch.testing.assert_close(padded[1], own_values, atol=1e-5, rtol=0)


def test_rollout_engine_samples_with_the_models_positions(tokenizer, roberta):
    """The Hugging Face engine's log-probs of its own samples equal the actor's on them; without
    the family they do not."""
    prompts = [tokenizer.encode("12+3"), tokenizer.encode("4+5=")]
    params = SamplingParams(max_new_tokens=5, n=2)
    engine = hf_engine_for(roberta, tokenizer, family=family_of(roberta))
    out = engine.generate(prompts, params, seeds=[1, 2])
    actor = ActorLanguage(roberta)
    actions = out.sequences.size(1) - out.prompt_len
    with torch.no_grad():
        scored = actor(out.sequences, num_actions=actions, attention_mask=out.attention_mask)
    mask = out.action_mask.bool()
    torch.testing.assert_close(scored[mask], out.rollout_log_probs[mask], atol=1e-5, rtol=0)

    plain = hf_engine_for(roberta, tokenizer).generate(prompts, params, seeds=[1, 2])
    plain_scored = actor(plain.sequences, num_actions=plain.sequences.size(1) - plain.prompt_len,
                         attention_mask=plain.attention_mask).detach()
    plain_mask = plain.action_mask.bool()
    assert (plain_scored[plain_mask] - plain.rollout_log_probs[plain_mask]).abs().max() > 0.01


def test_an_encoder_is_refused_as_policy_and_critic_and_packed_only_as_reward_model(tokenizer):
    encoder = tiny_roberta(tokenizer, is_decoder=False)
    with pytest.raises(ValueError, match=r"--pretrain: .*is_decoder.*\"is_decoder\": true"):
        ActorLanguage(encoder)
    with pytest.raises(ValueError, match="--critic_pretrain"):
        Critic(_with_head(encoder))
    with pytest.raises(ValueError, match=r"--reward_pretrain: a RoBERTa encoder .* without --packing_samples"):
        RewardModel(_with_head(encoder), packing_samples=True)
    RewardModel(_with_head(encoder))                    # padded scoring of a bidirectional reward model is fine


def _with_head(model):
    """The encoder's backbone plus a value head, as a critic or reward model folder would hold."""
    cls = value_model_class(RobertaModel, "score")
    value_model = cls(model.config)
    value_model.roberta.load_state_dict(model.roberta.state_dict(), strict=False)
    return value_model


def test_actor_loads_a_folder_through_its_family(tokenizer, roberta, tmp_path):
    roberta.save_pretrained(tmp_path / "decoder")
    actor = ActorLanguage(str(tmp_path / "decoder"))
    assert type(actor.model) is RobertaForCausalLM and isinstance(actor.family, RobertaDecoder)
    ids = torch.tensor(tokenizer.encode(TEXTS[0]))
    with torch.no_grad():
        torch.testing.assert_close(actor(ids[None], num_actions=3)[0], own_log_probs(roberta, ids, 3), atol=1e-5, rtol=0)


def test_a_run_asking_an_engine_the_family_does_not_list_stops_before_building(tokenizer, roberta, tmp_path):
    roberta.save_pretrained(tmp_path / "decoder")

    def run_config(engine: str) -> PPORunConfig:
        values = dict(pretrain=tmp_path / "decoder", prompt_data="p.jsonl", remote_rm_url="math",
                      advantage_estimator="group_norm", n_samples_per_prompt=4, rollout_batch_size=8,
                      train_batch_size=32, rollout_engine=engine)
        return PPORunConfig.from_namespace(PPORunConfig.build_parser("train_ppo").parse_args(to_flags(values)))

    with pytest.raises(ConfigError, match=r"--rollout_engine vllm: --pretrain .* is a RoBERTa decoder model "
                                          r"\(model_type 'roberta'\); only hf can serve it; pass --rollout_engine hf"):
        build_rollout_engine(run_config("vllm"), tokenizer, seed=0)
    assert build_rollout_engine(run_config("hf"), tokenizer, seed=0) is None


# ================================================================ Idefics3: images beside the text
def vlm_samples(tokenizer):
    """Three samples: one image, none (a text-only sample in a vision-language batch), two images;
    each image a run of 4 `<image>` tokens between `<fake_token_around_image>`s. Returns the token
    sequences and each sample's media (None without images)."""
    image, around = tokenizer.convert_tokens_to_ids(["<image>", "<fake_token_around_image>"])
    generator = torch.Generator().manual_seed(0)
    seqs, media = [], []
    for prompt, images, answer in [("see", 1, "red"), ("c", 0, "blue"), ("two", 2, "ok")]:
        ids = tokenizer.encode(prompt)
        for _ in range(images):
            ids += [around] + [image] * 4 + [around]
        seqs.append(torch.tensor(ids + tokenizer.encode(answer)))
        media.append({"pixel_values": torch.randn(images, 3, 56, 56, generator=generator)} if images else None)
    return seqs, media


def own_vlm_log_probs(model, seqs, media, actions: int) -> torch.Tensor:
    """Each sample alone through transformers' own forward (pixel values in, the model merges
    them), the `<image>` placeholder out of the distribution (no engine samples it: the policy
    lightrft trains is the one without it). Shape: (N, actions)"""
    rows = []
    for ids, sample in zip(seqs, media):
        pixels = {} if sample is None else {"pixel_values": sample["pixel_values"][None]}
        logits = model(input_ids=ids[None], **pixels).logits[0, :-1].float()
        logits = logits.index_fill(-1, torch.tensor([model.config.image_token_id]), float("-inf"))
        rows.append(torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[-actions:, 0])
    return torch.stack(rows)


def test_idefics3_packed_and_padded_equal_each_sample_alone_values_and_gradients():
    tokenizer = build_vlm_tokenizer()
    model = build_tiny_idefics3(tokenizer)
    actor = ActorLanguage(model, packing_samples=True)
    assert isinstance(actor.family, Idefics3)
    seqs, media = vlm_samples(tokenizer)
    batch_media = merge_media(media)
    assert batch_media["pixel_values"].shape == (3, 3, 56, 56)

    expected = own_vlm_log_probs(model, seqs, media, 2)
    expected.sum().backward()
    own_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    assert any("vision_model" in n for n in own_grads)          # the image path trains too

    packed = actor(torch.cat(seqs)[None], num_actions=[2] * 3, packed_seq_lens=[len(s) for s in seqs],
                   media=batch_media)
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)
    packed.sum().backward()
    for name, grad in own_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, atol=1e-5, rtol=1e-4)
    model.zero_grad()

    ids, mask = left_padded(seqs, tokenizer.pad_token_id)
    with torch.no_grad():
        padded = actor(ids, num_actions=2, attention_mask=mask, media=batch_media)
    torch.testing.assert_close(padded, expected.detach(), atol=1e-5, rtol=0)


def test_idefics3_takes_image_features_as_one_tensor_or_a_list_per_image(monkeypatch):
    # transformers 5.24 returns get_image_features' pooler_output as a list of per-image tensors
    # (earlier: one (N, tokens, H) tensor); the family gives the same embeddings either way.
    from lightrft.models.families.idefics3 import vision_model_of

    tokenizer = build_vlm_tokenizer()
    model = build_tiny_idefics3(tokenizer).eval()
    seqs, media = vlm_samples(tokenizer)
    ids, batch_media = torch.cat(seqs)[None], merge_media(media)
    family = ActorLanguage(model).family
    with torch.no_grad():
        whole = family.media_inputs(model, ids, batch_media)["inputs_embeds"]
        blank = family.blank_media_inputs(model, ids)["inputs_embeds"]
    vision = vision_model_of(model)
    original = vision.get_image_features

    def per_image(*args, **kwargs):
        output = original(*args, **kwargs)
        pooled = output.pooler_output
        if isinstance(pooled, torch.Tensor):
            output.pooler_output = [image for image in pooled.reshape(-1, *pooled.shape[-2:])]
        return output
    monkeypatch.setattr(vision, "get_image_features", per_image)
    with torch.no_grad():
        listed = family.media_inputs(model, ids, batch_media)["inputs_embeds"]
        listed_blank = family.blank_media_inputs(model, ids)["inputs_embeds"]
    assert torch.equal(listed, whole) and torch.equal(listed_blank, blank)
    assert not torch.equal(whole, model.get_input_embeddings()(ids))        # the images did go in


def test_media_that_does_not_match_the_placeholders_is_refused():
    tokenizer = build_vlm_tokenizer()
    actor = ActorLanguage(build_tiny_idefics3(tokenizer))
    seqs, media = vlm_samples(tokenizer)
    one_image_short = {"pixel_values": merge_media(media)["pixel_values"][:2]}
    with pytest.raises(ValueError, match=r"12 <image> tokens \(id 100\) for 2 images of 4 tokens each \(8\)"):
        actor(torch.cat(seqs)[None], num_actions=[2] * 3, packed_seq_lens=[len(s) for s in seqs],
              media=one_image_short)
    with pytest.raises(ValueError, match="different media fields"):
        merge_media([{"pixel_values": torch.zeros(1)}, {"pixel_values": torch.zeros(1), "extra": torch.zeros(1)}])
    text_actor = ActorLanguage(build_tiny_causal_lm(tokenizer))
    with pytest.raises(ValueError, match="causal LM models take token ids only; this batch also carries pixel_values"):
        text_actor(seqs[0][None], num_actions=2, media=media[0])


def test_an_idefics3_folder_loads_through_its_family_and_every_engine_serves_it(tmp_path):
    tokenizer = build_vlm_tokenizer()
    build_tiny_idefics3(tokenizer).save_pretrained(tmp_path / "vlm")
    actor = ActorLanguage(str(tmp_path / "vlm"))
    assert type(actor.model).__name__ == "Idefics3ForConditionalGeneration"
    for engine in ("hf", "vllm"):
        values = dict(pretrain=tmp_path / "vlm", prompt_data="p.jsonl", remote_rm_url="math", rollout_engine=engine,
                      advantage_estimator="group_norm", n_samples_per_prompt=4, rollout_batch_size=8,
                      train_batch_size=32)
        config = PPORunConfig.from_namespace(PPORunConfig.build_parser("train_ppo").parse_args(to_flags(values)))
        check_engine_serves_family(config)


def test_the_hf_engine_samples_with_images_and_its_log_probs_are_the_actors():
    """Two prompts with the same token ids and different images (so the engine's shared prefill
    must keep them apart), one text-only prompt, two samples each; the `<image>` placeholder is
    never sampled although it is the likeliest token (its logit raised)."""
    tokenizer = build_vlm_tokenizer()
    model = build_tiny_idefics3(tokenizer)
    image, around = tokenizer.convert_tokens_to_ids(["<image>", "<fake_token_around_image>"])
    with torch.no_grad():
        model.lm_head.weight[image] *= 50            # the placeholder dominates the next-token logits
    prompt = tokenizer.encode("col") + [around] + [image] * 4 + [around] + tokenizer.encode("=")
    generator = torch.Generator().manual_seed(1)
    media = [{"pixel_values": torch.randn(1, 3, 56, 56, generator=generator)} for _ in range(2)] + [None]
    prompts = [prompt, prompt, tokenizer.encode("text=")]
    engine = hf_engine_for(model, tokenizer, family=family_of(model))
    assert engine.capabilities.multimodal
    out = engine.generate(prompts, SamplingParams(max_new_tokens=6, n=2), seeds=[5, 6, 7], media=media)

    responses = out.sequences[:, out.prompt_len:]
    assert not (responses[out.action_mask.bool()] == image).any()
    assert not torch.equal(out.sequences[0], out.sequences[2])      # other image, other answer
    actor = ActorLanguage(model)
    with torch.no_grad():
        scored = actor(out.sequences, num_actions=responses.size(1), attention_mask=out.attention_mask,
                       media=merge_media([m for m in media for _ in range(2)]))
    # The engine samples from the distribution without the placeholder: its log-probs are the
    # actor's renormalised over the other tokens, so compare the allowed distribution's.
    mask = out.action_mask.bool()
    with torch.no_grad():
        kwargs = actor.family.padded_inputs(actor.model, out.sequences, out.attention_mask,
                                            merge_media([m for m in media for _ in range(2)]))
        logits = actor.model(**kwargs).logits[:, out.prompt_len - 1:-1].float()
        logits[..., image] = float("-inf")
        allowed = torch.log_softmax(logits, -1).gather(-1, responses[..., None])[..., 0]
    torch.testing.assert_close(allowed[mask], out.rollout_log_probs[mask], atol=1e-5, rtol=0)
    assert (scored[mask] <= allowed[mask] + 1e-6).all()          # the full softmax gives the placeholder mass

    with pytest.raises(ValueError, match="built without its family"):
        hf_engine_for(model, tokenizer).generate(prompts, SamplingParams(max_new_tokens=2), media=media)


def test_images_from_another_device_reach_the_models_device_at_the_family():
    """Pixel values that live "on another device" (tests/device/elsewhere.py: mixing them with the
    model's tensors raises as CUDA would) are moved by the family, in the actor's packed and padded
    forwards and in the engine's prefill, with the same log-probs as host tensors."""
    tokenizer = build_vlm_tokenizer()
    model = build_tiny_idefics3(tokenizer)
    actor = ActorLanguage(model)
    seqs, media = vlm_samples(tokenizer)
    here = merge_media(media)
    away = {key: elsewhere(value) for key, value in here.items()}
    with pytest.raises(DeviceMixError):
        model.model.vision_model.embeddings.patch_embedding(away["pixel_values"])   # an unmoved image meets a weight
    lens = [len(s) for s in seqs]
    with torch.no_grad():
        expected = actor(torch.cat(seqs)[None], num_actions=[2] * 3, packed_seq_lens=lens, media=here)
        torch.testing.assert_close(actor(torch.cat(seqs)[None], num_actions=[2] * 3, packed_seq_lens=lens,
                                         media=away), expected, atol=0, rtol=0)
        ids, mask = left_padded(seqs, tokenizer.pad_token_id)
        torch.testing.assert_close(actor(ids, num_actions=2, attention_mask=mask, media=away), expected,
                                   atol=1e-5, rtol=0)
    engine = hf_engine_for(model, tokenizer, family=family_of(model))
    params = SamplingParams(max_new_tokens=4)
    prompt = [seqs[0][:-3].tolist()]
    plain = engine.generate(prompt, params, seeds=[3], media=[media[0]])
    moved = engine.generate(prompt, params, seeds=[3],
                            media=[{"pixel_values": elsewhere(media[0]["pixel_values"])}])
    assert torch.equal(plain.sequences, moved.sequences)


def test_lora_leaves_the_vision_tower_out_and_the_freeze_flag_fits_vision_models_only():
    tokenizer = build_vlm_tokenizer()
    lora = ActorLanguage(build_tiny_idefics3(tokenizer), lora_rank=4)
    adapters = [name for name, p in lora.model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in name and ".text_model." in name for name in adapters)
    frozen = ActorLanguage(build_tiny_idefics3(tokenizer), freeze_vision_tower=True)
    trainable = {name for name, p in frozen.model.named_parameters() if p.requires_grad}
    assert trainable and not any(name.startswith(("model.vision_model.", "model.connector.")) for name in trainable)
    assert "lm_head.weight" in trainable and any(".text_model." in name for name in trainable)
    with pytest.raises(ValueError, match="--freeze_vision_tower: --pretrain is a causal LM model, which has no vision "
                                         "tower"):
        ActorLanguage(build_tiny_causal_lm(tokenizer), freeze_vision_tower=True)


def test_a_vision_language_models_text_model_class_is_imported_before_it_is_built(tmp_path):
    """`load_model` imports a sub-model's modeling module before `from_pretrained` builds it: built
    inside DeepSpeed's zero.Init (ZeRO-3), a class imported meanwhile and decorated after its
    creation (transformers' hub-kernel layers, with the `kernels` package installed) lost its
    decorated __init__ when zero.Init put back the one it wrapped, and later instances failed in
    forward. A fresh interpreter, so that nothing imported the module before."""
    import subprocess
    import sys

    from lightrft.utils.tiny import save_tiny_idefics3
    from tests.conftest import REPO_ROOT, subprocess_env

    folder = save_tiny_idefics3(tmp_path / "vlm")
    script = ("import sys; from transformers import AutoConfig; "
              "from lightrft.models.hf_utils import import_submodel_modules; "
              f"config = AutoConfig.from_pretrained({str(folder)!r}); "
              "before = 'transformers.models.llama.modeling_llama' in sys.modules; "
              "import_submodel_modules(config); "
              "print(config.text_config.model_type, before, 'transformers.models.llama.modeling_llama' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-3:] == ["llama", "False", "True"]
