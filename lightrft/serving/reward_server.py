"""The reward-model server behind `lightrft.cli.serve_rm`: `RewardScorer` scores full texts with a
`RewardModel`; `build_server` answers `POST <any path> {"query": [...]}` with `{"rewards": [...]}`
and `GET /health`, on the HTTP stack of `lightrft.serving.server`. Parsing and scoring run in
worker threads; the scorer keeps one forward at a time."""

import logging
import threading
from http import HTTPStatus
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.routing import Route

from lightrft.datasets import encode_for_reward
from lightrft.datasets.padding import right_pad
from lightrft.serving.http import (HTTPSettings, RequestError, longest_token_chars, parse_json, prompt_char_limit,
                                   validated)
from lightrft.serving.server import HTTPServer, build_app, json_response, read_body

logger = logging.getLogger("lightrft.serve_rm")

__all__ = ["RewardRequest", "RewardScorer", "build_server", "error_body", "parse_request"]


class RewardScorer:
    """Scores full texts with a `RewardModel`, `batch_size` at a time, one forward at a time
    (requests arrive on several threads; the lock keeps them from interleaving on the model)."""

    def __init__(self, reward_model: torch.nn.Module, tokenizer: Any, batch_size: int = 16, max_len: int = 2048,
                 device: str | torch.device = "cpu"):
        if batch_size <= 0:
            raise ValueError(f"--batch_size must be positive, got {batch_size}")
        if max_len < 2:
            raise ValueError(f"--max_len must be at least 2, got {max_len}")
        self.model = reward_model.to(device).eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_len = max_len
        self.device = torch.device(device)
        # A text longer than this has more than max_len tokens whatever they are; refused before tokenizing.
        self.max_chars = prompt_char_limit(max_len, longest_token_chars(tokenizer))
        self._lock = threading.Lock()

    def encode(self, text: str) -> torch.Tensor:
        """Token ids as the reward model was trained on, keeping the last `max_len`. Shape: (T,)"""
        bos = self.tokenizer.bos_token
        # A text rendered by a chat template already starts with BOS; do not add a second one.
        add_special = not (bos and text.startswith(bos))
        ids = encode_for_reward(self.tokenizer, text, add_special_tokens=add_special)
        return torch.tensor(ids[-self.max_len:], dtype=torch.long)

    @torch.no_grad()
    def score(self, texts: list[str]) -> list[float]:
        scores = []
        for start in range(0, len(texts), self.batch_size):
            seqs = [self.encode(t) for t in texts[start:start + self.batch_size]]
            ids, mask = right_pad(seqs, self.tokenizer.pad_token_id)  # (b, T)
            with self._lock:
                batch_scores = self.model(ids.to(self.device), attention_mask=mask.to(self.device))  # (b,)
            scores += batch_scores.float().cpu().tolist()
        return scores


class RewardRequest(BaseModel):
    """What `RemoteRewardClient` sends: the texts to score, and the prompts, labels and truncation
    flags that a rule-based server would use (this one scores the texts alone)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    query: list[str]
    prompts: list | None = None
    labels: list | None = None
    truncated: list | None = None


def parse_request(payload: Any, max_chars: int) -> list[str]:
    """The "query" list of a parsed request body; a `RequestError` naming the field otherwise
    (413 for a query over `max_chars` characters)."""
    queries = validated(RewardRequest, payload, "the reward endpoint",
                        {"query": "must be a list of full texts (prompt + response) to score"}).query
    for i, query in enumerate(queries):
        if len(query) > max_chars:
            raise RequestError(f"'query[{i}]' is {len(query)} characters, over this server's limit of "
                               f"{max_chars} (--max_len tokens of at most the tokenizer's longest token); only the "
                               "last --max_len tokens are scored, so send the end of the text", f"query[{i}]",
                               HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    return queries


def error_body(error: RequestError) -> dict:
    return {"error": str(error)}


def build_server(scorer: RewardScorer, host: str = "127.0.0.1", port: int = 5000,
                 settings: HTTPSettings | None = None) -> HTTPServer:
    """An HTTP server bound to (host, port) answering with `scorer` under `settings` (API key,
    deadlines, connection bounds); port 0 picks a free port (read it back from
    `server.server_address`). Call `serve_forever()` to run it. Parsing and scoring run in worker
    threads; `RewardScorer` keeps one forward at a time."""
    settings = settings or HTTPSettings()

    def answer(body: bytes):
        queries = parse_request(parse_json(body), scorer.max_chars)
        try:
            rewards = scorer.score(queries)
        except Exception as e:  # a failed forward answers this request and leaves the server up
            logger.exception("scoring failed")
            raise RequestError(f"scoring failed: {type(e).__name__}: {e}", None,
                               HTTPStatus.INTERNAL_SERVER_ERROR) from None
        return json_response(HTTPStatus.OK, {"rewards": rewards})

    async def score(request: Request):
        return await run_in_threadpool(answer, await read_body(request, settings))

    async def health(request: Request):
        return json_response(HTTPStatus.OK, {"status": "ok"})

    routes = [Route("/health", health, methods=["GET"]), Route("/{path:path}", score, methods=["POST"])]
    app = build_app(routes, settings, error_body, "POST texts to score (any path), or GET /health")
    return HTTPServer(app, host, port, settings, error_body)
