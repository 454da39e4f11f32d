"""`serve` under concurrent clients: requests/s and latency percentiles with 1, 8 and 32 clients.

The server is `python -m lightrft.cli.serve` in its own process, as a user starts it, on a tiny
Qwen2-shaped policy built in code, on a free port of 127.0.0.1 (the checkout this script lies in
is the lightrft it runs: copy the script into another checkout to measure that one). Each client
is a thread of this process with its own `httpx.Client` (one keep-alive connection) sending
`/v1/completions` requests (a short prompt, --max_tokens new tokens, a seed per request) back to
back for --seconds.
Reported per client count: completed requests/s, p50 and p99 latency, errors; and the latency of
`GET /health` sent while the generating clients run, which shows whether the server answers other
clients while it generates. Each --max_batch_prompts setting (serve's flag: requests waiting with
the same sampling options are generated in one engine call of at most that many prompts; 1 is one
request at a time) gets its own server and rows.

A benchmark, not a test: nothing asserts on time.

    python benchmarks/serve_load.py [--clients 1 8 32 --seconds 10 --max_tokens 8 --max_batch_prompts 1 16
                                     --json OUT]
"""

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

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


def start_server(model: Path, batch: int, max_tokens: int, threads: int) -> tuple[subprocess.Popen, str]:
    """`python -m lightrft.cli.serve` on a free port, as a user starts it; (process, base URL).
    The checkout this script lies in is the lightrft it runs."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "lightrft.cli.serve", "--pretrain", str(model), "--port", "0", "--device", "cpu",
           "--generate_max_len", str(max_tokens), "--prompt_max_len", "64", "--max_batch_prompts", str(batch),
           "--seed", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise SystemExit(f"serve did not start: {line!r}")
    return proc, "http://" + line.split("http://")[1].split()[0].rstrip(",").removesuffix("/v1")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--max_tokens", type=int, default=8)
    parser.add_argument("--max_batch_prompts", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        model = save_tiny_model(Path(root) / "model", seed=0)
        for batch in args.max_batch_prompts:
            proc, url = start_server(model, batch, args.max_tokens, args.threads)
            try:
                load(url, 1, min(2.0, args.seconds), args.max_tokens)            # warm-up
                for n in args.clients:
                    rows.append({"max_batch_prompts": batch, **load(url, n, args.seconds, args.max_tokens)})
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
    print(f"lightrft.cli.serve, tiny Qwen2 policy, {args.max_tokens} new tokens per request, {args.seconds:g} s per "
          f"row; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, server torch threads "
          f"{args.threads}")
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
