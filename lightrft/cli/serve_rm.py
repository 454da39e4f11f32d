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

import torch

from lightrft.serving.http import add_http_flags, address_problem, bind_error, settings_from_flags, warn_if_exposed
from lightrft.serving.reward_server import RewardScorer, build_server
from lightrft.serving.server import freeze_loaded_objects
from lightrft.utils.program import run_program

# RewardScorer and build_server live in lightrft.serving.reward_server; named here as before.
__all__ = ["RewardScorer", "build_parser", "build_server", "main"]


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
