"""LLM judges: a language model reads a rubric filled with a sample, and its answer becomes the reward.

`--remote_rm_url judge:TARGET` names a judge; TARGET is either

- a Hugging Face model folder, loaded on this rank (the rank's GPU in bfloat16, else the CPU in
  float32) and decoded greedily by `HFEngine` in batches of `--judge_batch_size` (left padding,
  position ids that follow it) — `LocalJudge`; or
- the URL of an OpenAI-compatible server (`lightrft.cli.serve`, vLLM, ...) — `OpenAIJudge`:
  `http(s)://host:port` or `.../v1` posts to `/v1/chat/completions`; a URL ending in
  `/chat/completions` or `/completions` posts there. Requests carry `temperature: 0` and
  `seed: 0`; `--judge_batch_size` of them are in flight at once. The API key is the URL's
  password (`http://:KEY@host:port`) or `$LIGHTRFT_JUDGE_API_KEY`, sent as `Authorization:
  Bearer KEY`.

Each sample becomes one judge input: the template (`--judge_template`, default `DEFAULT_TEMPLATE`)
with `{prompt}`, `{response}` and `{label}` replaced by the sample's (a None label reads
"(none)"). A local judge with a chat template gets the input as one user message; without one,
as plain text. The parser (`--judge_parser`, see `JUDGE_PARSERS`) turns the answer into the reward.

Reproducible: decoding is greedy and every seed is fixed, so the same inputs give the same answers
in every run and on every rank. A local judge's answer does not depend on which other inputs
share its batch, up to float rounding in the padded batch (a greedy token flips only where two
logits tie to ~1e-6; tests/rewards/test_judge.py checks alone == batched on a tiny model).

Each call judges every distinct judge input once: samples whose filled template is the same (a
GRPO group repeating an answer) share one judgement (`JudgeStats.cache_hits`).

A judge input that gets no score — no answer within `--reward_timeout` (URL judges; retried like
a reward server), an HTTP error, a malformed answer, an input longer than a local judge's context,
or an answer the parser finds no score in — follows `--reward_on_failure`: "error" raises
`RewardSourceError` naming the judge and the answer; "drop" returns those samples invalid.
"""

import json
import logging
import math
import os
import re
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lightrft.rewards.base import FailurePolicySource, RewardResult, RewardSourceError, check_batch_lengths
# The URL judge sends its requests through the reward-server client's request code (a deadline on
# the whole request, a cap on the answer's size, redirects refused, retries with backoff) rather
# than a second HTTP client.
from lightrft.rewards.remote import FLOAT32_MAX, RemoteRequestFailure, RemoteRewardClient, redact_url
from lightrft.rollout.base import SamplingParams
from lightrft.rollout.hf_engine import hf_engine_for

logger = logging.getLogger(__name__)

ON_FAILURE_POLICIES = ("error", "drop")
API_KEY_ENV = "LIGHTRFT_JUDGE_API_KEY"
JUDGE_SEED = 0                  # the seed of every judge request: greedy decoding does not draw, but servers log it
TEMPLATE_FIELDS = ("prompt", "response", "label")
NO_LABEL = "(none)"
SNIPPET_CHARS = 120

DEFAULT_TEMPLATE = """You are grading an answer to a task.

Task:
{prompt}

Answer:
{response}

Reference answer (may be "(none)"):
{label}

How correct and helpful is the answer? Give a score from 0 (wrong or useless) to 10 (fully correct \
and helpful). Reply with the score only, one integer from 0 to 10."""
DEFAULT_PARSER = "number:10"

REGEX_SECONDS = 1.0     # time bound of one regex:PATTERN search
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")
_VERDICT = re.compile(r"\b(yes|no|correct|incorrect|true|false|pass|fail)\b", re.IGNORECASE)
_POSITIVE = {"yes", "correct", "true", "pass"}


# ------------------------------------------------------------------------------------ templates
def check_template(template: str) -> None:
    """Raises ValueError when the template has no `{response}` or a `{name}` that nothing fills."""
    unknown = sorted({m.group(1) for m in _PLACEHOLDER.finditer(template)} - set(TEMPLATE_FIELDS))
    if unknown:
        raise ValueError(f"has placeholder(s) {', '.join('{' + u + '}' for u in unknown)} that nothing fills; a judge "
                         "template takes {prompt}, {response} and {label}")
    if "{response}" not in template:
        raise ValueError("has no {response} placeholder, so the judge would never see the response it grades; "
                         "add {response} where the response goes")


def read_template(path: str | Path) -> str:
    """The checked template text of the file `path`; ValueError naming the file otherwise."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} cannot be read ({err}); pass a UTF-8 text file holding the judge's prompt") from None
    try:
        check_template(text)
    except ValueError as err:
        raise ValueError(f"{path} {err}") from None
    return text


def label_text(label: Any) -> str:
    """How a label reads in a judge input: a string as is, None as "(none)", anything else as JSON."""
    if label is None:
        return NO_LABEL
    return label if isinstance(label, str) else json.dumps(label, ensure_ascii=False, sort_keys=True, default=str)


def fill_template(template: str, prompt: str, response: str, label: Any) -> str:
    """The template with `{prompt}`, `{response}` and `{label}` replaced in one pass (so braces
    inside the inserted texts stay as they are); other braces are kept as written."""
    values = {"prompt": prompt, "response": response, "label": label_text(label)}
    return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), template)


# -------------------------------------------------------------------------------------- parsers
AnswerParser = Callable[[str], "float | None"]
JUDGE_PARSERS: dict[str, Callable[["str | None"], AnswerParser]] = {}


def register_judge_parser(name: str):
    """Registers `make(argument) -> parser` under `name`; `--judge_parser name[:argument]` selects
    it. `argument` is the text after the first colon (None without one); `make` raises ValueError
    for an argument it cannot use. The parser maps an answer to a score, or None when the answer
    holds none."""
    def decorator(make):
        if name in JUDGE_PARSERS:
            raise ValueError(f"judge parser {name!r} is already registered")
        JUDGE_PARSERS[name] = make
        return make
    return decorator


def first_number(answer: str) -> float | None:
    """The first number written in `answer` ("Score: 8/10" gives 8.0), None when there is none."""
    match = _NUMBER.search(answer)
    return float(match.group()) if match else None


@register_judge_parser("number")
def number_parser(argument: str | None) -> AnswerParser:
    """`number`: the first number in the answer, as written. `number:MAX`: that number clamped to
    [0, MAX] and divided by MAX, so a 0..MAX rubric gives rewards in [0, 1]."""
    if argument is None:
        return first_number
    try:
        maximum = float(argument)
    except ValueError:
        maximum = math.nan
    if not (math.isfinite(maximum) and maximum > 0):
        raise ValueError(f"number:MAX needs a positive number MAX (the top of the rubric's scale), got {argument!r}")

    def parse(answer: str) -> float | None:
        value = first_number(answer)
        return None if value is None else min(max(value, 0.0), maximum) / maximum
    return parse


@register_judge_parser("verdict")
def verdict_parser(argument: str | None) -> AnswerParser:
    """`verdict`: the first verdict word of the answer (any case): yes, correct, true, pass give 1.0;
    no, incorrect, false, fail give 0.0."""
    if argument is not None:
        raise ValueError(f"verdict takes no argument, got {argument!r}")

    def parse(answer: str) -> float | None:
        match = _VERDICT.search(answer)
        return None if match is None else float(match.group(1).lower() in _POSITIVE)
    return parse


@register_judge_parser("regex")
def regex_parser(argument: str | None) -> AnswerParser:
    """`regex:PATTERN`: the number that the pattern's one group captures at its first match
    (`re.search` syntax; inline flags such as `(?i)` work), as written. The search runs in the
    `regex` engine (a dependency of transformers) with a time bound, REGEX_SECONDS per answer: a
    pattern that backtracks without end on some answer (`(a+)+$`) scores that answer None, with a
    warning naming the pattern, instead of holding the run (and the interpreter lock) for minutes."""
    import regex

    if not argument:
        raise ValueError("regex:PATTERN needs a pattern with one group around the score, e.g. 'regex:Score: (\\d+)'")
    try:
        pattern = regex.compile(argument, flags=regex.VERSION0)
    except regex.error as err:
        raise ValueError(f"the pattern {argument!r} does not compile ({err})") from None
    if pattern.groups != 1:
        raise ValueError(f"the pattern {argument!r} has {pattern.groups} groups; it needs exactly one, around the "
                         "score (write other groups as (?:...))")
    timed_out: list[int] = []         # lengths of the answers whose search was stopped

    def parse(answer: str) -> float | None:
        try:
            match = pattern.search(answer, timeout=REGEX_SECONDS)
        except TimeoutError:
            if not timed_out:
                logger.warning(f"--judge_parser regex:{argument}: the search took over {REGEX_SECONDS} s on an answer "
                               f"of {len(answer)} characters and was stopped; such answers score None. Write a "
                               "pattern without nested repetition (e.g. 'Score: (\\d+)')")
            timed_out.append(len(answer))
            return None
        if match is None or match.group(1) is None:
            return None
        try:
            return float(match.group(1).strip())
        except ValueError:
            return None
    return parse


def answer_parser(spec: str) -> AnswerParser:
    """The parser of a `--judge_parser` value (`name` or `name:argument`); it returns a finite
    float32-sized score or None. ValueError listing the valid forms for a value it cannot use."""
    name, colon, argument = spec.partition(":")
    if name not in JUDGE_PARSERS:
        more = sorted(set(JUDGE_PARSERS) - {"number", "verdict", "regex"})
        raise ValueError(f"unknown judge parser {name!r}; choose number, number:MAX, verdict or regex:PATTERN"
                         + (f", or a registered one: {', '.join(more)}" if more else ""))
    parse = JUDGE_PARSERS[name](argument if colon else None)

    def checked(answer: str) -> float | None:
        score = parse(answer)
        return score if score is not None and math.isfinite(score) and abs(score) <= FLOAT32_MAX else None
    return checked


# --------------------------------------------------------------------------------------- judges
@dataclass(frozen=True)
class JudgeSettings:
    """What every judge of a run shares (`RewardConfig`'s judge_* options)."""

    template: str = DEFAULT_TEMPLATE  # the template text (not its path)
    parser: str = DEFAULT_PARSER  # a --judge_parser value
    max_new_tokens: int = 32  # the longest answer, in tokens
    batch_size: int = 8  # inputs per generate call (local) or requests in flight (URL)
    model: str | None = None  # the "model" a URL judge's requests name (None: not sent)

    def __post_init__(self):
        check_template(self.template)
        answer_parser(self.parser)
        if self.max_new_tokens < 1:
            raise ValueError(f"--judge_max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ValueError(f"--judge_batch_size must be >= 1, got {self.batch_size}")


@dataclass(frozen=True)
class JudgeAnswer:
    """A judge's answer to one input, or why there is none."""

    text: str | None  # None: no answer
    failure: str = ""  # why there is no answer (no credentials in it)
    counter: str = "errors"  # the `JudgeStats` counter of that failure: "timeouts" or "errors"


@dataclass
class JudgeStats:
    """Counters since the source was built, for logging (`rollout/reward_source<i>_*`)."""

    batches: int = 0  # calls of the source (one per rollout batch of a rank)
    samples: int = 0  # samples in those calls
    judged: int = 0  # distinct judge inputs sent to the judge
    cache_hits: int = 0  # samples whose judge input repeated another of the same call (judged once)
    requests: int = 0  # HTTP requests sent, retries included (URL judges)
    retries: int = 0  # requests sent again after a timeout, connection error, 5xx or 429 (URL judges)
    timeouts: int = 0  # judge inputs with no answer within --reward_timeout, retries included (URL judges)
    errors: int = 0  # judge inputs that failed otherwise: HTTP errors, malformed answers, inputs over the context
    unparsed: int = 0  # answers in which the parser found no score
    dropped: int = 0  # samples returned invalid under --reward_on_failure drop

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def default_device() -> torch.device:
    """This rank's GPU (the strategy made it current) when there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class LocalJudge:
    """A Hugging Face causal LM on this rank, decoding greedily with `HFEngine`.

    Args:
        model: the judge model (put in eval mode; its device is where it runs).
        tokenizer: its tokenizer, with a pad token; its chat template, when it has one, wraps each
            judge input as one user message.
        name: how messages name the judge (`judge:PATH`).
        max_new_tokens: the longest answer (`--judge_max_new_tokens`).
        batch_size: judge inputs decoded at once (`--judge_batch_size`).
        stop_token_ids: the ids that end an answer (default: the tokenizer's EOS).
    """

    timeout = None  # generation is bounded by max_new_tokens, not by --reward_timeout

    def __init__(self, model: torch.nn.Module, tokenizer, name: str, max_new_tokens: int = 32, batch_size: int = 8,
                 stop_token_ids: Sequence[int] | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.max_new_tokens = max_new_tokens
        from lightrft.models.families import family_of   # transformers, imported when a judge is built

        family = family_of(model)
        self.context_len = family.context_length(model.config)
        self.engine = hf_engine_for(model, tokenizer, stop_token_ids, micro_batch_size=batch_size,  # an input is one sample
                                    family=family)
        self._params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, seed=JUDGE_SEED)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | None = None, **kwargs) -> "LocalJudge":
        """The judge of the model folder `path` on `device` (default `default_device()`): bfloat16
        on a GPU, float32 on the CPU. FileNotFoundError naming the flag when `path` holds no model."""
        from lightrft.models.families import load_model
        from lightrft.models.tokenizer import build_tokenizer, stop_token_ids

        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"judge model folder {folder} not found or holds no config.json (--remote_rm_url "
                                    "judge:PATH takes a Hugging Face model folder, or judge:http(s)://... a server)")
        device = device or default_device()
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        tokenizer = build_tokenizer(str(folder), padding_side="left")
        model = load_model(folder, dtype=dtype).to(device)
        return cls(model, tokenizer, f"judge:{path}", stop_token_ids=stop_token_ids(tokenizer, str(folder)), **kwargs)

    def encode(self, text: str) -> list[int]:
        """The token ids of one judge input, as `lightrft.cli.serve` makes them for the same text
        sent to /v1/chat/completions (chat template) or /v1/completions (none)."""
        if self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])  # the template has them
        return list(self.tokenizer(text)["input_ids"])

    def answer(self, texts: Sequence[str]) -> list[JudgeAnswer]:
        """The greedy answer to each judge input; an input too long for the context gets none."""
        ids = [self.encode(t) for t in texts]
        room = None if self.context_len is None else self.context_len - self.max_new_tokens
        answers: list[JudgeAnswer | None] = [None] * len(texts)
        for i, p in enumerate(ids):
            if not p:
                answers[i] = JudgeAnswer(None, "the judge input is empty")
            elif room is not None and len(p) > room:
                answers[i] = JudgeAnswer(None, f"the judge input is {len(p)} tokens, over the {room} that the judge's "
                                               f"context of {self.context_len} leaves beside --judge_max_new_tokens "
                                               f"{self.max_new_tokens}; shorten --judge_template or the responses")
        # Inputs of similar length share a micro-batch (less padding); each answer is put back in place.
        order = sorted((i for i, a in enumerate(answers) if a is None), key=lambda i: len(ids[i]))
        if order:
            out = self.engine.generate([ids[i] for i in order], self._params, seeds=[JUDGE_SEED] * len(order))
            for row, (i, length) in enumerate(zip(order, out.response_lengths.tolist())):
                tokens = out.responses[row, :length].tolist()
                answers[i] = JudgeAnswer(self.tokenizer.decode(tokens, skip_special_tokens=True))
        return answers


class OpenAIJudge:
    """A judge behind an OpenAI-compatible server (module docstring), asked one input per request.

    Args:
        url: the server; the password of its user info is the API key (user name ignored).
        max_new_tokens: `max_tokens` of each request (`--judge_max_new_tokens`).
        batch_size: requests in flight at once (`--judge_batch_size`).
        model: the `model` each request names (`--judge_model`); None sends none (vLLM and
            `lightrft.cli.serve` then use the model they serve).
        timeout, max_retries, backoff: per request, as `RemoteRewardClient` (`--reward_timeout`,
            `--reward_retries`).
        api_key: the key when the URL holds none (default `$LIGHTRFT_JUDGE_API_KEY`).
    """

    def __init__(self, url: str, max_new_tokens: int = 32, batch_size: int = 8, model: str | None = None,
                 timeout: float = 30.0, max_retries: int = 3, backoff: float = 0.5, api_key: str | None = None):
        if batch_size < 1:
            raise ValueError(f"--judge_batch_size must be >= 1 (requests in flight at once), got {batch_size}")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"judge URL must look like http(s)://host[:port][/v1], got {redact_url(url)}")
        key = urllib.parse.unquote(parts.password) if parts.password else (api_key or os.environ.get(API_KEY_ENV))
        path = parts.path.rstrip("/")
        self.chat = not (path.endswith("/completions") and not path.endswith("/chat/completions"))
        if not path.endswith("/completions"):
            path = (path if path.endswith("/v1") else path + "/v1") + "/chat/completions"
        endpoint = urllib.parse.urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], path, parts.query, ""))
        self.name = f"judge:{redact_url(url)}"
        self.timeout = timeout
        self.max_new_tokens = max_new_tokens
        self.model = model
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # One pooled client: a batch's requests go out together, `batch_size` at a time.
        self._client = RemoteRewardClient(endpoint, timeout=timeout, max_retries=max_retries, backoff=backoff,
                                          headers=headers, batch_size=None, max_concurrency=batch_size)

    @property
    def requests(self) -> int:
        return self._client.stats.requests

    @property
    def retries(self) -> int:
        return self._client.stats.retries

    def answer(self, texts: Sequence[str]) -> list[JudgeAnswer]:
        """The answer to each judge input, `batch_size` requests at a time."""
        raws = self._client.post_many([json.dumps(self._request(text)).encode() for text in texts])
        return [self._read(raw) for raw in raws]

    def _request(self, text: str) -> dict:
        body = {"temperature": 0.0, "seed": JUDGE_SEED, "max_tokens": self.max_new_tokens, "n": 1, "stream": False}
        body.update({"messages": [{"role": "user", "content": text}]} if self.chat else {"prompt": text})
        if self.model is not None:
            body["model"] = self.model
        return body

    def _read(self, raw: bytes | RemoteRequestFailure) -> JudgeAnswer:
        if isinstance(raw, RemoteRequestFailure):
            return JudgeAnswer(None, str(raw), "timeouts" if raw.timed_out else "errors")
        try:
            choice = json.loads(raw)["choices"][0]
            content = choice["message"]["content"] if self.chat else choice["text"]
        except (ValueError, RecursionError, LookupError, TypeError):
            content = None
        if not isinstance(content, str):
            kind = "chat completion" if self.chat else "completion"
            return JudgeAnswer(None, f"the server's answer is not an OpenAI {kind}: {snippet(bytes(raw))}")
        return JudgeAnswer(content)


class JudgeSource(FailurePolicySource):
    """An LLM judge as a reward source (module docstring).

    Args:
        judge: a `LocalJudge` or `OpenAIJudge` (anything with `name`, `timeout` and
            `answer(texts) -> list[JudgeAnswer]`).
        template: the judge input, with `{prompt}`, `{response}` and `{label}` (`check_template`).
        parser: a `--judge_parser` value (`answer_parser`).
        on_failure: "error" raises `RewardSourceError` naming the judge, the sample and the answer;
            "drop" returns a `RewardResult` whose failed samples are invalid (`--reward_on_failure`).
    """

    def __init__(self, judge, template: str = DEFAULT_TEMPLATE, parser: str = DEFAULT_PARSER,
                 on_failure: str = "error"):
        if on_failure not in ON_FAILURE_POLICIES:
            raise ValueError(f"on_failure must be one of {ON_FAILURE_POLICIES} (--reward_on_failure), "
                             f"got {on_failure!r}")
        check_template(template)
        self.judge = judge
        self.name = judge.name
        self.timeout = judge.timeout
        self.template = template
        self.parser = parser
        self._score_of = answer_parser(parser)
        self.on_failure = on_failure
        self.stats = JudgeStats()

    def __repr__(self) -> str:
        return f"JudgeSource({self.name!r}, parser={self.parser!r}, on_failure={self.on_failure!r})"

    def judge_input(self, query: str, prompt: str, label: Any) -> str:
        """The text the judge reads for one sample (its response is the query after the prompt)."""
        response = query[len(prompt):] if prompt and query.startswith(prompt) else query
        return fill_template(self.template, prompt, response, label)

    def score(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any],
              truncated: Sequence[bool] | None = None) -> RewardResult:
        """Rewards and validity of every sample; raises `RewardSourceError` under "error". A cut
        response is judged as it is (`truncated` is not used)."""
        check_batch_lengths(queries, prompts, labels)
        inputs = [self.judge_input(q, p, lab) for q, p, lab in zip(queries, prompts, labels)]
        distinct = list(dict.fromkeys(inputs))  # the call's cache: one judgement per distinct input
        answers = dict(zip(distinct, self.judge.answer(distinct)))
        self._count(len(inputs), len(distinct))
        scores, failures = {}, {}
        for text, answer in answers.items():
            score = None if answer.text is None else self._score_of(answer.text)
            if score is not None:
                scores[text] = score
                continue
            if answer.text is None:
                counter, reason = answer.counter, answer.failure
            else:
                counter = "unparsed"
                reason = f"the answer {snippet(answer.text)} holds no score for --judge_parser {self.parser}"
            failures[text] = reason
            setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        rewards = torch.tensor([scores.get(t, 0.0) for t in inputs], dtype=torch.float32)
        valid = torch.tensor([t in scores for t in inputs], dtype=torch.bool)
        if failures:
            self._fail(inputs, failures)
        return RewardResult(rewards, valid)

    def _count(self, samples: int, distinct: int) -> None:
        self.stats.batches += 1
        self.stats.samples += samples
        self.stats.judged += distinct
        self.stats.cache_hits += samples - distinct
        self.stats.requests = getattr(self.judge, "requests", 0)
        self.stats.retries = getattr(self.judge, "retries", 0)

    def _fail(self, inputs: list[str], failures: dict[str, str]) -> None:
        """Applies the failure policy to the samples whose judge input got no score."""
        failed = [i for i, t in enumerate(inputs) if t in failures]
        first = failed[0]
        reason = f"{self.name}: sample {first}: {failures[inputs[first]]}"
        if self.on_failure == "error":
            raise RewardSourceError(reason + " (--reward_on_failure error; 'drop' trains on without these samples)")
        self.stats.dropped += len(failed)
        others = f" (and {len(failures) - 1} more failed judge inputs)" if len(failures) > 1 else ""
        logger.warning("%s%s; dropping %d of %d samples (--reward_on_failure drop)", reason, others, len(failed),
                       len(inputs))


def make_judge(target: str, settings: JudgeSettings | None = None, *, timeout: float = 30.0, max_retries: int = 3,
               backoff: float = 0.5, on_failure: str = "error") -> JudgeSource:
    """The judge source of a `--remote_rm_url judge:TARGET` entry (TARGET without the prefix)."""
    settings = settings or JudgeSettings()
    target = target.strip()
    if not target:
        raise ValueError("--remote_rm_url judge: needs a model folder or an http(s):// URL after the colon, e.g. "
                         "judge:./judge_model or judge:http://127.0.0.1:8000")
    if target.startswith(("http://", "https://")):
        judge = OpenAIJudge(target, max_new_tokens=settings.max_new_tokens, batch_size=settings.batch_size,
                            model=settings.model, timeout=timeout, max_retries=max_retries, backoff=backoff)
    else:
        judge = LocalJudge.from_pretrained(target, max_new_tokens=settings.max_new_tokens,
                                           batch_size=settings.batch_size)
    return JudgeSource(judge, settings.template, settings.parser, on_failure)


def snippet(text: str | bytes, limit: int = SNIPPET_CHARS) -> str:
    """A short quoted view of an answer, safe for any size."""
    if isinstance(text, bytes):
        text = text[:4 * limit].decode("utf-8", errors="replace")
    text = text.strip()
    return repr(text if len(text) <= limit else text[:limit] + "...")
