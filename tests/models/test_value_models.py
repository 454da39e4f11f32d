"""Critic and RewardModel: layouts, packed == padded, save/load, normalisation, clear errors."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightrft.models import Critic, RewardModel

from .conftest import make_batch

ATOL = 1e-5


def set_head(model, seed):
    """A non-trivial head (fresh heads are ~N(0, 0.02) and give values near 0)."""
    head = getattr(model.model, model.value_head_prefix)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(seed)))


def grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def test_critic_from_causal_lm_folder_loads_the_backbone(tiny_dirs):
    critic = Critic(tiny_dirs["qwen2"])
    lm = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen2"])
    assert not critic.head_loaded
    backbone = critic.model.model.state_dict()
    for name, weight in lm.model.state_dict().items():
        assert torch.equal(backbone[name], weight), name
    assert critic.model.score.weight.shape == (1, 64)
    assert critic.model.score.bias is None


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_critic_value_of_an_action_is_the_value_of_its_prefix(tiny_dirs, batch, arch):
    """values[i, j] is the head at the token before action j: the same number as the last-position
    value of that prefix run alone, without padding."""
    critic = Critic(tiny_dirs[arch])
    set_head(critic, seed=0)
    values = critic(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    assert values.shape == (4, batch.num_actions) and values.dtype == torch.float32
    for i, (p, r) in enumerate(zip(batch.prompt_lens, batch.response_lens)):
        real = batch.sequences[i][batch.attention_mask[i].bool()]  # (p + r,)
        for j in range(r):
            prefix = real[: p + j].unsqueeze(0)  # state before action j
            alone = critic.model(input_ids=prefix, use_cache=False)[0, -1]
            torch.testing.assert_close(values[i, j], alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_critic_packed_equals_padded_values_and_gradients(tiny_dirs, batch, arch):
    critic = Critic(tiny_dirs[arch])
    set_head(critic, seed=1)
    weights = torch.linspace(-1.0, 1.0, 4 * batch.num_actions).view(4, -1) * batch.action_mask()

    padded = critic(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    (padded * weights).sum().backward()
    padded_grads = grads(critic)
    critic.zero_grad()
    packed = critic(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
    (packed * weights).sum().backward()
    packed_grads = grads(critic)

    mask = batch.action_mask().bool()
    torch.testing.assert_close(packed[mask], padded[mask], atol=ATOL, rtol=0)
    assert (packed[~mask] == 0).all()
    assert "model.score.weight" in padded_grads
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=ATOL, rtol=1e-4, msg=name)


def test_critic_save_load_round_trip(tiny_dirs, batch, tmp_path):
    critic = Critic(tiny_dirs["llama"], value_head_prefix="value_head")
    set_head(critic, seed=2)
    critic.save_pretrained(tmp_path / "critic")
    assert json.loads((tmp_path / "critic" / "config.json").read_text())["value_head_prefix"] == "value_head"
    loaded = Critic(tmp_path / "critic", value_head_prefix="value_head")
    assert loaded.head_loaded
    expected = critic(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    got = loaded(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert expected.abs().max() > 0.1  # the loaded head is the trained one, not a fresh ~0 head

    with pytest.raises(ValueError, match="saved with value_head_prefix='value_head'.*--value_head_prefix value_head"):
        Critic(tmp_path / "critic")


def test_critic_saves_a_given_state_dict(tiny_dirs, batch, tmp_path):
    """DeepspeedStrategy.save_model passes the weights gathered from ZeRO-3, keyed like the
    wrapper's state_dict; those are written, not the live (possibly sharded) parameters."""
    critic = Critic(tiny_dirs["qwen2"])
    set_head(critic, seed=5)
    state = {name: tensor.clone() for name, tensor in critic.state_dict().items()}
    state["model.score.weight"].zero_()
    critic.save_pretrained(tmp_path / "gathered", state_dict=state)
    loaded = Critic(tmp_path / "gathered")
    assert loaded(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask).abs().max() == 0
    assert critic(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask).abs().max() > 0.1


@pytest.fixture
def reward_dir(tiny_dirs, tmp_path):
    rm = RewardModel(tiny_dirs["qwen2"], init_value_head=True)
    set_head(rm, seed=3)
    rm.save_pretrained(tmp_path / "rm")
    return tmp_path / "rm"


def test_reward_scores_ignore_left_and_right_padding(reward_dir, batch):
    rm = RewardModel(reward_dir)
    assert rm.head_loaded
    scores = rm(batch.sequences, attention_mask=batch.attention_mask)
    assert scores.shape == (4,) and scores.dtype == torch.float32
    for i in range(4):
        real = batch.sequences[i][batch.attention_mask[i].bool()].unsqueeze(0)  # unpadded (1, L)
        torch.testing.assert_close(scores[i], rm(real)[0], atol=ATOL, rtol=0)
    assert scores.std() > 1e-3  # different sequences, different scores
    packed = rm(batch.packed_ids, packed_seq_lens=batch.packed_seq_lens)
    torch.testing.assert_close(packed, scores, atol=ATOL, rtol=0)


def test_reward_packed_gradients_equal_padded(tiny_dirs):
    batch = make_batch([2, 5, 3], [3, 1, 4], seed=4)
    rm = RewardModel(tiny_dirs["llama"], init_value_head=True)
    set_head(rm, seed=4)
    weights = torch.tensor([1.0, -2.0, 0.5])
    (rm(batch.sequences, attention_mask=batch.attention_mask) * weights).sum().backward()
    padded_grads = grads(rm)
    rm.zero_grad()
    (rm(batch.packed_ids, packed_seq_lens=batch.packed_seq_lens) * weights).sum().backward()
    for name, grad in padded_grads.items():
        torch.testing.assert_close(grads(rm)[name], grad, atol=ATOL, rtol=1e-4, msg=name)


def test_reward_normalisation_on_known_numbers(reward_dir, batch, tmp_path):
    rm = RewardModel(reward_dir, normalize_reward=True)
    rm.model.score.weight.data.zero_()  # raw score exactly 0 for every sequence
    rm.set_normalization(mean=0.5, std=2.0)
    # (0 - 0.5) / 2.0 = -0.25
    assert rm(batch.sequences, attention_mask=batch.attention_mask).tolist() == [-0.25] * 4

    rm.save_pretrained(tmp_path / "normalised")
    config = json.loads((tmp_path / "normalised" / "config.json").read_text())
    assert (config["normalize_reward"], config["mean"], config["std"]) == (True, 0.5, 2.0)
    reloaded = RewardModel(tmp_path / "normalised", normalize_reward=True)
    assert reloaded(batch.sequences, attention_mask=batch.attention_mask).tolist() == [-0.25] * 4
    raw = RewardModel(tmp_path / "normalised")  # normalisation off: raw scores
    assert raw(batch.sequences, attention_mask=batch.attention_mask).tolist() == [0.0] * 4

    with pytest.raises(ValueError, match="std > 0"):
        rm.set_normalization(mean=0.0, std=0.0)


def test_reward_model_folder_without_head_is_an_error(tiny_dirs):
    with pytest.raises(ValueError, match=r"--reward_pretrain '.*qwen2' has no value-head weights 'score.weight'"):
        RewardModel(tiny_dirs["qwen2"])


def test_missing_value_model_paths_name_their_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--critic_pretrain '.*nothing_here'"):
        Critic(tmp_path / "nothing_here")
    with pytest.raises(FileNotFoundError, match=r"--reward_pretrain '.*nothing_here'"):
        RewardModel(tmp_path / "nothing_here")


def test_given_module_needs_its_head(tiny_dirs):
    lm = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen2"])
    with pytest.raises(TypeError, match="no value head nn.Linear named 'score'"):
        Critic(lm)
    critic = Critic(tiny_dirs["qwen2"])
    wrapped = Critic(critic.model)
    assert wrapped.model is critic.model


def test_a_vision_language_critic_and_reward_model_see_the_images(tmp_path):
    """A value head on a vision-language backbone (Idefics3): the backbone loads from the policy's
    folder, the values and scores change with the image, a packed row gives the padded values, and
    the vision tower gets a gradient (the critic trains it with the decoder)."""
    from transformers import AutoModelForImageTextToText

    from lightrft.models.families.idefics3 import image_tokens
    from lightrft.utils.tiny import save_tiny_idefics3

    folder = save_tiny_idefics3(tmp_path / "vlm")
    critic, reward = Critic(str(folder)), RewardModel(str(folder), init_value_head=True)
    policy = AutoModelForImageTextToText.from_pretrained(folder)
    for model in (critic.model, reward.model):
        assert torch.equal(model.model.vision_model.embeddings.patch_embedding.weight,
                           policy.model.vision_model.embeddings.patch_embedding.weight)
        assert torch.equal(model.model.text_model.embed_tokens.weight, policy.model.text_model.embed_tokens.weight)
    config = critic.model.config
    ids = torch.tensor([[5, 6] + [config.image_token_id] * image_tokens(config) + [7, 8, 9, 10]])
    size, generator = config.vision_config.image_size, torch.Generator().manual_seed(0)
    first, second = ({"pixel_values": torch.rand(1, 3, size, size, generator=generator)} for _ in range(2))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        values = [critic(ids, 3, attention_mask=mask, media=m) for m in (first, second)]
        scores = [reward(ids, attention_mask=mask, media=m) for m in (first, second)]
        packed = critic(ids, [3], packed_seq_lens=[ids.size(1)], media=first)
        packed_score = reward(ids, packed_seq_lens=[ids.size(1)], media=first)
    assert (values[0] - values[1]).abs().min() > 1e-3 and (scores[0] - scores[1]).abs().min() > 1e-3
    assert torch.allclose(packed, values[0], atol=1e-5) and torch.allclose(packed_score, scores[0], atol=1e-5)
    critic(ids, 3, attention_mask=mask, media=first).sum().backward()
    vision = [p.grad for n, p in critic.model.named_parameters() if ".vision_model." in n and p.grad is not None]
    assert vision and max(g.abs().max().item() for g in vision) > 1e-4


def test_a_run_with_images_refuses_a_text_critic_or_reward_model(tmp_path):
    from lightrft.builders.models import check_scorers_take_images
    from lightrft.config import PPORunConfig
    from lightrft.utils.tiny import save_tiny_idefics3, save_tiny_model
    from tests.conftest import to_flags

    text, vision = save_tiny_model(tmp_path / "text"), save_tiny_idefics3(tmp_path / "vlm")

    def config(**flags):
        values = dict(pretrain=vision, prompt_data="p.jsonl", remote_rm_url="exact", image_key="images",
                      advantage_estimator="gae", n_samples_per_prompt=4, rollout_batch_size=8, train_batch_size=32)
        parser = PPORunConfig.build_parser("train_ppo")
        return PPORunConfig.from_namespace(parser.parse_args(to_flags({**values, **flags})))

    check_scorers_take_images(config(critic_pretrain=vision, reward_pretrain=vision))
    for flag in ("critic_pretrain", "reward_pretrain"):
        with pytest.raises(ValueError, match=rf"--{flag} .*text is a text model \(qwen2\) and the prompts carry"):
            check_scorers_take_images(config(**{"critic_pretrain": vision, flag: text}))


def test_a_qwen_vl_critic_values_the_samples_at_their_multimodal_positions(tmp_path):
    """Qwen2.5-VL (multimodal rotary positions) as a critic's backbone: the values change with the
    image and a packed row gives the padded values."""
    import random

    from lightrft.datasets.images import ImagePrompts
    from lightrft.datasets.toy_images import draw_disc
    from lightrft.models.families import family_of
    from lightrft.utils.tiny import build_tiny_qwen_vl, build_tiny_qwen_vl_processor

    processor = build_tiny_qwen_vl_processor(version="2.5")
    build_tiny_qwen_vl("2.5", processor.tokenizer, seed=3).save_pretrained(tmp_path / "qwen")
    critic = Critic(str(tmp_path / "qwen"))
    images = ImagePrompts(processor, family_of(critic.model))
    rng = random.Random(1)
    red, green = [draw_disc("r", rng)], [draw_disc("g", rng)]
    ids = torch.tensor([images.expand(f"{images.marker}Colour?", red, True) + [5, 6, 7]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        values = [critic(ids, 3, attention_mask=mask, media=images.media(p)) for p in (red, green)]
        packed = critic(ids, [3], packed_seq_lens=[ids.size(1)], media=images.media(red))
    assert (values[0] - values[1]).abs().min() > 1e-3
    assert torch.allclose(packed, values[0], atol=1e-5)
