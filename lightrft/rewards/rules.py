"""Rule rewards: scores computed from the response text alone, no model.

- `math_answer_reward`: 1.0 when the response's final answer equals the label, else 0.0.
- `format_reward`: 1.0 when the whole response matches a regular expression, else 0.0.

Both are registered by name (`math`, `format`) so `--remote_rm_url math` selects one; register
more with `@register_rule_reward("name")`. A rule function takes `(responses, labels)` and returns
a (B,) float32 tensor.
"""

import functools
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

RuleFn = Callable[[Sequence[str], Sequence[Any]], torch.Tensor]
RULE_REWARDS: dict[str, RuleFn] = {}


def register_rule_reward(name: str):
    """Registers `fn(responses, labels) -> (B,) float32 tensor` under `name`."""
    def decorator(fn: RuleFn) -> RuleFn:
        if name in RULE_REWARDS:
            raise ValueError(f"rule reward {name!r} is already registered")
        RULE_REWARDS[name] = fn
        return fn
    return decorator


def get_rule_reward(name: str) -> RuleFn:
    if name not in RULE_REWARDS:
        raise ValueError(f"unknown rule reward {name!r}; builtin names: {sorted(RULE_REWARDS)}")
    return RULE_REWARDS[name]


# ------------------------------------------------------------------------------ answer extraction
_ANSWER_CUE = re.compile(r"answer\s*(?:is|:)\s*:?\s*", re.IGNORECASE)
_UP_TO_SENTENCE_END = re.compile(r"(.+?)\s*(?:\.\s|\.$|\n|$)")
_HASHES = re.compile(r"####\s*(.+?)\s*$", re.MULTILINE)
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; `\\boxed 5` gives "5"."""
    match = None
    for match in re.finditer(r"\\(?:boxed|fbox)\s*", text):
        pass
    if match is None:
        return None
    rest = text[match.end():]
    if not rest.startswith("{"):
        token = rest.split(maxsplit=1)
        return token[0].rstrip(".$") if token else None
    depth = 0
    for i, char in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return rest[1:i]
    return None


def extract_final_answer(text: str) -> str | None:
    """The final answer of a response, tried in this order:

    1. the last `\\boxed{...}`;
    2. the text after the last `####` (GSM8K style);
    3. the text after the last "answer is" / "answer:" up to the end of the sentence or line;
    4. the last number in the text.

    Returns None when none is found."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1]
    cues = list(_ANSWER_CUE.finditer(text))
    stated = _UP_TO_SENTENCE_END.match(text, cues[-1].end()) if cues else None
    if stated:
        return stated.group(1)
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


# ---------------------------------------------------------------------------- answer comparison
_DOLLARS = re.compile(r"^\$+|\$+$")
_INLINE_MATH = re.compile(r"^\\\(|\\\)$")
_TEXT = re.compile(r"\\text\{([^{}]*)\}")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)\b")
_SPACING = re.compile(r"\\[,!;: ]")
_DFRAC = re.compile(r"\\[dt]frac")
_DEGREES = re.compile(r"\^\{?\\circ\}?")
_VARIABLE = re.compile(r"^[a-zA-Z]\s*=\s*")
_NUMBER_WITH_UNIT = re.compile(r"(-?[\d,]*\.?\d+(?:/\d+)?)\s*(?:[a-zA-Z]+\s*)+")
_THOUSANDS = re.compile(r"(\d),(\d{3})(?!\d)")
_SPACE = re.compile(r"\s+")
_INTEGER = re.compile(r"-?\d+")


@functools.lru_cache(maxsize=1 << 16)
def normalize_answer(answer: str) -> str:
    """Removes what does not change a final answer's value: math delimiters, spacing commands,
    `\\left`/`\\right`, `\\text{}` wrappers, degree and percent signs, a dollar sign, thousands
    separators, a leading `x =`, a trailing period, and unit words after a number. Results are
    cached: a GRPO batch repeats each label G times and most short answers many times."""
    s = answer.strip()
    s = _DOLLARS.sub("", s).strip()
    s = _INLINE_MATH.sub("", s).strip()
    s = _TEXT.sub(r"\1", s)
    s = _LEFT_RIGHT.sub("", s)
    s = _SPACING.sub("", s)
    s = _DFRAC.sub(r"\\frac", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "")
    s = s.rstrip(".").strip()
    s = _VARIABLE.sub("", s)
    number_with_unit = _NUMBER_WITH_UNIT.fullmatch(s)
    if number_with_unit:
        s = number_with_unit.group(1)
    while _THOUSANDS.search(s):
        s = _THOUSANDS.sub(r"\1\2", s)
    return _SPACE.sub("", s)


def _as_number(s: str) -> Fraction | float | None:
    """Exact value of an integer, decimal, `a/b` or `\\frac{a}{b}` string; None otherwise."""
    frac = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s) or re.fullmatch(r"(-?)\\frac(\d)(\d)", s)
    if frac:
        sign, num, den = frac.groups()
        if int(den) == 0:
            return None
        value = Fraction(int(num), int(den))
        return -value if sign else value
    try:
        return Fraction(s)  # integers, decimals, "a/b"
    except (ValueError, ZeroDivisionError):
        return None


def _fallback_equal(pred: str, gold: str) -> bool:
    """Normalised string equality, or equal numbers (exact for rationals, 1e-6 relative else)."""
    if pred == gold:
        return True
    a, b = _as_number(pred), _as_number(gold)
    if a is None or b is None:
        return False
    return a == b or math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)


@functools.cache
def _math_verify():
    """math-verify's `(parse, verify)`, or None when it is not installed. Looked up once: a failed
    import searches the whole module path again on every attempt."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    return parse, verify


def _math_verify_equal(pred: str, gold: str) -> bool | None:
    """math-verify's symbolic comparison when the package is installed; None when it is not
    installed or could not parse one of the answers. Its timeouts rely on SIGALRM, which only the
    main thread may use, so other threads run it without a timeout."""
    functions = _math_verify()
    if functions is None:
        return None
    parse, verify = functions
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold_parsed = parse(f"${gold}$", parsing_timeout=timeout)
        pred_parsed = parse(f"${pred}$", parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return None
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:
        return None


@functools.lru_cache(maxsize=1 << 16)
def _normalized_answers_match(pred: str, gold: str, use_math_verify: bool) -> bool:
    """`answers_match` on two normalised final answers; cached, since both repeat across a batch.
    Two different integers never match, so they skip math-verify's (slow) parse."""
    if _fallback_equal(pred, gold):
        return True
    if not use_math_verify or (_INTEGER.fullmatch(pred) and _INTEGER.fullmatch(gold)):
        return False
    return bool(_math_verify_equal(pred, gold))


def answers_match(response: str, label: Any, use_math_verify: bool = True) -> bool:
    """Whether the final answer of `response` equals `label`.

    The label may be a bare answer ("72", 72, "\\frac{1}{2}") or a worked solution ending in
    `#### 72` or `\\boxed{72}`, whose final answer is then used. Both answers are normalised
    (`normalize_answer`). Equal strings, or equal numbers (integers, decimals, `a/b`,
    `\\frac{a}{b}`), match. What that leaves undecided (`x+1` against `1+x`, sets, radicals) goes
    to math-verify's symbolic comparison when it is installed (`pip install lightrft[math]`) and
    counts as a mismatch otherwise (or with `use_math_verify=False`)."""
    if label is None:
        return False
    label_text = str(label)
    gold = extract_final_answer(label_text) if ("####" in label_text or "\\boxed" in label_text) else label_text
    pred = extract_final_answer(response)
    if pred is None or gold is None:
        return False
    pred, gold = normalize_answer(pred), normalize_answer(gold)
    if not pred or not gold:
        return False
    return _normalized_answers_match(pred, gold, bool(use_math_verify))


@register_rule_reward("math")
def math_answer_reward(responses: Sequence[str], labels: Sequence[Any]) -> torch.Tensor:
    """1.0 where the response's final answer equals the label, else 0.0. Shape: (B,) float32."""
    _check_lengths(responses, labels)
    return torch.tensor([float(answers_match(r, lab)) for r, lab in zip(responses, labels)], dtype=torch.float32)


@register_rule_reward("exact")
def exact_answer_reward(responses: Sequence[str], labels: Sequence[Any]) -> torch.Tensor:
    """1.0 where the response, stripped of surrounding whitespace, is exactly the label's text
    (classification answers: a letter, a word), else 0.0. Shape: (B,) float32."""
    _check_lengths(responses, labels)
    return torch.tensor([float(r.strip() == str(lab).strip()) for r, lab in zip(responses, labels)],
                        dtype=torch.float32)


# ----------------------------------------------------------------------------------------- format
THINK_ANSWER_PATTERN = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"


@register_rule_reward("format")
def format_reward(responses: Sequence[str], labels: Sequence[Any] | None = None,
                  pattern: str = THINK_ANSWER_PATTERN) -> torch.Tensor:
    """1.0 where the whole response matches `pattern` (`re.fullmatch`, `.` matching newlines),
    else 0.0. The default asks for `<think>...</think>` followed by `<answer>...</answer>`.
    Labels are not used. Shape: (B,) float32."""
    regex = re.compile(pattern, re.DOTALL)
    return torch.tensor([float(regex.fullmatch(r) is not None) for r in responses], dtype=torch.float32)


def _check_lengths(responses: Sequence[str], labels: Sequence[Any]) -> None:
    if len(responses) != len(labels):
        raise ValueError(f"got {len(responses)} responses but {len(labels)} labels; pass one label per response "
                         "(--label_key names the dataset column)")


# ------------------------------------------------------------------------------ as a RewardSource
@dataclass
class RuleRewardSource:
    """A rule reward behind the `RewardSource` interface.

    The response of each sample is its query with the prompt removed from the front (queries are
    prompt + response); a query that does not start with its prompt is scored whole."""

    name: str
    fn: RuleFn

    def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any],
                 truncated: Sequence[bool] | None = None) -> torch.Tensor:
        # A cut response is scored like any other; --mask_truncated_samples or DAPO's overlong
        # shaping decide what truncation costs.
        responses = [q[len(p):] if p and q.startswith(p) else q for q, p in zip(queries, prompts)]
        return self.fn(responses, labels)
