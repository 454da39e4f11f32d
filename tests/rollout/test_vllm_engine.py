"""VLLMEngine: import and error behaviour everywhere; the shared rollout contract on a CUDA GPU
with vLLM installed (skipped otherwise)."""

import importlib.util

import pytest

from lightrft.rollout import ROLLOUT_ENGINES, SamplingParams, VLLMEngine, make_rollout_engine
from tests.rollout.contract import (
    PROMPTS,
    EngineCase,
    RolloutEngineContract,
    build_contract_model,
    greedy_chain,
    response_of,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown when vLLM is missing")
def test_without_vllm_the_engine_names_the_install_command():
    with pytest.raises(ImportError, match=r"pip install lightrft\[vllm\]"):
        VLLMEngine("some/model", pad_token_id=0, eos_token_id=2)
    with pytest.raises(ImportError, match=r"pip install lightrft\[vllm\]"):
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


def _save(tmp_path_factory, seed: int):
    # head_dim 32: vLLM's attention kernels do not take the 16 of the default tiny size.
    tokenizer, model = build_contract_model(seed=seed, hidden_size=128)
    path = tmp_path_factory.mktemp(f"contract_model_{seed}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer, model, str(path)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
class TestVLLMEngineContract(RolloutEngineContract):
    # vLLM's kernels differ from the eager reference forward in the last float32 digits.
    logprob_atol = 1e-4

    @pytest.fixture(scope="class")
    def case(self, tmp_path_factory):
        tokenizer, model, path = _save(tmp_path_factory, seed=0)
        engine = VLLMEngine(path, tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0, dtype="float32",
                            gpu_memory_utilization=0.3, max_model_len=256, enforce_eager=True)
        prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
        return EngineCase(engine, model.cuda(), prompt_ids, tokenizer.pad_token_id, tokenizer.eos_token_id)

    def test_update_weights_switches_the_served_model(self, case, tmp_path_factory):
        """After loading another model's weights (by reference, from GPU tensors) greedy decoding
        follows that model; loading the original ones back restores the original chains."""
        _, other, _ = _save(tmp_path_factory, seed=1)
        other = other.cuda()
        params = SamplingParams(temperature=0.0, max_new_tokens=8)
        case.engine.sleep()
        case.engine.wake_up()
        case.engine.update_weights(other.named_parameters())
        out = case.engine.generate(case.prompt_ids, params)
        for row, prompt in enumerate(case.prompt_ids):
            assert response_of(out, row) == greedy_chain(other, prompt, 8, case.eos_token_id)[0]
        case.engine.update_weights(case.reference.named_parameters())
        out = case.engine.generate(case.prompt_ids, params)
        for row, prompt in enumerate(case.prompt_ids):
            assert response_of(out, row) == greedy_chain(case.reference, prompt, 8, case.eos_token_id)[0]

    def test_update_weights_while_asleep_is_refused(self, case):
        case.engine.sleep()
        try:
            with pytest.raises(RuntimeError, match="wake_up"):
                case.engine.update_weights([])
        finally:
            case.engine.wake_up()
