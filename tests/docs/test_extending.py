"""The code blocks of docs/extending.md do what the page says, checked on hand-computed inputs.

The blocks also run together in a short training job: tests/docs/test_doc_commands.py runs the
page's `# cpu-test` block and checks what the callback logged. The rollout engine's block trains
here, in train_ppo's wiring run in this process.
"""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, RobertaForCausalLM

import lightrft.models.families.roberta as roberta_family
from lightrft.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, get_advantage_estimator
from lightrft.rewards import make_reward_source
from lightrft.rollout import (ROLLOUT_ENGINES, HFEngine, RolloutManager, SamplingParams, engine_capabilities,
                              make_rollout_engine)
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from lightrft.trainer import PPOTrainer, TrainerCallback
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm
from tests.conftest import load_file_module
from tests.docs.test_doc_commands import doc_test_files
from tests.models.test_families import tiny_roberta
from tests.trainer.ppo_harness import make_task, run

PAGE = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


@pytest.fixture(scope="module")
def doc_files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("extending")
    files = doc_test_files(PAGE)
    assert {"my_reward.py", "reward_log.py", "curriculum.py", "minmax_estimator.py", "train_extended.py",
            "copy_engine.py"} <= set(files)
    for name, source in files.items():
        (folder / name).write_text(source)
    return folder


def import_file(path: Path, name: str):
    return load_file_module(path, name)


def test_reward_file_scores_as_documented(doc_files):
    # The same loader --remote_rm_url uses for a .py path.
    source = make_reward_source(str(doc_files / "my_reward.py"))
    queries = ["3+4=7", "3+4=8", "3+4=6", "3+4=9", "3+4=seven", "10+5= 15 ", "10+5="]
    prompts = ["3+4="] * 5 + ["10+5="] * 2
    labels = ["7"] * 5 + ["15"] * 2
    rewards = source(queries, prompts, labels)
    # exact, off by one (both sides), off by two, no number, exact with spaces, empty response
    assert rewards.tolist() == [1.0, 0.5, 0.5, 0.0, 0.0, 1.0, 0.0]
    assert rewards.dtype == torch.float32


@pytest.fixture
def minmax(doc_files):
    """Registers the page's estimator for one test, and removes it afterwards."""
    import_file(doc_files / "minmax_estimator.py", "doc_minmax_estimator")
    try:
        yield get_advantage_estimator("group_minmax")
    finally:
        ADVANTAGE_ESTIMATORS.pop("group_minmax", None)


def test_new_estimator_matches_its_formula(minmax):
    assert minmax.group and not minmax.needs_critic and not minmax.normalize_globally
    # Two prompts, G = 4. Group 1: scores 3, 1, 0, 0 -> mean 1, range 3 -> (2, 0, -1, -1) / 3.
    # Group 2: all equal -> range 0 -> advantages 0 (eps keeps it finite).
    scores = torch.tensor([3.0, 1.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    mask = torch.ones(8, 3)
    mask[0, 2] = 0  # a shorter response: its padding position stays 0
    out = minmax.fn(AdvantageInputs(action_mask=mask, scores=scores, group_size=4))
    expected_first_group = torch.tensor([2.0, 0.0, -1.0, -1.0]) / (3.0 + 1e-6)
    assert torch.allclose(out.advantages[:4, 0], expected_first_group, atol=1e-6)
    assert torch.equal(out.advantages[4:], torch.zeros(4, 3))
    assert out.advantages[0, 2] == 0 and torch.allclose(out.advantages[0, :2], expected_first_group[0].expand(2))
    assert torch.equal(out.returns, out.advantages)
    # Invariance the page promises: the advantages do not change when rewards are scaled and shifted.
    scaled = minmax.fn(AdvantageInputs(action_mask=mask, scores=10 * scores - 4, group_size=4))
    assert torch.allclose(scaled.advantages, out.advantages, atol=1e-5)


def test_new_estimator_needs_groups(minmax):
    from lightrft.algorithms.advantages import validate_group_size

    with pytest.raises(ValueError, match="--n_samples_per_prompt >= 2"):
        validate_group_size("group_minmax", 1)


@pytest.fixture
def copy_engine(doc_files):
    """Registers the page's engine as "hf_copy" for one test, and removes it afterwards."""
    module = import_file(doc_files / "copy_engine.py", "doc_copy_engine")
    try:
        yield module.CopyEngine
    finally:
        ROLLOUT_ENGINES.pop("hf_copy", None)


def test_copy_engine_is_built_by_name_and_synced_as_its_capabilities_say(copy_engine):
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, seed=0).eval()
    actor = torch.nn.Module()       # the ActorLanguage layout: the Hugging Face model under `.model`
    actor.model = model
    engine = make_rollout_engine("hf_copy", model=model, tokenizer=tokenizer, micro_batch_size=4)
    assert isinstance(engine, copy_engine) and engine.capabilities == engine_capabilities("hf_copy")
    assert not engine.capabilities.shares_live_weights and engine.decoder.model is not model

    manager = RolloutManager.for_actor(engine, DeepspeedStrategy(StrategyConfig()), actor)
    assert manager.stale and manager.sent is None           # "full": synced before the first generate
    with torch.no_grad():
        for param in model.parameters():                    # the trainer moves its weights
            param.add_(0.05 * torch.randn_like(param))
    manager.mark_stale()
    prompts, params = [tokenizer.encode("1+2="), tokenizer.encode("ab")], SamplingParams(max_new_tokens=6, n=2)
    out = manager.generate(prompts, params, seeds=[3, 4])
    live = HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id).generate(prompts, params, seeds=[3, 4])
    assert manager.syncs == 1 and torch.equal(out.sequences, live.sequences)
    assert torch.allclose(out.rollout_log_probs, live.rollout_log_probs, atol=1e-6)
    manager.sleep(), manager.wake_up(), manager.shutdown()   # nothing declared: none reaches the engine
    assert manager.generate(prompts, params, seeds=[3, 4]).sequences.equal(live.sequences) and manager.syncs == 1


class SyncCount(TrainerCallback):
    def __init__(self):
        self.syncs = []

    def on_rollout_end(self, trainer, experiences):
        self.syncs.append(trainer.rollout.syncs)


def test_a_ppo_run_trains_with_the_engine_selected_by_name(copy_engine, tmp_path):
    class CopyEngineTrainer(PPOTrainer):
        """The page's snippet inside train_ppo's wiring: the engine built by name replaces the default."""

        def __init__(self, strategy, actor, *args, tokenizer=None, rollout_engine=None, **kwargs):
            engine = make_rollout_engine("hf_copy", model=strategy.unwrap_model(actor).model, tokenizer=tokenizer,
                                         micro_batch_size=16)
            super().__init__(strategy, actor, *args, tokenizer=tokenizer, rollout_engine=engine, **kwargs)

    counter = SyncCount()
    logs, _ = run(make_task(tmp_path), tmp_path / "out", trainer_cls=CopyEngineTrainer, callbacks=[counter])
    # One sync before each step's rollout (the first from the pretrained weights), and the engine
    # samples from the trained weights: the engine check's gap stays at float32 rounding.
    assert counter.syncs == [1, 2]
    assert logs["rollout/engine_logprob_gap_mean"] < 1e-5


def test_the_model_family_on_the_page_is_the_shipped_file_and_trains(tmp_path):
    """The page's worked family is lightrft/models/families/roberta.py, word for word; a packed
    GRPO step of train_ppo on a RoBERTa decoder folder is on-policy and its rollouts are the
    model's (positions from pad_token_id + 1 in the engine as in the trainer)."""
    source = Path(roberta_family.__file__).read_text()
    assert f"```python\n{source}```" in PAGE.read_text()

    task = make_task(tmp_path)
    tokenizer = build_char_tokenizer()
    tiny_roberta(tokenizer).save_pretrained(tmp_path / "roberta")
    tokenizer.save_pretrained(tmp_path / "roberta")
    task["model"] = tmp_path / "roberta"
    logs, _ = run(task, tmp_path / "out", packing_samples=True, max_steps=1)
    for key in ("train/ratio_max", "train/ratio_min"):
        assert logs[key] == pytest.approx(1.0, abs=1e-5)
    assert logs["rollout/engine_logprob_gap_max"] < 1e-5
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    assert type(saved) is RobertaForCausalLM and saved.config.is_decoder
