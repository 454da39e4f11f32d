"""The OpenAI-compatible HTTP front of `lightrft.cli.serve`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream`), `POST
/v1/feedback` (a reward for a recorded response), `GET /v1/models`, `GET /health`. Requests are
parsed into a typed `GenerationRequest`; a malformed one is answered 400 with OpenAI's error body
`{"error": {"message", "type", "param"}}` naming the field, and the server keeps serving.

Each request is one generation with its own seed (the request's `seed`, else one derived from the
server's --seed and a request counter); its `n` choices are samples 0 ... n-1 of that seed. Every
response carries `system_fingerprint = "lightrft-policy-v<version>"`, the policy version that
generated it.
"""

import itertools
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lightrft.datasets.prompt_dataset import encode_prompts
from lightrft.rollout.base import SamplingParams
from lightrft.rollout.seeds import mix_seed
from lightrft.serving.policy import Sample, ServedPolicy
from lightrft.serving.records import ExperienceRecord, ExperienceRecorder
from lightrft.utils.http import send_json

logger = logging.getLogger("lightrft.serve")
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_CHOICES = 16


class RequestError(ValueError):
    """A client mistake: answered with `status` and an OpenAI-style error naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass(frozen=True)
class ServeLimits:
    max_new_tokens: int      # --generate_max_len: the most (and default) max_tokens
    prompt_max_len: int      # --prompt_max_len: the most prompt tokens


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


def _number(payload: dict, key: str, default, kind=float, low=None, high=None):
    value = payload.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise RequestError(f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {value!r}", key)
    if (low is not None and value < low) or (high is not None and value > high):
        raise RequestError(f"'{key}' must be in [{low}, {high}], got {value}", key)
    return kind(value)


def _sampling(payload: dict, limits: ServeLimits) -> tuple[SamplingParams, int | None, list[str], bool]:
    max_tokens = payload.get("max_completion_tokens", payload.get("max_tokens"))
    if max_tokens is None:
        max_tokens = limits.max_new_tokens
    key = "max_completion_tokens" if "max_completion_tokens" in payload else "max_tokens"
    max_tokens = _number({key: max_tokens}, key, None, int, 1)
    if max_tokens > limits.max_new_tokens:
        raise RequestError(f"'{key}' {max_tokens} is over this server's limit of {limits.max_new_tokens} new tokens; "
                           "ask for fewer, or restart the server with a larger --generate_max_len", key)
    params = SamplingParams(temperature=_number(payload, "temperature", 1.0, float, 0.0, 2.0),
                            top_p=_number(payload, "top_p", 1.0, float, 1e-9, 1.0),
                            top_k=max(0, _number(payload, "top_k", 0, int, -1)), max_new_tokens=max_tokens,
                            n=_number(payload, "n", 1, int, 1, MAX_CHOICES))
    seed = payload.get("seed")
    if seed is not None:
        seed = _number(payload, "seed", None, int)
    stop = payload.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise RequestError("'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    stream = payload.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"'stream' must be true or false, got {stream!r}", "stream")
    return params, seed, stop, stream


def _check_prompt_length(ids: list[int], limits: ServeLimits, param: str) -> list[int]:
    if not ids:
        raise RequestError("the prompt is empty: send at least one token", param)
    if len(ids) > limits.prompt_max_len:
        raise RequestError(f"the prompt is {len(ids)} tokens, over this server's --prompt_max_len "
                           f"{limits.prompt_max_len}; shorten it or restart with a larger --prompt_max_len", param)
    return ids


def parse_completion_request(payload: Any, tokenizer: Any, limits: ServeLimits) -> GenerationRequest:
    """A `/v1/completions` body: `prompt` is one string or one list of token ids."""
    if not isinstance(payload, dict):
        raise RequestError("the request body must be a JSON object")
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = encode_prompts(tokenizer, [prompt], templated=False)[0]
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < len(tokenizer) for t in prompt):
            raise RequestError(f"'prompt' holds token ids outside the vocabulary [0, {len(tokenizer)})", "prompt")
        ids, prompt = list(prompt), tokenizer.decode(prompt)
    else:
        raise RequestError("'prompt' must be a string or a list of token ids (one prompt per request; send "
                           "several requests for several prompts)", "prompt")
    params, seed, stop, stream = _sampling(payload, limits)
    logprobs = payload.get("logprobs")
    if logprobs is not None:
        logprobs = _number(payload, "logprobs", None, int, 0, 5)
    return GenerationRequest("completion", prompt, _check_prompt_length(ids, limits, "prompt"), None, params, seed,
                             stop, stream, logprobs)


def parse_chat_request(payload: Any, tokenizer: Any, limits: ServeLimits) -> GenerationRequest:
    """A `/v1/chat/completions` body: `messages` rendered with the tokenizer's chat template and
    the generation prompt."""
    if not isinstance(payload, dict):
        raise RequestError("the request body must be a JSON object")
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise RequestError(f"'messages[{i}]' must be an object with string 'role' and 'content' (text content "
                               "only)", f"messages[{i}]")
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("this model's tokenizer has no chat template; use /v1/completions, or serve a folder "
                           "whose tokenizer_config.json has one", "messages")
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    try:
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # templates raise TemplateError, KeyError, TypeError on unexpected roles
        raise RequestError(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                           "messages") from None
    ids = encode_prompts(tokenizer, [text], templated=True)[0]
    params, seed, stop, stream = _sampling(payload, limits)
    logprobs = payload.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise RequestError(f"'logprobs' must be true or false, got {logprobs!r}", "logprobs")
    return GenerationRequest("chat", text, _check_prompt_length(ids, limits, "messages"), plain, params, seed, stop,
                             stream, 1 if logprobs else None)


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
        if not isinstance(payload, dict) or not isinstance(payload.get("id"), str):
            raise RequestError("send {\"id\": \"<response id>\", \"reward\": <number>} (optional \"index\": the "
                               "choice, default 0)", "id")
        index = _number(payload, "index", 0, int, 0)
        try:
            self.recorder.add_feedback(payload["id"], payload.get("reward"), index)
        except KeyError as e:
            raise RequestError(str(e.args[0]), "id", HTTPStatus.NOT_FOUND) from None
        except ValueError as e:
            raise RequestError(str(e), "reward") from None
        return {"id": payload["id"], "index": index, "status": "recorded"}


def make_handler(api: OpenAIServer) -> type[BaseHTTPRequestHandler]:
    routes = {"/v1/completions": parse_completion_request, "/v1/chat/completions": parse_chat_request}

    class Handler(BaseHTTPRequestHandler):
        server_version = "lightrft-serve"
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            path = self.path.split("?")[0].rstrip("/")
            if path == "/health":
                self._reply(HTTPStatus.OK, {"status": "ok", "policy_version": api.policy.version,
                                            "weights": str(api.policy.path)})
            elif path == "/v1/models":
                self._reply(HTTPStatus.OK, {"object": "list", "data": [
                    {"id": api.model_name, "object": "model", "created": 0, "owned_by": "lightrft"}]})
            else:
                self._error(RequestError(f"no GET route {self.path}; GET /health or /v1/models",
                                         status=HTTPStatus.NOT_FOUND))

        def do_POST(self) -> None:
            path = self.path.split("?")[0].rstrip("/")
            try:
                payload = self._read_json()
                if path == "/v1/feedback":
                    self._reply(HTTPStatus.OK, api.feedback(payload))
                    return
                if path not in routes:
                    raise RequestError(f"no POST route {self.path}; use /v1/completions, /v1/chat/completions or "
                                       "/v1/feedback", status=HTTPStatus.NOT_FOUND)
                request = routes[path](payload, api.tokenizer, api.limits)
                api.check_prompt_ids(request)
            except RequestError as e:
                self._error(e)
                return
            try:
                response_id, version, choices = api.run(request)
            except Exception as e:  # a failed generation answers this request and leaves the server up
                logger.exception("generation failed")
                self._error(RequestError(f"generation failed: {type(e).__name__}: {e}",
                                         status=HTTPStatus.INTERNAL_SERVER_ERROR))
                return
            if request.stream:
                self._stream(api.stream_chunks(request, response_id, version, choices))
            else:
                self._reply(HTTPStatus.OK, api.response_body(request, response_id, version, choices))

        def _read_json(self) -> Any:
            length = self.headers.get("Content-Length")
            if length is None:
                raise RequestError("the request needs a Content-Length header", status=HTTPStatus.LENGTH_REQUIRED)
            try:
                length = int(length)
            except ValueError:
                raise RequestError(f"bad Content-Length header {length!r}") from None
            if length > MAX_BODY_BYTES:
                raise RequestError(f"the body is {length} bytes, over the {MAX_BODY_BYTES} byte limit",
                                   status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            try:
                return json.loads(self.rfile.read(length))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(f"the request body is not valid JSON: {e}") from None

        def _error(self, error: RequestError) -> None:
            kind = "invalid_request_error" if error.status < 500 else "server_error"
            self._reply(error.status, {"error": {"message": str(error), "type": kind, "param": error.param,
                                                 "code": None}})

        def _reply(self, status: HTTPStatus, payload: dict) -> None:
            send_json(self, status, payload)

        def _stream(self, chunks) -> None:
            # Server-sent events without a length: the connection closes after "data: [DONE]".
            self.close_connection = True
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for chunk in chunks:
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def log_message(self, format: str, *args) -> None:
            logger.info("%s %s", self.address_string(), format % args)

    return Handler


def build_server(api: OpenAIServer, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """An HTTP server bound to (host, port) answering with `api`; port 0 picks a free port (read it
    back from `server.server_address`). Call `serve_forever()` to run it."""
    server = ThreadingHTTPServer((host, port), make_handler(api))
    server.daemon_threads = True
    return server
