"""Reward files in the OpenRLHF convention: `reward_func(queries, prompts, labels)` returning a
tensor, a list, or a dict with "rewards"."""

import textwrap

import pytest
import torch

from lightrft.rewards import RewardFuncProcess, RewardSourceError, load_reward_func, make_reward_source

QUERIES = ["Q: 1+1? A: 2", "Q: 2+2? A: 5", "Q: 3+3? A: 6"]
PROMPTS = ["Q: 1+1? A:", "Q: 2+2? A:", "Q: 3+3? A:"]
LABELS = ["2", "4", "6"]

# Written the way OpenRLHF reward files are: module-level imports, a tensor out.
TENSOR_FILE = """
import torch

def reward_func(queries, prompts, labels):
    responses = [q[len(p):].strip() for q, p in zip(queries, prompts)]
    return torch.tensor([1.0 if r == l else -1.0 for r, l in zip(responses, labels)])
"""

DICT_FILE = """
import torch

def reward_func(queries, prompts, labels):
    lengths = torch.tensor([float(len(q)) for q in queries])
    rewards = lengths / 10
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"query_length": lengths}}
"""


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_tensor_return(tmp_path):
    source = load_reward_func(write(tmp_path, "reward.py", TENSOR_FILE))
    rewards = source(QUERIES, PROMPTS, LABELS)
    assert rewards.dtype == torch.float32
    assert rewards.tolist() == [1.0, -1.0, 1.0]


def test_dict_return_keeps_extra_logs(tmp_path):
    source = load_reward_func(write(tmp_path, "reward.py", DICT_FILE))
    # len("Q: 1+1? A: 2") = 12 and so on
    torch.testing.assert_close(source(QUERIES, PROMPTS, LABELS), torch.tensor([1.2, 1.2, 1.2]))
    result = source.score(QUERIES, PROMPTS, LABELS)
    assert result.valid.all()
    assert result.extra_logs["query_length"].tolist() == [12.0, 12.0, 12.0]


def test_list_return_and_make_reward_source(tmp_path):
    path = write(tmp_path, "list_reward.py", """
        def reward_func(queries, prompts, labels):
            return [0.5 * i for i in range(len(queries))]
    """)
    assert load_reward_func(path)(QUERIES, PROMPTS, LABELS).tolist() == [0.0, 0.5, 1.0]
    source = make_reward_source(str(path), timeout=5.0, on_failure="drop")  # a worker process, see test_func_process
    try:
        assert isinstance(source, RewardFuncProcess) and (source.timeout, source.on_failure) == (5.0, "drop")
        assert source(QUERIES, PROMPTS, LABELS).rewards.tolist() == [0.0, 0.5, 1.0]
    finally:
        source.close()


def test_two_files_with_the_same_name_stay_separate(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    body = "def reward_func(q, p, l):\n    return [{}] * len(q)\n"
    first = load_reward_func(write(tmp_path / "a", "reward.py", body.format(1.0)))
    second = load_reward_func(write(tmp_path / "b", "reward.py", body.format(2.0)))
    assert first(QUERIES, PROMPTS, LABELS).tolist() == [1.0] * 3
    assert second(QUERIES, PROMPTS, LABELS).tolist() == [2.0] * 3


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.py not found \(--remote_rm_url\)"):
        load_reward_func(tmp_path / "nope.py")


@pytest.mark.parametrize("body, words", [
    ("def other(q, p, l):\n    return []\n", "defines no function reward_func"),
    ("reward_func = 3\n", "defines no function reward_func"),
    ("import not_a_module_anywhere\n", "importing reward file .* failed: ModuleNotFoundError"),
])
def test_broken_files_name_the_file(tmp_path, body, words):
    path = write(tmp_path, "broken.py", body)
    with pytest.raises(RewardSourceError, match=words) as info:
        load_reward_func(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("returned, words", [
    ("[1.0, 2.0]", r"expected 3 rewards \(one per query\), got shape \(2,\)"),
    ("[1.0, float('nan'), float('inf')]", r"rewards at positions \[1, 2\] are NaN or infinite"),
    ("['good', 'bad', 'ok']", "rewards must be numbers"),
    ("[1.0, None, 2.0]", "rewards must be numbers"),
    ("{'scores': [1.0, 2.0, 3.0]}", "returned a dict without a 'rewards' entry"),
    ("{'rewards': [1.0, 2.0, 3.0], 'extra_logs': {'n': [1.0]}}", r"extra_logs\['n'\].*expected 3 rewards"),
    ("1 / 0", "raised ZeroDivisionError"),
])
def test_bad_returns_name_the_file(tmp_path, returned, words):
    path = write(tmp_path, "bad_return.py", f"def reward_func(queries, prompts, labels):\n    return {returned}\n")
    source = load_reward_func(path)
    with pytest.raises(RewardSourceError, match=words) as info:
        source(QUERIES, PROMPTS, LABELS)
    assert str(path) in str(info.value)


def test_column_tensor_is_accepted(tmp_path):
    path = write(tmp_path, "column.py", "import torch\ndef reward_func(q, p, l):\n    return torch.ones(len(q), 1)\n")
    assert load_reward_func(path)(QUERIES, PROMPTS, LABELS).shape == (3,)
