"""Shared test fixtures: a torchrun launcher for multi-rank CPU tests, the GPU marker gate, and the
check that lightrft code raises no FutureWarning or DeprecationWarning (tests/deprecations.py)."""

import json
import importlib.util
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.deprecations import LightrftDeprecations

REPO_ROOT = Path(__file__).resolve().parent.parent


def _without_lightrft_deprecations(phase: str, item):
    """Runs one phase of a test under `LightrftDeprecations`: a FutureWarning or DeprecationWarning
    raised from lightrft code fails it (tests/deprecations.py)."""
    with LightrftDeprecations() as check:
        result = yield
    if check.found:
        pytest.fail(f"lightrft code made deprecated calls during {phase} of {item.nodeid}; use the current API:\n  "
                    + "\n  ".join(dict.fromkeys(check.found)), pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _without_lightrft_deprecations("setup", item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _without_lightrft_deprecations("the test", item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    return (yield from _without_lightrft_deprecations("teardown", item))


# Under pytest-xdist (`-n 2` in pytest.ini) each worker takes whole files (`--dist loadfile`, so a
# module's fixtures are built once) in the order collected here: the end-to-end and real-model
# files first, then the other files that launch ranks, then the rest, so the longest files never
# start last and leave one worker idle at the end. The workers share the cores: each takes its
# part of them for torch's own threads (the ranks a test launches get one each, subprocess_env).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORKERS))


def _file_tier(items) -> int:
    """0 for tests/e2e and tests/real_model, 1 for another file with a `dist` test, else 2."""
    parts = items[0].path.relative_to(REPO_ROOT).parts if items[0].path.is_relative_to(REPO_ROOT) else ()
    if parts[:2] in (("tests", "e2e"), ("tests", "real_model")):
        return 0
    return 1 if any("dist" in item.keywords for item in items) else 2


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    by_file: dict = {}
    for item in items:
        by_file.setdefault(item.path, []).append(item)
    order = sorted(by_file.values(), key=_file_tier)      # stable: collection order within a tier
    items[:] = [item for file_items in order for item in file_items]
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def load_file_module(path, name: str | None = None):
    """The Python file at `path` as a module (not put in sys.modules), for the pure functions of
    scripts under benchmarks/ and tools/ and of files a test writes."""
    spec = importlib.util.spec_from_file_location(name or Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _port_block() -> range:
    """This process's ports for `free_port`: below the kernel's ephemeral range (the one that port-0
    binds and outgoing connections draw from, so no server or connection of a run takes them), one
    block per pytest-xdist worker (so the other worker never picks the same one)."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low = 20000
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    span = (ephemeral_low - low) // max(WORKERS, index + 1)
    return range(low + index * span, low + (index + 1) * span) if span >= 100 else range(0)


_PORTS = _port_block()
_next_port = random.Random().randrange(len(_PORTS)) if _PORTS else 0   # its own generator: tests seed the global one


def free_port() -> int:
    """A port for a launcher or server a test starts. Taken in turn from this worker's block and
    checked free by a bind, so a port a recent test used is not handed out again at once; a port
    picked by binding port 0 could be taken by another test's connection before the launcher binds
    it (it happened: EADDRINUSE under two workers)."""
    global _next_port
    for _ in range(len(_PORTS)):
        port = _PORTS[_next_port % len(_PORTS)]
        _next_port += 1
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:           # no block (a small ephemeral range) or all in use
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def subprocess_env(**extra: str) -> dict:
    """The environment for a child process: this checkout first on the path, one thread per rank,
    no network for Hugging Face or W&B, and no GPU unless a test asks for one (the multi-rank CPU
    tests would otherwise put rank 1 on a second GPU that a one-GPU machine does not have)."""
    env = dict(os.environ)
    # A test that ran a one-rank strategy in this process left the launcher variables behind.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["HF_DATASETS_OFFLINE"] = "1"
    env["WANDB_MODE"] = "offline"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    env.update(extra)
    return env


def run_torchrun(args, nproc: int = 2, timeout: int = 600, env: dict | None = None, check: bool = True,
                 module: bool = False, gpu: bool = False) -> subprocess.CompletedProcess:
    """Runs `torchrun --nproc_per_node nproc [-m] args...` on 127.0.0.1 and returns the finished
    process. With check=True a non-zero exit fails the test with the tail of the output. GPUs are
    hidden from the ranks unless `gpu=True`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    if module:
        cmd.append("-m")
    cmd += [str(a) for a in args]
    child_env = subprocess_env(**(env or {}))
    if gpu and "CUDA_VISIBLE_DEVICES" not in (env or {}):
        child_env.pop("CUDA_VISIBLE_DEVICES", None)
        if "CUDA_VISIBLE_DEVICES" in os.environ:
            child_env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"torchrun exited with {proc.returncode}\ncommand: {' '.join(cmd)}\n"
                    f"--- stdout (tail) ---\n{proc.stdout[-6000:]}\n--- stderr (tail) ---\n{proc.stderr[-8000:]}")
    return proc


def run_torchrun_many(runs: list, folder: Path, nproc: int = 2, timeout: int = 600,
                      env: dict | None = None) -> list[str]:
    """Runs several train_ppo flag lists one after another in one `torchrun` launch
    (tests/e2e/run_many.py: each run builds and closes everything, as its own launch would; the
    ranks' imports are paid once) and returns each run's stdout. A run is a flag list, a pair
    (flags, {variable: value}) whose variables are set for that run only, or a dict with "argv",
    optionally "env" and "cli" (another `lightrft.cli` command, such as "train_sft"). The runs'
    list is written to `folder`."""
    from tests.e2e.run_many import MARKER

    def entry(run) -> dict:
        if not isinstance(run, dict):
            run = dict(zip(("argv", "env"), run)) if isinstance(run, tuple) else {"argv": run}
        return {"port": free_port(), "argv": [str(a) for a in run["argv"]], "cli": run.get("cli", "train_ppo"),
                "env": {k: str(v) for k, v in run.get("env", {}).items()}}

    spec = Path(folder) / "runs.json"
    spec.write_text(json.dumps([entry(run) for run in runs]))
    proc = run_torchrun(["tests/e2e/run_many.py", spec], nproc=nproc, timeout=timeout, env=env)
    # A marker may share its line with output another process wrote without a newline (a
    # progress bar's carriage returns, an engine process's log): split on the marker itself.
    outputs = []
    rest = proc.stdout
    while (at := rest.find(MARKER.format(len(outputs)))) >= 0:
        if outputs:
            outputs[-1] += rest[:at]
        rest = rest[at + len(MARKER.format(len(outputs))):].removeprefix("\n")
        outputs.append("")
    if outputs:
        outputs[-1] += rest
    if len(outputs) != len(runs):
        pytest.fail(f"run_many printed {len(outputs)} of {len(runs)} run markers\n{proc.stdout[-4000:]}")
    return outputs


def to_flags(values: dict) -> list[str]:
    """Command-line arguments from {flag: value}: None or False drops a flag, True makes a bare
    switch, a list or tuple gives several values, and a string with spaces is split into them."""
    args = []
    for key, value in values.items():
        if value is None or value is False:
            continue
        args.append(f"--{key}")
        if isinstance(value, (list, tuple)):
            args += [str(v) for v in value]
        elif value is not True:
            args += str(value).split(" ") if isinstance(value, str) else [str(value)]
    return args


def read_json_lines(path: Path) -> list:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture
def torchrun():
    return run_torchrun
