"""Rule rewards: final-answer extraction and comparison on a table of cases, the format rule,
the builtin-name registry and `make_reward_source` dispatch."""

import importlib.util
import sys
import threading

import pytest
import torch

from lightrft.rewards import (
    RULE_REWARDS,
    RuleRewardSource,
    answers_match,
    extract_final_answer,
    format_reward,
    get_rule_reward,
    make_reward_source,
    math_answer_reward,
    register_rule_reward,
)
from lightrft.rewards import rules
from lightrft.rewards.rules import normalize_answer

HAS_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None


@pytest.mark.parametrize("text, answer", [
    ("so the total is \\boxed{72}.", "72"),
    ("first \\boxed{3}, corrected: \\boxed{\\frac{4}{5}}", "\\frac{4}{5}"),  # last box, nested braces
    ("\\fbox{12}", "12"),
    ("it is \\boxed 5.", "5"),
    ("48 + 24 = 72 clips.\n#### 72", "72"),
    ("#### 1,000\n", "1,000"),
    ("The answer is 42.", "42"),
    ("So the answer is: 3.5. Done", "3.5"),
    ("Answer: -3\nbecause ...", "-3"),
    ("the answer is 1 and then the answer is 2", "2"),
    ("I computed 3, then 7/2 and 12,345", "12,345"),
    ("no digits here", None),
])
def test_extract_final_answer(text, answer):
    assert extract_final_answer(text) == answer


@pytest.mark.parametrize("raw, normal", [
    ("$\\dfrac{1}{2}$", "\\frac{1}{2}"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("90^\\circ", "90"),
    ("50\\%", "50"),
    ("\\$18.", "18"),
    ("x = 5", "5"),
    ("42 apples", "42"),
    ("1,234,567", "1234567"),
    ("\\text{(B)}", "(B)"),
])
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


# (response, label, reward): decided by string or number equality, so math-verify agrees.
MATH_CASES = [
    ("The sum is \\boxed{72}.", "72", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("so \\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("\\boxed{ 1,000 }", "1000", 1.0),
    ("\\boxed{-\\frac{1}{3}}", "-1/3", 1.0),
    ("\\boxed{2.50}", "2.5", 1.0),
    ("The answer is 7/2", "3.5", 1.0),
    ("first \\boxed{3} then corrected \\boxed{4}", "4", 1.0),
    ("\\boxed{4}", "5", 0.0),
    ("48 + 24 = 72 clips.\n#### 72", "72", 1.0),
    ("#### 72", "She sold 48 + 24 = 72.\n#### 72", 1.0),  # GSM8K-style label
    ("The answer is 42 apples.", "42", 1.0),
    ("Answer: -3", "-3", 1.0),
    ("The answer is x = 5", "5", 1.0),
    ("I computed 3 and then 7", "7", 1.0),
    ("I computed 3 and then 7", "3", 0.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{\\$18}", "18", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{\\text{(B)}}", "(B)", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{3}", 3, 1.0),  # a numeric label
    ("\\boxed{3}", None, 0.0),  # no label, no reward
    ("no idea", "3", 0.0),
    ("\\boxed{}", "3", 0.0),
    ("\\boxed{1/0}", "1", 0.0),
]


def test_math_answer_reward_table():
    responses, labels, expected = zip(*MATH_CASES)
    rewards = math_answer_reward(list(responses), list(labels))
    assert rewards.dtype == torch.float32 and rewards.shape == (len(MATH_CASES),)
    mismatches = [case for case, got in zip(MATH_CASES, rewards.tolist()) if got != case[2]]
    assert mismatches == []


@pytest.mark.parametrize("response, label, expected, use_math_verify", [
    (r, lab, bool(e), flag) for r, lab, e in MATH_CASES[:8] for flag in (False, True)])
def test_fallback_and_math_verify_agree_on_the_table(response, label, expected, use_math_verify):
    assert answers_match(response, label, use_math_verify=use_math_verify) is expected


@pytest.mark.parametrize("response, label", [("\\boxed{x+1}", "1+x"), ("\\boxed{\\sqrt{4}}", "2")])
def test_symbolic_equality_needs_math_verify(response, label):
    assert answers_match(response, label, use_math_verify=False) is False
    assert answers_match(response, label) is HAS_MATH_VERIFY


def test_repeated_answers_score_as_when_first_seen():
    """Scores are cached by normalised answer: a batch that repeats the table in a shuffled order
    (as a GRPO group repeats its label) scores exactly as the table says, with cold and warm caches."""
    cases = MATH_CASES * 3
    order = torch.randperm(len(cases), generator=torch.Generator().manual_seed(0)).tolist()
    responses, labels, expected = zip(*(cases[i] for i in order))
    rules.normalize_answer.cache_clear()
    rules._normalized_answers_match.cache_clear()
    cold = math_answer_reward(list(responses), list(labels))
    warm = math_answer_reward(list(responses), list(labels))
    assert cold.tolist() == warm.tolist() == [float(e) for e in expected]
    assert rules._normalized_answers_match.cache_info().hits > 0


def test_math_verify_is_looked_up_once(monkeypatch):
    """Without math-verify, a mismatch used to retry the import, searching the module path for
    every wrong answer. Count the lookups an import system hook sees."""
    lookups = []

    class Counter:
        def find_spec(self, name, path=None, target=None):
            if name == "math_verify":
                lookups.append(name)
            return None

    monkeypatch.setattr(sys, "meta_path", [Counter(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, "math_verify", raising=False)
    rules._math_verify.cache_clear()
    rules._normalized_answers_match.cache_clear()
    try:
        math_answer_reward([f"\\boxed{{{i} + x}}" for i in range(50)], ["y"] * 50)
        assert len(lookups) == 1
    finally:
        rules._math_verify.cache_clear()


def test_math_answer_reward_needs_one_label_per_response():
    with pytest.raises(ValueError, match="2 responses but 1 labels.*--label_key"):
        math_answer_reward(["1", "2"], ["1"])


@pytest.mark.parametrize("response, reward", [
    ("<think>2+2 is 4</think><answer>4</answer>", 1.0),
    ("\n<think>line one\nline two</think>\n<answer>\n4\n</answer>\n", 1.0),
    ("<answer>4</answer>", 0.0),
    ("<think>x</think><answer>4</answer> and more", 0.0),
    ("<think>x<answer>4</answer>", 0.0),
])
def test_format_reward_default_pattern(response, reward):
    assert format_reward([response]).tolist() == [reward]


def test_format_reward_custom_pattern_through_make_reward_source():
    source = make_reward_source("format", pattern=r"\d+")
    assert source(["Q: 12", "Q: ab"], ["Q: ", "Q: "], [None, None]).tolist() == [1.0, 0.0]


def test_rule_source_scores_the_response_not_the_prompt():
    """The prompt's "3" and "4" are not the answer: the response part after the prompt is used."""
    source = make_reward_source("math")
    assert isinstance(source, RuleRewardSource)
    prompts = ["What is 3+4? Put the answer in a box.", "What is 3+4?"]
    queries = [prompts[0] + " It is \\boxed{7}.", prompts[1] + " I do not know."]
    assert source(queries, prompts, ["7", "4"]).tolist() == [1.0, 0.0]


def test_registry():
    assert {"math", "format"} <= set(RULE_REWARDS)
    assert get_rule_reward("math") is math_answer_reward
    with pytest.raises(ValueError, match=r"unknown rule reward 'gsm'.*'format', 'math'"):
        get_rule_reward("gsm")
    with pytest.raises(ValueError, match="already registered"):
        register_rule_reward("math")(lambda responses, labels: torch.zeros(len(responses)))


def test_a_registered_rule_is_a_builtin_name():
    name = "test_length_rule"
    if name not in RULE_REWARDS:
        register_rule_reward(name)(lambda responses, labels: torch.tensor([float(len(r)) for r in responses]))
    try:
        assert make_reward_source(name)(["pab", "pabc"], ["p", "p"], [None, None]).tolist() == [2.0, 3.0]
    finally:
        RULE_REWARDS.pop(name)


def test_unknown_spec_lists_the_options():
    with pytest.raises(ValueError, match=r"unknown reward source 'gsm8k'.*http\(s\)://.*\.py.*format, math"):
        make_reward_source("gsm8k")
    with pytest.raises(FileNotFoundError, match="missing_reward.py"):
        make_reward_source("missing_reward.py")


def test_scoring_works_off_the_main_thread():
    """Reward scoring may run in a worker thread, where math-verify's SIGALRM timeout is not
    allowed; the result must be the same as on the main thread."""
    responses, labels, expected = zip(*MATH_CASES)
    results = {}
    worker = threading.Thread(target=lambda: results.update(r=math_answer_reward(list(responses), list(labels))))
    worker.start()
    worker.join(timeout=60)
    assert results["r"].tolist() == list(expected)
