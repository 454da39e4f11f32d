"""The OpenAI-compatible HTTP front of `lightrft.cli.serve`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream`), `POST
/v1/feedback` (a reward for a recorded response), `GET /v1/models`, `GET /health`. Bodies are
validated by pydantic models (`CompletionBody`, `ChatBody`, `FeedbackBody`: unknown fields
refused) and turned into a typed `GenerationRequest`; a malformed one is answered 400 with
OpenAI's error body `{"error": {"message", "type", "param"}}` naming the field, and the server
keeps serving. Tokenising, generating and recording run in worker threads, so the server answers
other clients (and `/health`) while the policy generates.

Each request is one generation with its own seed (the request's `seed`, else one derived from the
server's --seed and a request counter); its `n` choices are samples 0 ... n-1 of that seed. Every
response carries `system_fingerprint = "lightrft-policy-v<version>"`, the policy version that
generated it.
"""

import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from lightrft.datasets.prompt_dataset import encode_prompts
from lightrft.rollout.base import SamplingParams
from lightrft.rollout.seeds import mix_seed
from lightrft.serving.http import HTTPSettings, RequestError, parse_json, prompt_char_limit, validated
from lightrft.serving.policy import Sample, ServedPolicy
from lightrft.serving.records import ExperienceRecord, ExperienceRecorder, RecordWriteError
from lightrft.serving.server import HTTPServer, build_app, json_response, read_body
from lightrft.utils import json_out

logger = logging.getLogger("lightrft.serve")
MAX_CHOICES = 16
MAX_ID_CHARS = 256

__all__ = ["ChatBody", "CompletionBody", "FeedbackBody", "GenerationRequest", "OpenAIServer", "RequestError",
           "ServeLimits", "build_routes", "build_server", "error_body", "finish_choice", "parse_chat_request",
           "parse_completion_request"]

_Stop = Annotated[str, Field(min_length=1)]


class SamplingFields(BaseModel):
    """The sampling options both generation endpoints take. Any other field is refused by name
    (an option this server does not implement, or a misspelt one, would otherwise change nothing
    without a word); "user" is OpenAI's caller label, accepted and unused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)        # -1 or 0: no top-k cut
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    seed: int | None = None
    stop: _Stop | Annotated[list[_Stop], Field(max_length=4)] | None = None
    stream: bool | None = None
    user: str | None = None


class CompletionBody(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)   # e.g. "name": accepted, not rendered
    role: str
    content: str


class ChatBody(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None


class FeedbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    id: str = Field(max_length=MAX_ID_CHARS)
    reward: float
    index: int = Field(0, ge=0)


# What to send, for the fields whose pydantic error would list one failure per accepted shape.
HINTS = {"prompt": "must be a string or a list of token ids (one prompt per request; send several requests for "
                   "several prompts)",
         "stop": "must be a non-empty string or a list of up to 4 of them",
         "reward": "must be a finite number",
         "id": "must be the 'id' of a response this server sent",
         "messages": "must be a non-empty list of {\"role\", \"content\"} objects with text content"}


@dataclass(frozen=True)
class ServeLimits:
    max_new_tokens: int              # --generate_max_len: the most (and default) max_tokens
    prompt_max_len: int              # --prompt_max_len: the most prompt tokens
    context_len: int | None = None   # the model's context (max_position_embeddings): prompt + answer tokens
    token_chars: int = 64            # the most characters one token stands for (`longest_token_chars`)

    @property
    def prompt_tokens(self) -> int:
        """The most prompt tokens: --prompt_max_len, and fewer than the model's context."""
        return min(self.prompt_max_len, self.context_len or self.prompt_max_len)

    @property
    def prompt_chars(self) -> int:
        """The most characters a prompt may have, checked before tokenising it."""
        return prompt_char_limit(self.prompt_tokens, self.token_chars)


@dataclass(frozen=True)
class GenerationRequest:
    kind: str                     # "completion" or "chat"
    prompt: str                   # the text the model continues (chat: the templated conversation)
    prompt_token_ids: list[int]   # (T_prompt,)
    messages: list | None         # chat requests: the conversation as sent
    params: SamplingParams
    seed: int | None              # None: the server derives one
    stop: list[str]
    stream: bool
    logprobs: int | None          # completions: the `logprobs` number; chat: 1 when `logprobs` is true


def _max_tokens(body: SamplingFields, limits: ServeLimits, prompt_len: int) -> int:
    """The request's new-token budget: its `max_completion_tokens` / `max_tokens`, at most
    --generate_max_len and what the model's context leaves after the prompt; by default the
    smaller of the two."""
    key = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(body, key)
    room = limits.max_new_tokens if limits.context_len is None else limits.context_len - prompt_len
    if max_tokens is None:
        return min(limits.max_new_tokens, room)
    if max_tokens > limits.max_new_tokens:
        raise RequestError(f"'{key}' {max_tokens} is over this server's limit of {limits.max_new_tokens} new tokens; "
                           "ask for fewer, or restart the server with a larger --generate_max_len", key)
    if max_tokens > room:
        raise RequestError(f"'{key}' {max_tokens} and the prompt's {prompt_len} tokens are over the model's context of "
                           f"{limits.context_len} tokens; ask for at most {room}, or send a shorter prompt", key)
    return max_tokens


def _sampling(body: SamplingFields, limits: ServeLimits,
              prompt_len: int) -> tuple[SamplingParams, int | None, list[str], bool]:
    params = SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                            top_p=1.0 if body.top_p is None else body.top_p,
                            top_k=max(0, body.top_k or 0),
                            max_new_tokens=_max_tokens(body, limits, prompt_len),
                            n=body.n or 1)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return params, body.seed, stop, bool(body.stream)


def _check_prompt_chars(chars: int, limits: ServeLimits, param: str) -> None:
    """Refuses a prompt text too long to fit before it is tokenised (tokenising a 50 MB text
    takes minutes and gigabytes)."""
    if chars > limits.prompt_chars:
        raise RequestError(f"the prompt is {chars} characters, more than {limits.prompt_chars} characters can hold "
                           f"(this server takes at most {limits.prompt_tokens} prompt tokens: --prompt_max_len "
                           f"{limits.prompt_max_len}, model context {limits.context_len}); shorten it", param)


def _check_prompt_length(ids: list[int], limits: ServeLimits, param: str) -> list[int]:
    if not ids:
        raise RequestError("the prompt is empty: send at least one token", param)
    if len(ids) > limits.prompt_max_len:
        raise RequestError(f"the prompt is {len(ids)} tokens, over this server's --prompt_max_len "
                           f"{limits.prompt_max_len}; shorten it or restart with a larger --prompt_max_len", param)
    if limits.context_len is not None and len(ids) >= limits.context_len:
        raise RequestError(f"the prompt is {len(ids)} tokens, which leaves no room for an answer in the model's "
                           f"context of {limits.context_len} tokens; shorten it", param)
    return ids


def parse_completion_request(payload: Any, tokenizer: Any, limits: ServeLimits) -> GenerationRequest:
    """A `/v1/completions` body: `prompt` is one string or one list of token ids."""
    body = validated(CompletionBody, payload, "/v1/completions", HINTS)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise RequestError(f"'prompt' holds {len(prompt)} prompts: send one prompt per request (several requests "
                               "for several prompts)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        _check_prompt_chars(len(prompt), limits, "prompt")
        ids = _check_prompt_length(encode_prompts(tokenizer, [prompt], templated=False)[0], limits, "prompt")
    else:
        _check_prompt_length(prompt, limits, "prompt")
        if any(not 0 <= t < len(tokenizer) for t in prompt):
            raise RequestError(f"'prompt' holds token ids outside the vocabulary [0, {len(tokenizer)})", "prompt")
        ids, prompt = list(prompt), tokenizer.decode(prompt)
    params, seed, stop, stream = _sampling(body, limits, len(ids))
    return GenerationRequest("completion", prompt, ids, None, params, seed, stop, stream, body.logprobs)


def parse_chat_request(payload: Any, tokenizer: Any, limits: ServeLimits) -> GenerationRequest:
    """A `/v1/chat/completions` body: `messages` rendered with the tokenizer's chat template and
    the generation prompt. A conversation of more messages than prompt tokens is refused before
    its messages are validated or rendered (each message renders to a token at least)."""
    messages = payload.get("messages") if isinstance(payload, dict) else None
    if isinstance(messages, list) and len(messages) > limits.prompt_tokens:
        raise RequestError(f"'messages' holds {len(messages)} messages, more than the {limits.prompt_tokens} prompt "
                           "tokens this server takes (each message is a token at least); send fewer", "messages")
    body = validated(ChatBody, payload, "/v1/chat/completions", HINTS)
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("this model's tokenizer has no chat template; use /v1/completions, or serve a folder "
                           "whose tokenizer_config.json has one", "messages")
    plain = [{"role": m.role, "content": m.content} for m in body.messages]
    _check_prompt_chars(sum(len(m["role"]) + len(m["content"]) for m in plain), limits, "messages")
    try:
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # templates raise TemplateError, KeyError, TypeError on unexpected roles
        raise RequestError(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                           "messages") from None
    _check_prompt_chars(len(text), limits, "messages")
    ids = _check_prompt_length(encode_prompts(tokenizer, [text], templated=True)[0], limits, "messages")
    params, seed, stop, stream = _sampling(body, limits, len(ids))
    return GenerationRequest("chat", text, ids, plain, params, seed, stop, stream, 1 if body.logprobs else None)


@dataclass
class Choice:
    token_ids: list[int]
    log_probs: list[float]
    text: str
    finish_reason: str     # "stop" (EOS or a stop string) or "length"


def finish_choice(tokenizer: Any, sample: Sample, stop: list[str]) -> Choice:
    """The text of a sample, cut at the first stop string: the tokens are kept up to the one that
    completes it (they are what the policy generated; the record trains on them), the text ends
    before it, as OpenAI's API returns it."""
    for k in range(1, len(sample.token_ids) + 1) if stop else ():
        text = tokenizer.decode(sample.token_ids[:k], skip_special_tokens=True)
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return Choice(sample.token_ids[:k], sample.log_probs[:k], text[:min(hits)], "stop")
    text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    return Choice(sample.token_ids, sample.log_probs, text, "length" if sample.truncated else "stop")


class OpenAIServer:
    """Turns parsed requests into generations, records and OpenAI response bodies."""

    def __init__(self, policy: ServedPolicy, limits: ServeLimits, model_name: str, seed: int = 0,
                 recorder: ExperienceRecorder | None = None):
        self.policy = policy
        self.tokenizer = policy.tokenizer
        self.limits = limits
        self.model_name = model_name
        self.seed = seed
        self.recorder = recorder
        self._counter = itertools.count()
        self._counter_lock = threading.Lock()

    def next_seed(self) -> int:
        with self._counter_lock:
            return mix_seed(self.seed, next(self._counter))

    def check_prompt_ids(self, request: GenerationRequest) -> None:
        """Refuses a prompt holding a token the served model has no embedding row for (a tokenizer
        longer than the model's vocabulary is served as long as no request uses the extra ids)."""
        rows = self.policy.vocab_rows
        outside = sorted({t for t in request.prompt_token_ids if t >= rows})
        if outside:
            tokens = ", ".join(f"{self.tokenizer.convert_ids_to_tokens(t)!r} (id {t})" for t in outside[:5])
            raise RequestError(f"the prompt holds {tokens}, which this model has no embedding for (its vocabulary is "
                               f"{rows} tokens, its tokenizer's {len(self.tokenizer)}); leave those tokens out",
                               "messages" if request.kind == "chat" else "prompt")

    def run(self, request: GenerationRequest) -> tuple[str, int, list[Choice]]:
        """Generates the request's choices and records them; returns (response id, policy version, choices)."""
        seed = request.seed if request.seed is not None else self.next_seed()
        samples = self.policy.generate(request.prompt_token_ids, request.params, seed)
        response_id = ("chatcmpl-" if request.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        choices = [finish_choice(self.tokenizer, s, request.stop) for s in samples]
        version = samples[0].policy_version
        if self.recorder is not None:
            p = request.params
            sampling = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
                        "max_tokens": p.max_new_tokens, "n": p.n, "seed": seed, "stop": request.stop}
            for index, choice in enumerate(choices):
                self.recorder.record(ExperienceRecord(
                    id=response_id, index=index, prompt_token_ids=request.prompt_token_ids,
                    response_token_ids=choice.token_ids, log_probs=choice.log_probs, policy_version=version,
                    tokenizer=self.policy.fingerprint, prompt=request.prompt, response=choice.text,
                    messages=request.messages, sampling=sampling, finish_reason=choice.finish_reason,
                    time=time.time()))
        return response_id, version, choices

    def _logprobs(self, request: GenerationRequest, choice: Choice) -> dict | None:
        if request.logprobs is None:
            return None
        tokens = [self.tokenizer.decode([t]) for t in choice.token_ids]
        if request.kind == "chat":
            return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                                for tok, lp in zip(tokens, choice.log_probs)]}
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=len(request.prompt)))
        return {"tokens": tokens, "token_logprobs": choice.log_probs, "top_logprobs": None,
                "text_offset": offsets[:len(tokens)]}

    def response_body(self, request: GenerationRequest, response_id: str, version: int,
                      choices: list[Choice]) -> dict:
        completion_tokens = sum(len(c.token_ids) for c in choices)
        body = {"id": response_id, "created": int(time.time()), "model": self.model_name,
                "system_fingerprint": f"lightrft-policy-v{version}",
                "usage": {"prompt_tokens": len(request.prompt_token_ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(request.prompt_token_ids) + completion_tokens}}
        if request.kind == "chat":
            body["object"] = "chat.completion"
            body["choices"] = [{"index": i, "message": {"role": "assistant", "content": c.text},
                                "finish_reason": c.finish_reason, "logprobs": self._logprobs(request, c)}
                               for i, c in enumerate(choices)]
        else:
            body["object"] = "text_completion"
            body["choices"] = [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
                                "logprobs": self._logprobs(request, c)} for i, c in enumerate(choices)]
        return body

    def stream_chunks(self, request: GenerationRequest, response_id: str, version: int, choices: list[Choice]):
        """The response as server-sent-event payloads: one chunk per token of each choice (the
        text it adds), then one with the finish reason."""
        base = {"id": response_id, "created": int(time.time()), "model": self.model_name,
                "system_fingerprint": f"lightrft-policy-v{version}",
                "object": "chat.completion.chunk" if request.kind == "chat" else "text_completion"}
        for i, choice in enumerate(choices):
            if request.kind == "chat":
                yield {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None}]}
            previous = ""
            for k in range(1, len(choice.token_ids) + 1):
                text = self.tokenizer.decode(choice.token_ids[:k], skip_special_tokens=True)[:len(choice.text)]
                delta, previous = text[len(previous):], text
                if not delta:
                    continue
                if request.kind == "chat":
                    yield {**base, "choices": [{"index": i, "delta": {"content": delta}, "finish_reason": None}]}
                else:
                    yield {**base, "choices": [{"index": i, "text": delta, "finish_reason": None, "logprobs": None}]}
            end = {"delta": {}} if request.kind == "chat" else {"text": ""}
            yield {**base, "choices": [{"index": i, **end, "finish_reason": choice.finish_reason}]}

    def feedback(self, payload: Any) -> dict:
        if self.recorder is None:
            raise RequestError("this server records nothing: start it with --record DIR to take feedback")
        body = validated(FeedbackBody, payload, "/v1/feedback", HINTS)
        try:
            self.recorder.add_feedback(body.id, body.reward, body.index)
        except KeyError as e:
            raise RequestError(str(e.args[0]), "id", HTTPStatus.NOT_FOUND) from None
        except ValueError as e:
            raise RequestError(str(e), "reward") from None
        except OSError as e:  # the record folder could not be written (a full disk): the reward was not kept
            logger.error("feedback for %s not recorded: %s", body.id, e)
            status = (HTTPStatus.INSUFFICIENT_STORAGE if isinstance(e, RecordWriteError)
                      else HTTPStatus.INTERNAL_SERVER_ERROR)
            raise RequestError(f"the reward was not recorded: {e}", "reward", status) from None
        return {"id": body.id, "index": body.index, "status": "recorded"}


def error_body(error: RequestError) -> dict:
    """OpenAI's error shape."""
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    code = "invalid_api_key" if error.status == HTTPStatus.UNAUTHORIZED else None
    return {"error": {"message": str(error), "type": kind, "param": error.param, "code": code}}


def _events(chunks):
    """Server-sent events of the chunk payloads, ended by `data: [DONE]`."""
    for chunk in chunks:
        yield f"data: {json_out.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def build_routes(api: OpenAIServer, settings: HTTPSettings) -> list[Route]:
    """The routes of `serve`. Reading a body is asynchronous; parsing, tokenising, generating and
    recording run in worker threads."""

    def answer(body: bytes, parse) -> Any:
        """Everything after the body arrives, in one worker thread: parse, check, generate, record."""
        generation = parse(parse_json(body), api.tokenizer, api.limits)
        api.check_prompt_ids(generation)
        try:
            response_id, version, choices = api.run(generation)
        except RecordWriteError as e:  # the record folder is full: the answer was not recorded, so not sent
            logger.error("response not recorded: %s", e)
            raise RequestError(f"the response could not be recorded: {e}", None,
                               HTTPStatus.INSUFFICIENT_STORAGE) from None
        except Exception as e:  # a failed generation answers this request and leaves the server up
            logger.exception("generation failed")
            raise RequestError(f"generation failed: {type(e).__name__}: {e}", None,
                               HTTPStatus.INTERNAL_SERVER_ERROR) from None
        if generation.stream:
            return StreamingResponse(_events(api.stream_chunks(generation, response_id, version, choices)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return json_response(HTTPStatus.OK, api.response_body(generation, response_id, version, choices))

    async def generate(request: Request, parse) -> Any:
        return await run_in_threadpool(answer, await read_body(request, settings), parse)

    async def completions(request: Request):
        return await generate(request, parse_completion_request)

    async def chat(request: Request):
        return await generate(request, parse_chat_request)

    async def feedback(request: Request):
        body = await read_body(request, settings)
        return json_response(HTTPStatus.OK, await run_in_threadpool(lambda: api.feedback(parse_json(body))))

    async def health(request: Request):
        return json_response(HTTPStatus.OK, {"status": "ok", "policy_version": api.policy.version,
                                             "weights": str(api.policy.path)})

    async def models(request: Request):
        return json_response(HTTPStatus.OK, {"object": "list", "data": [
            {"id": api.model_name, "object": "model", "created": 0, "owned_by": "lightrft"}]})

    return [Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/feedback", feedback, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"])]


def build_server(api: OpenAIServer, host: str = "127.0.0.1", port: int = 8000,
                 settings: HTTPSettings | None = None) -> HTTPServer:
    """An HTTP server bound to (host, port) answering with `api` under `settings` (API key,
    deadlines, connection bounds); port 0 picks a free port (read it back from
    `server.server_address`). Call `serve_forever()` to run it."""
    settings = settings or HTTPSettings()
    app = build_app(build_routes(api, settings), settings, error_body,
                    "POST /v1/completions, /v1/chat/completions or /v1/feedback; GET /health or /v1/models")
    return HTTPServer(app, host, port, settings, error_body)
