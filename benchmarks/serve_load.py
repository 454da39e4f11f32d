"""`serve` under concurrent clients: requests/s and latency percentiles with 1, 8 and 32 clients.

The server is `lightrft.cli.serve`'s own (`build_server` over a `ServedPolicy`), on a tiny
Qwen2-shaped policy built in code, in this process, on a free port of 127.0.0.1. Each client is a
thread with its own `httpx.Client` (one keep-alive connection) sending `/v1/completions` requests
(a short prompt, --max_tokens new tokens, a seed per request) back to back for --seconds.
Reported per client count: completed requests/s, p50 and p99 latency, errors; and the latency of
`GET /health` sent while the generating clients run, which shows whether the server answers other
clients while it generates. Each --max_batch_prompts setting (serve's flag: requests waiting with
the same sampling options are generated in one engine call of at most that many prompts; 1 is one
request at a time) gets its own server and rows.

The figures are the "before" of the server's move to an ASGI stack (issue: HTTP on kept
libraries); run it again after. A benchmark, not a test: nothing asserts on time.

    python benchmarks/serve_load.py [--clients 1 8 32 --seconds 10 --max_tokens 8 --max_batch_prompts 1 16
                                     --json OUT]
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import torch  # noqa: E402

from lightrft.models.tokenizer import build_tokenizer, stop_token_ids  # noqa: E402
from lightrft.serving.http import HTTPSettings, longest_token_chars  # noqa: E402
from lightrft.serving.openai_api import OpenAIServer, ServeLimits, build_server  # noqa: E402
from lightrft.serving.policy import ServedPolicy  # noqa: E402
from lightrft.utils.tiny import save_tiny_model  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def load(url: str, clients: int, seconds: float, max_tokens: int) -> dict:
    """`clients` threads posting completions for `seconds`, plus one thread timing /health."""
    latencies, health, errors = [], [], [0]
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds
    started = threading.Barrier(clients + 1)

    def client(k: int) -> None:
        with httpx.Client(base_url=url, timeout=60.0) as http:
            started.wait()
            i = 0
            while time.monotonic() < stop_at:
                begin = time.monotonic()
                try:
                    reply = http.post("/v1/completions", json={"prompt": f"{k}+{i}=", "max_tokens": max_tokens,
                                                               "seed": k * 100_000 + i})
                    ok = reply.status_code == 200
                except httpx.HTTPError:
                    ok = False
                with lock:
                    if ok:
                        latencies.append(time.monotonic() - begin)
                    else:
                        errors[0] += 1
                i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for thread in threads:
        thread.start()
    started.wait()
    begin = time.monotonic()
    with httpx.Client(base_url=url, timeout=60.0) as http:
        while time.monotonic() < stop_at:
            t0 = time.monotonic()
            http.get("/health")
            health.append(time.monotonic() - t0)
            time.sleep(0.2)
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - begin
    return {"clients": clients, "requests": len(latencies), "requests_per_s": len(latencies) / elapsed,
            "p50_s": percentile(latencies, 0.5), "p99_s": percentile(latencies, 0.99), "errors": errors[0],
            "health_p50_s": percentile(health, 0.5), "health_max_s": max(health, default=float("nan"))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--max_tokens", type=int, default=8)
    parser.add_argument("--max_batch_prompts", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        model = save_tiny_model(Path(root) / "model", seed=0)
        tokenizer = build_tokenizer(str(model), False)
        for batch in args.max_batch_prompts:
            policy = ServedPolicy(model, tokenizer, stop_token_ids(tokenizer, str(model)), max_batch_prompts=batch)
            limits = ServeLimits(args.max_tokens, 64, context_len=policy.context_len,
                                 token_chars=longest_token_chars(tokenizer))
            server = build_server(OpenAIServer(policy, limits, "tiny", seed=0), "127.0.0.1", 0,
                                  HTTPSettings(max_connections=64))
            thread = threading.Thread(target=server.serve_forever, daemon=True)
            thread.start()
            url = f"http://127.0.0.1:{server.server_address[1]}"
            try:
                load(url, 1, min(2.0, args.seconds), args.max_tokens)            # warm-up
                for n in args.clients:
                    rows.append({"max_batch_prompts": batch, **load(url, n, args.seconds, args.max_tokens),
                                 "engine_calls": policy.batches})
            finally:
                server.shutdown()
                server.server_close()
    print(f"serve (threaded http.server), tiny Qwen2 policy, {args.max_tokens} new tokens per request, "
          f"{args.seconds:g} s per row; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch threads {args.threads}")
    print("| max_batch_prompts | clients | requests/s | p50 s | p99 s | errors | /health p50 s | /health max s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['max_batch_prompts']} | {row['clients']} | {row['requests_per_s']:.1f} | {row['p50_s']:.3f} | "
              f"{row['p99_s']:.3f} | {row['errors']} | {row['health_p50_s']:.4f} | {row['health_max_s']:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
