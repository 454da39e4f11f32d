"""Serve a trained reward model over HTTP.

    python -m lightrft.cli.serve_rm --reward_pretrain ./ckpt/rm --port 5000

POST (any path, e.g. /get_reward) a JSON object {"query": [full texts], "prompts": [...],
"labels": [...]} and get {"rewards": [float, ...]}, one score per query, in order. This is what
`train_ppo --remote_rm_url http://host:port/get_reward` sends; only "query" is read. GET /health
answers {"status": "ok"}. A malformed request gets a 4xx JSON {"error": "..."} naming the field,
and the server keeps serving. It binds to 127.0.0.1 unless --host says otherwise.

Each query is tokenized as in reward-model training (`encode_for_reward`: EOS appended), cut to
its last --max_len tokens (the score is read at the end), and scored in batches of --batch_size.
"""

import argparse
import json
import logging
import signal
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from lightrft.datasets import encode_for_reward
from lightrft.datasets.padding import right_pad
from lightrft.utils.http import send_json

logger = logging.getLogger("lightrft.serve_rm")
MAX_BODY_BYTES = 64 * 1024 * 1024


class RequestError(ValueError):
    """A client mistake: answered with `status` and the message, never a server crash."""

    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


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


def parse_request(body: bytes) -> list[str]:
    """The "query" list of a request body; a `RequestError` naming the field otherwise."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(HTTPStatus.BAD_REQUEST, f"the request body is not valid JSON: {e}") from None
    if not isinstance(payload, dict):
        raise RequestError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object like "
                           '{"query": ["full text", ...]}, got a ' + type(payload).__name__)
    if "query" not in payload:
        raise RequestError(HTTPStatus.BAD_REQUEST, "missing field 'query': a list of full texts (prompt + response) "
                           "to score")
    queries = payload["query"]
    if not isinstance(queries, list):
        raise RequestError(HTTPStatus.BAD_REQUEST,
                           f"field 'query' must be a list of strings, got {type(queries).__name__}")
    for i, query in enumerate(queries):
        if not isinstance(query, str):
            raise RequestError(HTTPStatus.BAD_REQUEST,
                               f"field 'query[{i}]' must be a string, got {type(query).__name__}")
    return queries


def make_handler(scorer: RewardScorer) -> type[BaseHTTPRequestHandler]:
    class RewardHandler(BaseHTTPRequestHandler):
        server_version = "lightrft-serve-rm"
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/health":
                self._reply(HTTPStatus.OK, {"status": "ok"})
            else:
                self._reply(HTTPStatus.NOT_FOUND, {"error": f"no GET route {self.path}; POST texts to score, or "
                                                            "GET /health"})

        def do_POST(self) -> None:
            try:
                queries = parse_request(self._read_body())
            except RequestError as e:
                self._reply(e.status, {"error": str(e)})
                return
            try:
                rewards = scorer.score(queries)
            except Exception as e:  # a failed forward answers this request and leaves the server up
                logger.exception("scoring failed")
                self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"scoring failed: {type(e).__name__}: {e}"})
                return
            self._reply(HTTPStatus.OK, {"rewards": rewards})

        def _read_body(self) -> bytes:
            length = self.headers.get("Content-Length")
            if length is None:
                raise RequestError(HTTPStatus.LENGTH_REQUIRED, "the request needs a Content-Length header")
            try:
                length = int(length)
            except ValueError:
                raise RequestError(HTTPStatus.BAD_REQUEST, f"bad Content-Length header {length!r}") from None
            if length > MAX_BODY_BYTES:
                raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                   f"the body is {length} bytes, over the {MAX_BODY_BYTES} byte limit; "
                                   "send fewer queries per request")
            return self.rfile.read(length)

        def _reply(self, status: HTTPStatus, payload: dict) -> None:
            send_json(self, status, payload)

        def log_message(self, format: str, *args) -> None:
            logger.info("%s %s", self.address_string(), format % args)

    return RewardHandler


def build_server(scorer: RewardScorer, host: str = "127.0.0.1", port: int = 5000) -> ThreadingHTTPServer:
    """An HTTP server bound to (host, port) answering with `scorer`; port 0 picks a free port
    (read it back from `server.server_address`). Call `serve_forever()` to run it."""
    server = ThreadingHTTPServer((host, port), make_handler(scorer))
    server.daemon_threads = True
    return server


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
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("batch_size", "max_len"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from lightrft.builders.tokenizer import build_tokenizer
    from lightrft.models import RewardModel
    from lightrft.models.vocabulary import check_vocabulary

    model = RewardModel(args.reward_pretrain, value_head_prefix=args.value_head_prefix,
                        normalize_reward=args.normalize_reward, bf16=args.bf16,
                        attn_implementation=args.attn_implementation, trust_remote_code=args.trust_remote_code)
    tokenizer = build_tokenizer(args.reward_pretrain, args.trust_remote_code)
    try:
        check_vocabulary(model, tokenizer, f"--reward_pretrain {args.reward_pretrain}")
    except ValueError as err:
        parser.error(str(err))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    scorer = RewardScorer(model, tokenizer, batch_size=args.batch_size, max_len=args.max_len, device=device)
    server = build_server(scorer, args.host, args.port)
    host, port = server.server_address[:2]
    # SIGTERM (from a job scheduler or `kill`) stops serving cleanly, like Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(f"serve_rm: scoring with {args.reward_pretrain} on http://{host}:{port} (POST texts, GET /health)",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main(sys.argv[1:])
