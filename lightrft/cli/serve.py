"""Serve the policy as an OpenAI-compatible HTTP server, record what it answers, and reload the
weights a training run exports.

    python -m lightrft.cli.serve --pretrain ./ckpt/model --port 8000 --record ./served \
        --watch ./ckpt/checkpoints --watch_interval 10

Agent applications point an OpenAI client at http://127.0.0.1:8000/v1 (`/v1/completions`,
`/v1/chat/completions`, `stream` supported; the API key is $LIGHTRFT_API_KEY or --api_key when the
server has one, anything otherwise). With --record DIR every response is
stored in DIR/experiences.jsonl (token ids, sampling log-probs, policy version); `POST
/v1/feedback {"id": "<response id>", "reward": 1.0}` attaches a reward, and `train_ppo
--recorded_data DIR` trains on the rewarded ones. With --watch DIR the server loads the newest
Hugging Face export there (train_ppo --save_hf_ckpt writes <ckpt_path>/global_stepN_hf: policy
version N; a plain model folder such as --save_path is reloaded whenever it is replaced). Every
response names its policy version in `system_fingerprint` ("lightrft-policy-v<N>"). It binds to
127.0.0.1 unless --host says otherwise; anyone who can reach the port can send rewards that training
uses, so give it an API key before exposing it.
"""

import argparse
import logging
import math
import sys
from pathlib import Path

from lightrft.serving.http import (add_http_flags, address_problem, bind_error, settings_from_flags,
                                   warn_if_exposed)
from lightrft.utils.program import run_program


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightrft.cli.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrain", required=True,
                        help="Hugging Face folder of the policy (config, weights and tokenizer)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind; 0.0.0.0 exposes the server to the network")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port, printed)")
    parser.add_argument("--served_model_name", default=None,
                        help="the model name in responses and /v1/models (default: the --pretrain folder's name)")
    parser.add_argument("--record", default=None,
                        help="folder to record every response in (experiences.jsonl) and take rewards for them "
                             "(POST /v1/feedback, feedback.jsonl); train_ppo --recorded_data reads it")
    parser.add_argument("--watch", default=None,
                        help="folder to load new weights from: the newest global_stepN_hf export in it (train_ppo "
                             "--ckpt_path with --save_hf_ckpt), or a model folder reloaded when replaced")
    parser.add_argument("--watch_interval", type=float, default=10.0, help="seconds between looks at --watch")
    parser.add_argument("--generate_max_len", type=int, default=1024,
                        help="most new tokens per response, and the default max_tokens")
    parser.add_argument("--prompt_max_len", type=int, default=4096, help="most prompt tokens per request")
    parser.add_argument("--max_batch_prompts", type=int, default=16,
                        help="requests with the same sampling options that wait while the policy generates are "
                             "generated together, at most this many prompts per engine call (1: one at a time)")
    parser.add_argument("--seed", type=int, default=42,
                        help="seeds the requests that send none (request k draws from a seed mixed from it and k)")
    parser.add_argument("--bf16", action="store_true", help="load the model in bfloat16")
    parser.add_argument("--attn_implementation", default=None, help="attention kernel (default: transformers')")
    parser.add_argument("--trust_remote_code", action="store_true", help="allow model code shipped in the folder")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    add_http_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("generate_max_len", "prompt_max_len", "max_batch_prompts"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    if not (args.watch_interval > 0 and math.isfinite(args.watch_interval)):
        parser.error(f"--watch_interval must be a positive number of seconds, got {args.watch_interval}")
    if not (Path(args.pretrain) / "config.json").exists():
        parser.error(f"--pretrain {args.pretrain} is not a Hugging Face model folder (no config.json there)")
    try:
        settings = settings_from_flags(args)
    except ValueError as err:
        parser.error(str(err))
    problem = address_problem(args.host, args.port)
    if problem:
        parser.error(problem)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    import torch

    from lightrft.models.tokenizer import build_tokenizer, stop_token_ids
    from lightrft.serving.http import longest_token_chars
    from lightrft.serving.openai_api import OpenAIServer, ServeLimits, build_server
    from lightrft.serving.policy import ServedPolicy, WeightWatcher
    from lightrft.serving.records import ExperienceRecorder
    from lightrft.serving.server import freeze_loaded_objects
    from lightrft.utils.run_lock import RunLockError

    # The record folder first: a folder another server records into is refused before the model loads.
    try:
        recorder = ExperienceRecorder(args.record) if args.record else None
    except RunLockError as e:
        parser.error(str(e))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        tokenizer = build_tokenizer(args.pretrain, args.trust_remote_code)
        policy = ServedPolicy(args.pretrain, tokenizer, stop_token_ids(tokenizer, args.pretrain), bf16=args.bf16,
                              device=device, attn_implementation=args.attn_implementation,
                              trust_remote_code=args.trust_remote_code, max_batch_prompts=args.max_batch_prompts)
    except (OSError, ValueError) as err:       # a folder that is not a loadable model: named by the loaders
        parser.error(str(err))
    limits = ServeLimits(args.generate_max_len, args.prompt_max_len, context_len=policy.context_len,
                         token_chars=longest_token_chars(tokenizer))
    api = OpenAIServer(policy, limits,
                       args.served_model_name or Path(args.pretrain).resolve().name, seed=args.seed,
                       recorder=recorder)
    watcher = WeightWatcher(policy, args.watch, args.watch_interval).start() if args.watch else None
    try:
        server = build_server(api, args.host, args.port, settings)
    except OSError as err:                     # taken since address_problem looked
        parser.error(bind_error(args.host, args.port, err))
    host, port = server.server_address[:2]
    warn_if_exposed(args.host, settings, "generate with the policy and send rewards that training on --record "
                                         "data will use")
    extras = "".join([f", recording to {args.record}" if args.record else "",
                      f", watching {args.watch}" if args.watch else "",
                      ", API key required" if settings.api_key else ""])
    print(f"serve: policy {args.pretrain} (version {policy.version}) on http://{host}:{port}/v1{extras}", flush=True)
    freeze_loaded_objects()
    try:
        server.serve_forever()                 # until SIGINT or SIGTERM (a job scheduler, `kill`)
    finally:
        if watcher is not None:
            watcher.stop()
        server.server_close()


if __name__ == "__main__":
    run_program(main, sys.argv[1:])
