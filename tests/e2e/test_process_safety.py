"""Processes that cannot corrupt or outlive a run, with real `torchrun` on 2 CPU ranks (train_sft,
the quickest training command; the lifeline and the lock live in `run_command`, shared by all three):

- `kill -9` of torchrun alone (what a scheduler or a closed terminal does) stops every rank: each
  notices that its launcher is gone, saves a checkpoint and exits; the folder's lock is free again.
- a second run started on the same `--ckpt_path` is refused with a message naming the folder and
  the holder, while the first one goes on and finishes normally.
- after a run is killed outright (every process, like a lost node), the same command line with
  `--load_checkpoint if_present` takes its lock over and resumes from its last checkpoint.

Bounds on time here are liveness bounds (a process must be gone at all), not performance figures.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lightrft.datasets.toy import arithmetic_splits, write_jsonl
from lightrft.utils.run_lock import LOCK_NAME, RunLock, RunLockError, read_record
from lightrft.utils.tiny import save_tiny_model
from tests.conftest import REPO_ROOT, free_port, subprocess_env

pytestmark = pytest.mark.dist

LIVENESS_BOUND_S = 60.0


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("process_safety")
    rows, _ = arithmetic_splits(n_train=160, n_eval=8, seed=0)
    return {"model": save_tiny_model(root / "base", seed=0), "data": write_jsonl(rows, root / "train.jsonl")}


def sft_command(task, out: Path, epochs: int, *extra) -> list[str]:
    """torchrun train_sft on 2 ranks: 160 rows / 32 per step = 5 steps per epoch, a checkpoint
    every 2 steps."""
    args = ["-m", "lightrft.cli.train_sft", "--pretrain", task["model"], "--dataset", task["data"],
            "--input_key", "input", "--output_key", "output", "--max_len", 16, "--zero_stage", 2,
            "--max_epochs", epochs, "--train_batch_size", 32, "--micro_train_batch_size", 8,
            "--learning_rate", 1e-3, "--lr_warmup_ratio", 0, "--seed", 1, "--save_path", out / "model",
            "--ckpt_path", out / "ckpt", "--save_steps", 2, "--max_ckpt_num", 2, "--preemption_grace", 30, *extra]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), *[str(a) for a in args]]


class Launch:
    """A torchrun started in the background, its output in files (a pipe would block the ranks
    once torchrun, its reader, is gone)."""

    def __init__(self, cmd: list[str], out: Path, name: str):
        out.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = out / f"{name}.out", out / f"{name}.err"
        with open(self.stdout_path, "w") as stdout, open(self.stderr_path, "w") as stderr:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=subprocess_env(), stdout=stdout, stderr=stderr)
        self.workers: list[int] = []
        self.helpers: list[int] = []        # the ranks' own children (each rank's preemption watcher)

    def output(self) -> str:
        return self.stdout_path.read_text() + "\n" + self.stderr_path.read_text()

    def wait_for(self, condition, what: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            if self.proc.poll() is not None:
                pytest.fail(f"torchrun exited with {self.proc.returncode} before {what}:\n{self.output()[-6000:]}")
            time.sleep(0.1)
        pytest.fail(f"no {what} within {timeout} s:\n{self.output()[-6000:]}")

    def find_workers(self) -> list[int]:
        ranks = psutil.Process(self.proc.pid).children()
        self.workers = [p.pid for p in ranks]
        assert len(self.workers) == 2, f"expected 2 rank processes under torchrun, found {self.workers}"
        self.helpers = [child.pid for rank in ranks for child in rank.children(recursive=True)]
        return self.workers

    def kill_all(self) -> None:
        for pid in [self.proc.pid, *self.workers, *self.helpers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        deadline = time.monotonic() + LIVENESS_BOUND_S
        while any(alive(pid) for pid in self.workers + self.helpers) and time.monotonic() < deadline:
            time.sleep(0.05)


@pytest.fixture
def launches():
    started: list[Launch] = []
    yield started
    for launch in started:  # nothing a test started may outlive it
        try:
            launch.find_workers()
        except (AssertionError, psutil.NoSuchProcess):
            pass
        launch.kill_all()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def has_checkpoint(ckpt: Path, step: int) -> bool:
    return (ckpt / "latest").exists() and int((ckpt / "latest").read_text().strip().removeprefix("global_step")) >= step


def summary(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{") and "stop_reason" in line][-1])


def test_killing_torchrun_stops_every_rank(task, tmp_path, launches):
    out = tmp_path / "orphans"
    run = Launch(sft_command(task, out, epochs=20000), out, "run")  # 100000 steps: hours
    launches.append(run)
    run.wait_for(lambda: has_checkpoint(out / "ckpt", 2), "checkpoint at step 2")
    workers = run.find_workers()

    os.kill(run.proc.pid, signal.SIGKILL)  # torchrun alone, as a scheduler or a closed terminal does
    killed_at = time.monotonic()
    run.proc.wait()
    while any(alive(pid) for pid in workers) and time.monotonic() - killed_at < LIVENESS_BOUND_S:
        time.sleep(0.1)
    took = time.monotonic() - killed_at
    left = [pid for pid in workers if alive(pid)]
    assert not left, f"rank processes {left} still running {LIVENESS_BOUND_S} s after torchrun was killed"
    while any(alive(pid) for pid in run.helpers) and time.monotonic() - killed_at < LIVENESS_BOUND_S:
        time.sleep(0.1)
    assert run.helpers and not [pid for pid in run.helpers if alive(pid)], "a rank's helper process outlived it"
    print(f"\nboth ranks exited {took:.1f} s after torchrun was killed")

    text = run.output()
    assert text.count("the launcher (pid") == 2, text[-4000:]  # each rank noticed
    assert "exiting now with code 143" not in text  # they stopped by saving, not by the hard deadline
    # The step in progress was finished and saved: the newest checkpoint is the step they stopped at.
    latest = (out / "ckpt" / "latest").read_text().strip()
    stopped_at = summary(text)["step"]
    assert summary(text)["stop_reason"] == "preempted" and latest == f"global_step{stopped_at}", (latest, stopped_at)
    with RunLock(out / "ckpt") as lock:  # no orphan holds the folder
        assert lock.taken_over is None  # rank 0 released it on its way out


def test_rank_left_alone_when_torchrun_and_its_peer_die_still_exits(task, tmp_path, launches):
    # No peer is left to finish a step or a save with. On one host gloo sees the peer's connection
    # reset and the survivor's collective fails at once; across hosts it may wait instead, which the
    # lifeline's deadline (here min(--preemption_grace, 60) = 20 s) ends: tests/utils/test_lifeline.py.
    out = tmp_path / "alone"
    run = Launch(sft_command(task, out, 20000, "--preemption_grace", 20), out, "run")
    launches.append(run)
    run.wait_for(lambda: has_checkpoint(out / "ckpt", 2), "checkpoint at step 2")
    survivor, peer = run.find_workers()
    for pid in (run.proc.pid, peer):
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    run.proc.wait()
    while alive(survivor) and time.monotonic() - killed_at < LIVENESS_BOUND_S:
        time.sleep(0.1)
    assert not alive(survivor), f"rank {survivor} still running {LIVENESS_BOUND_S} s after torchrun and its peer died"
    print(f"\nthe surviving rank exited {time.monotonic() - killed_at:.1f} s after torchrun and its peer were killed")
    # The killed peer (it may be rank 0, the lock's holder, finishing a write in the kernel) and any
    # helper process a rank started are gone too before the folder is checked.
    while any(alive(pid) for pid in [peer, *run.helpers]) and time.monotonic() - killed_at < LIVENESS_BOUND_S:
        time.sleep(0.1)
    assert not [pid for pid in [peer, *run.helpers] if alive(pid)], (peer, run.helpers)
    # Whichever came first names it: the lifeline (the launcher is gone) or gloo (the peer is gone).
    output = run.output()
    assert "the launcher (pid" in output or "Check the logs of the remote worker" in output, output[-3000:]
    # Whoever held the folder, it is free again within the same bound (seen once under a loaded
    # suite: still held right after the last holder was gone, free a moment later).
    deadline = time.monotonic() + LIVENESS_BOUND_S
    while True:
        try:
            with RunLock(out / "ckpt"):
                break
        except RunLockError:
            if time.monotonic() > deadline:
                raise AssertionError(f"the checkpoint folder is still locked {LIVENESS_BOUND_S} s after the run died; "
                                     f"the run's processes with the lock file open: "
                                     f"{lock_holders(out / 'ckpt', [*run.workers, *run.helpers])}") from None
            time.sleep(0.2)


def lock_holders(folder: Path, pids: list[int]) -> list:
    """(pid, status, command) of those of `pids` (a run's own processes) with `folder`'s lock file open."""
    path, found = str(folder / LOCK_NAME), []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if any(f.path == path for f in process.open_files()):
                found.append((pid, process.status(), " ".join(process.cmdline())[:200]))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def test_second_run_on_the_same_folder_is_refused_and_the_first_finishes(task, tmp_path, launches):
    out = tmp_path / "two_writers"
    first = Launch(sft_command(task, out, epochs=4), out, "first")
    launches.append(first)
    first.wait_for(lambda: (read_record(out / "ckpt" / LOCK_NAME) or {}).get("pid"), "lock taken by rank 0")
    holder = read_record(out / "ckpt" / LOCK_NAME)

    # The first run's ranks are paused while the second starts, so the first still holds the folder
    # however long the second's start takes (20 tiny steps can end before another run's imports do
    # on a busy machine, and that run then rightly trains).
    ranks = first.find_workers()
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    try:
        second = subprocess.run(sft_command(task, out, epochs=4), cwd=REPO_ROOT, env=subprocess_env(),
                                capture_output=True, text=True, timeout=300)
    finally:
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
    assert second.returncode != 0
    message = f"{out / 'ckpt'} (--ckpt_path) is in use by another run: pid {holder['pid']} on host"
    assert message in second.stderr, second.stderr[-4000:]
    assert "train_sft: error:" in second.stderr and "run_lock.py" not in second.stderr  # one message, no traceback

    assert first.proc.poll() is None or first.proc.returncode == 0  # the first run goes on
    assert first.proc.wait(timeout=600) == 0, first.output()[-6000:]
    assert summary(first.output())["stop_reason"] == "finished"
    assert summary(first.output())["step"] == 20
    assert read_record(out / "ckpt" / LOCK_NAME) is None  # released at exit


def test_lock_of_a_killed_run_is_taken_over_and_the_same_command_resumes(task, tmp_path, launches):
    out = tmp_path / "restart"
    command = sft_command(task, out, 2, "--load_checkpoint", "if_present")  # the same for every launch
    first = Launch(command, out, "first")
    launches.append(first)
    first.wait_for(lambda: has_checkpoint(out / "ckpt", 2), "checkpoint at step 2")
    first.find_workers()
    first.kill_all()  # every process, as when a node is lost: no clean release
    dead_holder = read_record(out / "ckpt" / LOCK_NAME)
    assert dead_holder and not alive(dead_holder["pid"])
    resumed_from = (out / "ckpt" / "latest").read_text().strip()

    again = subprocess.run(command, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-6000:]
    assert f"taking over the lock left by a run that is no longer running (pid {dead_holder['pid']}" in again.stderr
    assert f"resumed from {out / 'ckpt' / resumed_from}" in again.stdout
    assert summary(again.stdout)["step"] == 10 and summary(again.stdout)["stop_reason"] == "finished"


# Each rank's first reward call hangs (a grader stuck on a pathological answer); later calls score.
FIRST_CALL_HANGS = """
import os, time
from pathlib import Path

def reward_func(queries, prompts, labels):
    marker = Path(__file__).with_name(f"called-rank{os.environ['RANK']}")
    if not marker.exists():
        marker.write_text("")
        time.sleep(3600)
    return [1.0 if q[len(p):].strip().startswith(str(l)) else 0.0 for q, p, l in zip(queries, prompts, labels)]
"""


def grpo_command(task, out: Path, reward_file: Path, on_failure: str) -> list:
    """train_ppo GRPO on 2 ranks for 2 steps: 4 prompts x 4 samples per step, 8 samples per rank."""
    args = ["-m", "lightrft.cli.train_ppo", "--pretrain", task["model"], "--prompt_data", task["data"],
            "--input_key", "input", "--label_key", "label", "--remote_rm_url", reward_file,
            "--reward_timeout", 3, "--reward_on_failure", on_failure, "--advantage_estimator", "group_norm",
            "--n_samples_per_prompt", 4, "--rollout_batch_size", 4, "--micro_rollout_batch_size", 8,
            "--train_batch_size", 16, "--micro_train_batch_size", 8, "--generate_max_len", 4,
            "--prompt_max_len", 16, "--init_kl_coef", 0, "--max_steps", 2, "--zero_stage", 2, "--seed", 0,
            "--save_path", out / "model", "--ckpt_path", out / "ckpt", "--use_tensorboard", out / "tb"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), *[str(a) for a in args]]


def test_hanging_reward_file_is_timed_out_dropped_and_logged(task, tmp_path):
    from tests.e2e.conftest import tensorboard_scalars

    out = tmp_path / "drop"
    out.mkdir()
    reward_file = out / "reward.py"
    reward_file.write_text(FIRST_CALL_HANGS)
    run = subprocess.run(grpo_command(task, out, reward_file, "drop"), cwd=REPO_ROOT, env=subprocess_env(),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-6000:]
    assert summary(run.stdout)["stop_reason"] == "max_steps" and summary(run.stdout)["step"] == 2
    scalars = {tag: values[-1][1] for tag, values in tensorboard_scalars(out / "tb").items()}
    # Summed over both ranks after 2 steps: each rank's first call timed out (8 samples dropped)
    # and its worker was replaced; the second calls scored.
    assert scalars["rollout/reward_source0_timeouts"] == 2
    assert scalars["rollout/reward_source0_dropped"] == 16
    assert scalars["rollout/reward_source0_restarts"] == 2
    assert scalars["rollout/reward_source0_calls"] == 4
    assert scalars["rollout/reward_source0_crashes"] == scalars["rollout/reward_source0_errors"] == 0


def test_hanging_reward_file_under_error_policy_stops_the_run_naming_it(task, tmp_path):
    out = tmp_path / "error"
    out.mkdir()
    reward_file = out / "reward.py"
    reward_file.write_text("import time\n\ndef reward_func(queries, prompts, labels):\n    time.sleep(3600)\n")
    run = subprocess.run(grpo_command(task, out, reward_file, "error"), cwd=REPO_ROOT, env=subprocess_env(),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode != 0
    assert (f"train_ppo: error: reward_func in {reward_file}: no answer within timeout=3.0s (--reward_timeout)"
            in run.stderr), run.stderr[-6000:]
