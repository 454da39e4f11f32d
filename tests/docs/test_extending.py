"""The code blocks of docs/extending.md do what the page says, checked on hand-computed inputs.

The blocks also run together in a short training job: tests/docs/test_doc_commands.py runs the
page's `# cpu-test` block and checks what the callback logged.
"""

from pathlib import Path

import pytest
import torch

from lightrft.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, get_advantage_estimator
from lightrft.rewards import make_reward_source
from tests.conftest import load_file_module
from tests.docs.test_doc_commands import doc_test_files

PAGE = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


@pytest.fixture(scope="module")
def doc_files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("extending")
    files = doc_test_files(PAGE)
    assert {"my_reward.py", "reward_log.py", "curriculum.py", "minmax_estimator.py", "train_extended.py"} <= set(files)
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
