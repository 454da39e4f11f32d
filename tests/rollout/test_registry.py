"""The rollout-engine registry: names, declared capabilities, building by name, and what the code
that drives an engine reads from them instead of its name."""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from lightrft.builders.engines import ENGINE_BUILDERS, build_rollout_engine, check_engine_roles
from lightrft.config import ConfigError, PPORunConfig, RolloutConfig
from lightrft.doctor.memory import recommendations
from lightrft.rollout import (ROLLOUT_ENGINES, EngineCapabilities, HFEngine, RolloutManager, RolloutOutput,
                              SamplingParams, VLLMEngine, engine_capabilities, engine_names, hf_engine_for,
                              make_rollout_engine, register_engine)
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm
from tests.conftest import to_flags

PACKAGE = Path(__file__).resolve().parents[2] / "lightrft"
BUILTIN = ["hf", "vllm"]


def test_the_builtin_engines_declare_what_they_do():
    assert engine_names() == BUILTIN
    hf, vllm = engine_capabilities("hf"), engine_capabilities("vllm")
    assert hf == EngineCapabilities(weight_syncs=frozenset({"live"}), lora=True, tensor_parallel=False, sleep=False,
                                    keeps_weights_asleep=False, multimodal=True, rollout_log_probs=True,
                                    needs_shutdown=False, one_per_process=False,
                                    memory_options=("micro_rollout_batch_size",), routes=True, weight_switch=True)
    assert vllm == EngineCapabilities(weight_syncs=frozenset({"full", "delta", "adapter"}), lora=True,
                                      tensor_parallel=True, sleep=True, keeps_weights_asleep=True, multimodal=True,
                                      rollout_log_probs=True, needs_shutdown=True, one_per_process=True,
                                      memory_options=("vllm_kv_cache_gb", "vllm_gpu_memory_utilization"),
                                      routes=False, weight_switch=True)
    assert hf.shares_live_weights and not vllm.shares_live_weights
    # Every memory option the doctor would name is a rollout option.
    options = {f.name for f in dataclasses.fields(RolloutConfig)}
    assert set(hf.memory_options + vllm.memory_options) <= options


def test_instances_expose_the_registered_capabilities():
    tokenizer = build_char_tokenizer()
    engine = make_rollout_engine("hf", model=build_tiny_causal_lm(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
    assert isinstance(engine, HFEngine) and engine.capabilities is engine_capabilities("hf")
    # Read from the class: building a VLLMEngine needs vLLM, its capabilities do not.
    assert VLLMEngine.capabilities is engine_capabilities("vllm")
    assert ROLLOUT_ENGINES["hf"].factory is HFEngine and ROLLOUT_ENGINES["vllm"].factory is VLLMEngine


def test_the_option_choices_are_the_registered_engines():
    """The run config lies below the rollout package and keeps its own list of choices."""
    field = next(f for f in dataclasses.fields(RolloutConfig) if f.name == "rollout_engine")
    assert sorted(field.metadata["choices"]) == engine_names()


def test_an_unknown_name_lists_the_choices():
    for ask in (lambda: make_rollout_engine("sglang"), lambda: engine_capabilities("sglang")):
        with pytest.raises(ValueError, match=r"unknown rollout engine 'sglang' \(--rollout_engine\): choose one of "
                                             r"\['hf', 'vllm'\]"):
            ask()


def test_capabilities_refuse_what_cannot_be():
    with pytest.raises(ValueError, match="non-empty subset"):
        EngineCapabilities(weight_syncs=frozenset())
    with pytest.raises(ValueError, match=r"non-empty subset of \('live', 'full', 'delta', 'adapter'\), "
                                         r"got \['broadcast', 'full'\]"):
        EngineCapabilities(weight_syncs=frozenset({"full", "broadcast"}))
    with pytest.raises(ValueError, match="'live' stands alone"):
        EngineCapabilities(weight_syncs=frozenset({"live", "full"}))
    assert EngineCapabilities(weight_syncs={"full"}).weight_syncs == frozenset({"full"})   # any set, kept frozen


class FixedEngine:
    """A toy engine with its own (pretend) weights: every response is `token` then EOS, at
    log-prob -1 each; it records the lifecycle calls it gets."""

    capabilities = EngineCapabilities(weight_syncs=frozenset({"full"}), needs_shutdown=True)
    sync_bucket_mb = 1.0
    weight_sync = "auto"

    def __init__(self, token: int, eos_token_id: int = 2):
        self.token, self.eos = token, eos_token_id
        self.calls = []

    def generate(self, prompt_token_ids, params, seeds=None):
        prompts = [p for p in prompt_token_ids for _ in range(params.n)]
        return RolloutOutput.from_token_lists(prompts, [[self.token, self.eos]] * len(prompts),
                                              [[-1.0, -1.0]] * len(prompts), 0, [self.eos])

    def update_weights(self, named_params):
        self.calls.append(("update", [name for name, _ in named_params]))

    def sleep(self):
        self.calls.append(("sleep",))

    def wake_up(self):
        self.calls.append(("wake_up",))

    def shutdown(self):
        self.calls.append(("shutdown",))


@pytest.fixture
def fixed_engine():
    register_engine("fixed", FixedEngine, FixedEngine.capabilities)
    try:
        yield
    finally:
        ROLLOUT_ENGINES.pop("fixed")


def test_a_registered_engine_is_built_by_name_and_driven_by_its_capabilities(fixed_engine):
    assert engine_names() == ["fixed", *BUILTIN]
    engine = make_rollout_engine("fixed", token=7)
    assert isinstance(engine, FixedEngine) and engine_capabilities("fixed") is FixedEngine.capabilities
    manager = RolloutManager(engine, lambda: iter([[("w", torch.zeros(2))]]))
    out = manager.generate([[5, 6], [4]], SamplingParams(n=2))
    assert out.responses.tolist() == [[7, 2]] * 4 and out.prompt_len == 2
    manager.sleep(), manager.wake_up()       # no sleep declared: the engine is never told
    manager.shutdown()                       # needs_shutdown: it is
    assert engine.calls == [("update", ["w"]), ("shutdown",)]
    with pytest.raises(ValueError, match=r"FixedEngine takes weight syncs \['full'\], not 'delta': pass "
                                         "--weight_sync full"):
        RolloutManager(engine, lambda: iter([]), weight_sync="delta")


def test_registration_is_checked(fixed_engine):
    with pytest.raises(ValueError, match="'fixed' is already registered"):
        register_engine("fixed", FixedEngine, FixedEngine.capabilities)
    with pytest.raises(TypeError, match="needs an EngineCapabilities"):
        register_engine("loose", FixedEngine, {"weight_syncs": {"full"}})
    # A factory whose engines say otherwise than the registration would mislead every caller.
    ROLLOUT_ENGINES.pop("fixed")
    register_engine("fixed", FixedEngine, dataclasses.replace(FixedEngine.capabilities, sleep=True))
    with pytest.raises(TypeError, match="exposes capabilities"):
        make_rollout_engine("fixed", token=7)


def test_an_engine_without_capabilities_is_refused_with_what_to_add():
    class Bare:
        def generate(self, prompt_token_ids, params, seeds=None): ...

    with pytest.raises(TypeError, match=r"Bare declares no capabilities: give the class `capabilities = "
                                        r"EngineCapabilities\(...\)`"):
        RolloutManager(Bare())


def test_hf_engine_for_decodes_micro_batches_of_samples():
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, seed=1).eval()
    engine = hf_engine_for(model, tokenizer, micro_batch_size=3)
    assert engine.micro_batch_size == 3 and engine.eos_token_ids == [tokenizer.eos_token_id]
    assert engine.pad_token_id == tokenizer.pad_token_id and engine.model is model
    assert hf_engine_for(model, tokenizer, [5, 6]).eos_token_ids == [5, 6]
    prompts, params = [tokenizer.encode("12+"), tokenizer.encode("a")], SamplingParams(max_new_tokens=5, n=2)
    whole = hf_engine_for(model, tokenizer).generate(prompts, params, seeds=[1, 2])
    chunked = engine.generate(prompts, params, seeds=[1, 2])   # 4 samples in chunks of 3
    assert torch.equal(whole.sequences, chunked.sequences)


# ================================================================== the run's engine, by capability
def run_config(**flags) -> PPORunConfig:
    values = dict(pretrain="m", prompt_data="p.jsonl", remote_rm_url="math", advantage_estimator="group_norm",
                  n_samples_per_prompt=4, rollout_batch_size=8, train_batch_size=32, **flags)
    return PPORunConfig.from_namespace(PPORunConfig.build_parser("train_ppo").parse_args(to_flags(values)))


def test_each_engine_with_its_own_weights_has_a_builder_from_the_run_config():
    assert sorted(ENGINE_BUILDERS) == [n for n in BUILTIN if not engine_capabilities(n).shares_live_weights]
    # The trainer builds an engine over its live actor itself.
    assert build_rollout_engine(run_config(rollout_engine="hf"), tokenizer=None, seed=0) is None


def test_an_explorer_thread_is_refused_beside_an_engine_that_takes_the_process():
    check_engine_roles(run_config(rollout_engine="hf", sync_offset=1))
    check_engine_roles(run_config(rollout_engine="vllm", sync_offset=1, explorer_ranks=1))
    check_engine_roles(run_config(rollout_engine="vllm"))
    with pytest.raises(ConfigError, match=r"--sync_offset 1 without --explorer_ranks .* cannot be combined with "
                                          r"--rollout_engine vllm: a process holds one.*--explorer_ranks N"):
        check_engine_roles(run_config(rollout_engine="vllm", sync_offset=1))


def test_the_doctor_recommends_the_engines_memory_options():
    assert "--micro_rollout_batch_size (now 16)" in recommendations(
        "generate", run_config(rollout_engine="hf", micro_rollout_batch_size=16))
    assert "--vllm_kv_cache_gb (now 0.5) or --vllm_gpu_memory_utilization (now 0.5)" in recommendations(
        "generate", run_config(rollout_engine="vllm", vllm_kv_cache_gb=0.5))


# ======================================================================== no branch on a name
def engine_name_comparisons(source: str, names) -> list[str]:
    """Comparisons of something named like an engine (`rollout_engine`, `engine_name`, ...) with
    a registered engine's name written out (`== "vllm"`, `in ("hf", "vllm")`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        literal = [op for op in operands if any(isinstance(c, ast.Constant) and c.value in names for c in ast.walk(op))]
        others = [op for op in operands if op not in literal]
        if literal and any("engine" in ast.unparse(op).lower() for op in others):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_branches_on_an_engine_name():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found = engine_name_comparisons(path.read_text(), set(engine_names()))
        if found:
            offenders[path.relative_to(PACKAGE.parent).as_posix()] = found
    assert offenders == {}, "ask the engine's capabilities (lightrft.rollout.engine_capabilities) instead"


def test_planted_engine_name_branches_are_found():
    source = '''
if config.rollout.rollout_engine == "vllm":
    pass
if "hf" != args.rollout_engine:
    pass
x = engine_name in ("hf", "other")
y = checkpoint.kind == "hf"
z = engine_capabilities(name).shares_live_weights
'''
    assert engine_name_comparisons(source, {"hf", "vllm"}) == [
        "line 2: config.rollout.rollout_engine == 'vllm'", "line 4: 'hf' != args.rollout_engine",
        "line 6: engine_name in ('hf', 'other')"]


class HFEngineCalls(ast.NodeVisitor):
    """`HFEngine(...)` calls, each with the name of the function it is in (None: module level)."""

    def __init__(self):
        self.function, self.calls = None, []

    def visit_FunctionDef(self, node):
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node):
        if getattr(node.func, "id", getattr(node.func, "attr", None)) == "HFEngine":
            self.calls.append(self.function)
        self.generic_visit(node)


def test_hf_engines_are_built_in_one_place():
    """`HFEngine(...)` is called by `hf_engine_for` alone: one meaning of its micro-batch."""
    calls = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        visitor = HFEngineCalls()
        visitor.visit(ast.parse(path.read_text()))
        calls |= {(path.relative_to(PACKAGE.parent).as_posix(), function) for function in visitor.calls}
    assert calls == {("lightrft/rollout/hf_engine.py", "hf_engine_for")}
