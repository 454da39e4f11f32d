"""Serve a trained reward model over HTTP.

    python -m lightrft.cli.serve_rm --reward_pretrain ./ckpt/rm --port 5000

POST (any path, e.g. /get_reward) a JSON object {"query": [full texts], "prompts": [...],
"labels": [...]} with `Content-Type: application/json` and get {"rewards": [float, ...]}, one score
per query, in order. This is what `train_ppo --remote_rm_url http://host:port/get_reward` sends;
only "query" is read. GET /health answers {"status": "ok"}. A malformed request gets a 4xx JSON
{"error": "..."} naming the header or field, and the server keeps serving. It binds to 127.0.0.1
unless --host says otherwise. With an API key ($LIGHTRFT_API_KEY or --api_key) every request must
carry it: `Authorization: Bearer <key>`, or basic authentication with the key as the password,
which train_ppo sends for `--remote_rm_url http://rm:<key>@host:port/get_reward`.

Each query is tokenized as in reward-model training (`encode_for_reward`: EOS appended), cut to
its last --max_len tokens (the score is read at the end), and scored in batches of --batch_size.
A query longer than --max_len times the tokenizer's longest token in characters is refused (413)
before it is tokenized.
"""

import argparse
import logging
import sys
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
from lightrft.serving.http import (HTTPSettings, RequestError, add_http_flags, address_problem, bind_error,
                                   longest_token_chars, parse_json, prompt_char_limit, settings_from_flags, validated,
                                   warn_if_exposed)
from lightrft.serving.server import HTTPServer, build_app, freeze_loaded_objects, json_response, read_body
from lightrft.utils.program import run_program

logger = logging.getLogger("lightrft.serve_rm")


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightrft.cli.serve_rm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reward_pretrain", "--pretrain", dest="reward_pretrain", required=True,
                        help="reward model folder written by train_rm (config, weights and tokenizer)")
    parser.add_argument("--value_head_prefix", default="score", help="attribute name of the value head")
    parser.add_argument("--normalize_reward", action="store_true",
                        help="return (r - mean) / std with the statistics stored in the model's config")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind; 0.0.0.0 exposes the server to the network")
    parser.add_argument("--port", type=int, default=5000, help="port to listen on (0: any free port)")
    parser.add_argument("--batch_size", type=int, default=16, help="texts per forward pass")
    parser.add_argument("--max_len", type=int, default=2048, help="most tokens per text (the last ones are kept)")
    parser.add_argument("--bf16", action="store_true", help="load the model in bfloat16")
    parser.add_argument("--attn_implementation", default=None, help="attention kernel (default as in training)")
    parser.add_argument("--trust_remote_code", action="store_true", help="allow model code shipped in the folder")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    add_http_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("batch_size", "max_len"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    try:
        settings = settings_from_flags(args)
    except ValueError as err:
        parser.error(str(err))
    problem = address_problem(args.host, args.port)
    if problem:
        parser.error(problem)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from lightrft.models import RewardModel
    from lightrft.models.vocabulary import check_vocabulary
    from lightrft.models.tokenizer import build_tokenizer

    try:
        model = RewardModel(args.reward_pretrain, value_head_prefix=args.value_head_prefix,
                            normalize_reward=args.normalize_reward, bf16=args.bf16,
                            attn_implementation=args.attn_implementation, trust_remote_code=args.trust_remote_code)
        tokenizer = build_tokenizer(args.reward_pretrain, args.trust_remote_code, flag="--reward_pretrain")
    except (OSError, ValueError) as err:       # missing folder, no value head: named by the loaders
        parser.error(str(err))
    try:
        check_vocabulary(model, tokenizer, f"--reward_pretrain {args.reward_pretrain}")
    except ValueError as err:
        parser.error(str(err))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    scorer = RewardScorer(model, tokenizer, batch_size=args.batch_size, max_len=args.max_len, device=device)
    try:
        server = build_server(scorer, args.host, args.port, settings)
    except OSError as err:                     # taken since address_problem looked
        parser.error(bind_error(args.host, args.port, err))
    host, port = server.server_address[:2]
    warn_if_exposed(args.host, settings, "score texts with the reward model")
    key = ", API key required" if settings.api_key else ""
    print(f"serve_rm: scoring with {args.reward_pretrain} on http://{host}:{port} (POST texts, GET /health{key})",
          flush=True)
    freeze_loaded_objects()
    try:
        server.serve_forever()                 # until SIGINT or SIGTERM (a job scheduler, `kill`)
    finally:
        server.server_close()


if __name__ == "__main__":
    run_program(main, sys.argv[1:])
