"""Explorer/trainer roles in one process: the staleness arithmetic, the role layout, the prompt
ledger, and the two channels over real gloo groups (two ranks as two threads of this process)."""

import datetime
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightrft.config import ConfigError, PPORunConfig, RolesConfig
from lightrft.rollout.base import RolloutOutput
from lightrft.explorers.explorer import load_named_weights
from lightrft.explorers.ledger import PromptLedger
from lightrft.explorers.batches import DONE, ExperienceReceiver, FAILED, RolloutBatch
from lightrft.explorers.weights import WeightPublisher, WeightSubscriber, latest_published
from lightrft.explorers.roles import (ControlChannel, ExperienceChannel, LocalChannel, RoleLayout, flatten_tensors,
                                    unflatten_tensors)
from tests.conftest import REPO_ROOT, subprocess_env, to_flags
from tests.strategy.test_checkpoint_io import CreatesFile


# --------------------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize("offset, interval, expected", [
    (0, 1, [0, 1, 2, 3, 4, 5, 6]),        # on-policy: batch b by version b
    (1, 1, [0, 0, 1, 2, 3, 4, 5]),        # one step ahead
    (0, 2, [0, 0, 2, 2, 4, 4, 6]),        # weights every 2 steps
    (1, 2, [0, 0, 0, 2, 2, 4, 4]),
    (2, 3, [0, 0, 0, 0, 0, 3, 3]),
])
def test_each_batch_calls_for_the_newest_sync_point_at_most_offset_behind(offset, interval, expected):
    roles = RolesConfig(explorer_ranks=1, sync_offset=offset, sync_interval=interval)
    versions = [roles.required_version(b) for b in range(7)]
    assert versions == expected
    # Batch b trains at version b: its staleness never passes the bound, and reaches it.
    staleness = [b - v for b, v in enumerate(versions)]
    assert max(staleness) == roles.max_staleness == offset + interval - 1


def config(**flags) -> PPORunConfig:
    values = dict(pretrain="m", prompt_data="p.jsonl", remote_rm_url="math", advantage_estimator="group_norm",
                  n_samples_per_prompt=4, rollout_batch_size=8, train_batch_size=32, **flags)
    return PPORunConfig.from_namespace(PPORunConfig.build_parser("train_ppo").parse_args(to_flags(values)))


def test_what_explorers_cannot_do_is_refused_with_the_flags_and_the_reason():
    with pytest.raises(ConfigError, match="--explorer_ranks 1 cannot be combined with --vllm_tensor_parallel_size > 1 "
                                          r"\(--vllm_tensor_parallel_size > 1: an explorer rank holds a whole vLLM "
                                          "engine"):
        config(explorer_ranks=1, rollout_engine="vllm", vllm_tensor_parallel_size=2)
    for flag, value in (("reward_pretrain", "rm"), ("lora_rank", 8), ("dynamic_sampling", True)):  # explorers too
        assert config(explorer_ranks=1, **{flag: value}).roles.explorer_ranks == 1
        assert config(sync_offset=1, **{flag: value}).roles.sync_offset == 1
    with pytest.raises(ConfigError, match="--sync_interval must be positive"):
        RolesConfig(sync_interval=0)
    with pytest.raises(ConfigError, match="--sync_offset must be >= 0"):
        RolesConfig(sync_offset=-1)


def test_role_layout_puts_explorers_last_and_needs_a_trainer():
    layout = [RoleLayout(4, rank, 1) for rank in range(4)]
    assert [l.role for l in layout] == ["trainer", "trainer", "trainer", "explorer"]
    assert [l.role_rank for l in layout] == [0, 1, 2, 0] and [l.role_size for l in layout] == [3, 3, 3, 1]
    two = RoleLayout(5, 3, 2)
    assert two.explorer_job_rank(1) == 4 and [two.explorer_of_batch(b) for b in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="needs at least one trainer rank.*torchrun"):
        RoleLayout(2, 0, 2)


def test_join_roles_outside_torchrun_names_the_launch():
    # In a fresh process: a test file run earlier in this worker may have left a process group up,
    # which join_roles rightly refuses first.
    code = ("from lightrft.explorers.roles import join_roles\n"
            "try:\n    join_roles(1, timeout_minutes=1)\nexcept ValueError as err:\n    print('ValueError:', err)\n"
            # Weights over the devices on a machine without CUDA: refused before any rendezvous.
            "import os\nos.environ.update(RANK='0', WORLD_SIZE='2', MASTER_ADDR='127.0.0.1', MASTER_PORT='9')\n"
            "try:\n    join_roles(1, timeout_minutes=1, weight_transport='device')\n"
            "except ValueError as err:\n    print('ValueError:', err)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert "ValueError: --explorer_ranks needs a torchrun launch" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert ("ValueError: --explorer_weight_transport device needs CUDA and NCCL on every rank; this rank has no "
            "CUDA device: use host") in proc.stdout, proc.stdout + proc.stderr[-2000:]
    with pytest.raises(ConfigError, match="--explorer_weight_transport device moves the weights of --sync_method "
                                          "broadcast"):
        RolesConfig(explorer_ranks=1, sync_method="checkpoint", explorer_weight_transport="device")


# ------------------------------------------------------------------------------ data helpers
def test_flattened_weights_come_back_bit_exact_in_every_dtype():
    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)), ("c", torch.arange(6).view(2, 3)),
             ("d", torch.randn(2, 2, 2).half())]
    spec = [(n, tuple(t.shape), t.dtype) for n, t in named]
    back = unflatten_tensors(flatten_tensors([t for _, t in named]).clone(), spec)
    assert [n for n, _ in back] == ["a", "b", "c", "d"]
    assert all(t.dtype == u.dtype and torch.equal(t, u) for (_, t), (_, u) in zip(named, back))


def test_select_rows_keeps_the_widths_and_picks_the_rows():
    g = torch.Generator().manual_seed(0)
    rollout = RolloutOutput(torch.randint(0, 9, (6, 5), generator=g), torch.ones(6, 5, dtype=torch.long),
                            torch.rand(6, 3, generator=g) > 0.5, torch.randn(6, 3, generator=g), 2,
                            torch.tensor([True, False] * 3))
    part = rollout.select([4, 1])
    assert torch.equal(part.sequences, rollout.sequences[[4, 1]]) and part.prompt_len == 2
    assert torch.equal(part.rollout_log_probs, rollout.rollout_log_probs[[4, 1]])
    assert part.truncated.tolist() == [True, False]


def test_load_named_weights_copies_in_place_and_refuses_strangers():
    module = torch.nn.Linear(2, 2)
    load_named_weights(module, [("weight", torch.ones(2, 2)), ("bias", torch.zeros(2))])
    assert torch.equal(module.weight, torch.ones(2, 2))
    with pytest.raises(ValueError, match="unknown.*'lm_head.weight'"):
        load_named_weights(module, [("lm_head.weight", torch.ones(2, 2))])


def test_the_ledger_refuses_a_prompt_trained_twice_in_one_episode():
    ledger = PromptLedger()
    batch = lambda b, ep, ids: SimpleNamespace(batch=b, episode=ep, version=b, prompt_ids=ids)  # noqa: E731
    ledger.record_trained(1, batch(0, 0, [3, 1]))
    ledger.record_trained(2, batch(1, 0, [0, 2]))
    ledger.record_trained(3, batch(2, 1, [1, 3]))          # the next episode draws them again
    with pytest.raises(RuntimeError, match=r"rows \[3\] of episode 1 would be trained a second time at step 4"):
        ledger.record_trained(4, batch(3, 1, [3, 0]))
    again = PromptLedger()
    again.load_state_dict(ledger.state_dict())
    assert [e["prompts"] for e in again.trained] == [[3, 1], [0, 2], [1, 3]]


def test_ledgers_of_the_saving_ranks_merge_for_a_resume_on_another_count():
    entry = lambda step, prompts: {"step": step, "batch": step - 1, "episode": 0, "version": 0,  # noqa: E731
                                   "prompts": prompts}
    rank_0 = {"received": 3, "dropped": 1, "trained": [entry(1, [3, 1, 0, 2]), entry(2, [5, 4])]}
    rank_1 = {"received": 3, "dropped": 1, "trained": [entry(1, [3, 1, 0, 2]), entry(2, [6, 7])]}
    merged = PromptLedger.merged([rank_0, rank_1])
    assert (merged["received"], merged["dropped"]) == (3, 1)
    assert [(e["step"], e["prompts"]) for e in merged["trained"]] == [(1, [3, 1, 0, 2]), (2, [5, 4, 6, 7])]
    resumed = PromptLedger()
    resumed.load_state_dict(merged)
    batch = SimpleNamespace(batch=2, episode=0, version=2, prompt_ids=[8, 6])
    with pytest.raises(RuntimeError, match=r"rows \[6\] of episode 0 would be trained a second time at step 3"):
        resumed.record_trained(3, batch)        # rank 1's row is known to the one rank left


# ------------------------------------------------------------------------------- the channels
def gloo_pair() -> tuple:
    """Two ranks of one gloo group, as two groups in this process (built concurrently)."""
    store, groups = dist.HashStore(), {}

    def build(rank):
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups[0], groups[1]


def wait_until(predicate, what: str) -> None:
    deadline = time.time() + 30
    while not predicate():
        assert time.time() < deadline, what
        time.sleep(0.01)


def rollout_batch(b: int) -> RolloutBatch:
    """A small scored rollout batch whose numbers identify `b`."""
    g = torch.Generator().manual_seed(b)
    rollout = RolloutOutput(torch.randint(0, 9, (4, 5), generator=g), torch.ones(4, 5, dtype=torch.long),
                            torch.rand(4, 3, generator=g) > 0.5, torch.randn(4, 3, generator=g), 2,
                            torch.tensor([True, False] * 2))
    return RolloutBatch(b, episode=0, version=b, prompt_ids=[2 * b, 2 * b + 1], rollout=rollout,
                        scores=torch.randn(4, generator=g), valid=torch.ones(4, dtype=torch.bool),
                        seconds={"generate": 0.5 * b})


def test_a_full_buffer_stops_the_explorer_until_the_trainer_takes_a_batch():
    trainer_group, explorer_group = gloo_pair()
    receiver = ExperienceReceiver(ExperienceChannel(trainer_group), explorers=1, capacity=2)
    receiver.start()
    sent, channel = [], ExperienceChannel(explorer_group)

    def explore():
        for b in range(6):
            channel.send(rollout_batch(b), 0)
            sent.append(b)
        channel.send(DONE, 0)

    explorer = threading.Thread(target=explore)
    explorer.start()
    wait_until(lambda: len(sent) == 2, "the first two batches were never received")
    time.sleep(0.3)
    assert sent == [0, 1] and receiver.received == 2        # back-pressure: the third send waits
    first, expected = receiver.take(0), rollout_batch(0)
    # The batch crossed the channel as plain data and came back as the same dataclasses, bit for bit.
    assert type(first) is RolloutBatch and type(first.rollout) is RolloutOutput
    assert (first.batch, first.prompt_ids, first.seconds, first.rollout.prompt_len) == (0, [0, 1], {"generate": 0.0}, 2)
    for field in ("sequences", "attention_mask", "action_mask", "rollout_log_probs", "truncated"):
        assert torch.equal(getattr(first.rollout, field), getattr(expected.rollout, field)), field
    assert torch.equal(first.scores, expected.scores) and torch.equal(first.valid, expected.valid)
    wait_until(lambda: len(sent) >= 3, "taking a batch did not make room")
    time.sleep(0.3)
    assert sent == [0, 1, 2]                                 # room for exactly one more
    # Waiting for a batch that is not there yet lets more in than the capacity (no deadlock).
    assert receiver.take(4).batch == 4
    assert [receiver.take(b).batch for b in (1, 2, 3, 5)] == [1, 2, 3, 5]
    explorer.join(30)
    assert receiver.take(6) is None                      # the explorer said it is done
    receiver.join(30)
    assert not receiver.thread.is_alive()


def test_a_message_that_would_run_code_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    trainer_group, explorer_group = gloo_pair()
    receiver = ExperienceReceiver(ExperienceChannel(trainer_group), explorers=1, capacity=2)
    receiver.start()
    ExperienceChannel(explorer_group).send(CreatesFile(marker), 0)     # what a hostile peer could send
    with pytest.raises(RuntimeError, match=r"channel from the explorers failed.*a message from rank 1 of the "
                                           r"experience channel: refused to load.*Unsupported global"):
        receiver.take(0)
    receiver.join(30)
    assert not marker.exists()


def test_a_published_weights_file_that_would_run_code_is_refused_unread(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "weights" / "policy_v00000003.pt"
    path.parent.mkdir()
    torch.save(CreatesFile(marker), path)
    with pytest.raises(ValueError, match=f"published weights {path} .*refused to load.*Unsupported global"):
        latest_published(path.parent)
    assert not marker.exists()
    torch.load(path, weights_only=False)      # the old loader: the file does run its code
    assert marker.exists()


def test_a_trainer_waiting_for_experience_gives_up_when_interrupted():
    trainer_group, explorer_group = gloo_pair()
    receiver = ExperienceReceiver(ExperienceChannel(trainer_group), explorers=1, capacity=2)
    receiver.start()
    assert receiver.take(0, interrupted=lambda: True) is None
    ExperienceChannel(explorer_group).send(DONE, 0)   # no receive left pending when the process exits
    receiver.join(30)
    assert not receiver.thread.is_alive()


class CountingGroup:
    """A real process group that counts the bytes broadcast over it."""

    def __init__(self, group):
        self.group, self.nbytes = group, 0

    def rank(self) -> int:
        return self.group.rank()

    def broadcast(self, tensors, options):
        self.nbytes += sum(t.numel() * t.element_size() for t in tensors)
        return self.group.broadcast(tensors, options)


@pytest.mark.parametrize("method", ["broadcast", "checkpoint", "weights group"])
def test_published_weights_retries_and_stop_reach_the_explorer(tmp_path, method):
    trainer_group, explorer_group = gloo_pair()
    if method == "weights group":
        # --explorer_weight_transport device: the weights' bytes on a group of their own (NCCL on
        # GPUs; a gloo pair here, the same code path), the messages on the control group.
        weights_pair = [CountingGroup(g) for g in gloo_pair()]
        trainer_channel = ControlChannel(trainer_group, weights_pair[0], "cpu")
        explorer_channel = ControlChannel(explorer_group, weights_pair[1], "cpu")
        method = "broadcast"
    else:
        trainer_channel, explorer_channel = ControlChannel(trainer_group), ControlChannel(explorer_group)
        weights_pair = None
    subscriber = WeightSubscriber(explorer_channel, explorer_index=0)
    publisher = WeightPublisher(trainer_channel, method, sync_dir=tmp_path / "weights")
    weights = {v: [("w", torch.full((2, 3), float(v))), ("b", torch.full((3,), float(v)).to(torch.bfloat16))]
               for v in range(4)}
    for version in range(4):
        publisher.publish(version, weights[version], start_batch=0)
    publisher.send({"kind": "retry", "batch": 7, "explorer": 0})
    publisher.send({"kind": "retry", "batch": 9, "explorer": 1})      # another explorer's
    subscriber.wait(lambda: subscriber.newest() == 3 and subscriber.retries)
    # A retry without a version (an older trainer's) asks for the batch again at its scheduled version.
    assert subscriber.start_batch == 0 and subscriber.retries == [(7, None, True)]
    version, named = subscriber.take(2)                     # exactly the version asked for
    assert version == 2 and all(torch.equal(t, u) for (_, t), (_, u) in zip(named, weights[2]))
    assert sorted(subscriber.versions) == [2, 3]            # older ones are forgotten
    assert subscriber.take(0, newest=True)[0] == 3
    if method == "checkpoint":
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["policy_v00000002.pt",
                                                                              "policy_v00000003.pt"]
        version, named = latest_published(tmp_path / "weights")
        assert version == 3 and torch.equal(named[0][1], weights[3][0][1])
    publisher.close(30)
    subscriber.wait(lambda: False)
    assert subscriber.stopped and subscriber.error is None and publisher.error is None
    if weights_pair is not None:
        # Version 0 whole (2x3 float32 and 3 bfloat16, each padded to 16 bytes), then deltas: every
        # element changed, so whole again. Both members moved exactly those bytes over the group.
        assert publisher.sent_bytes == [48] * 4 and [g.nbytes for g in weights_pair] == [4 * 48, 4 * 48]


def test_an_explorer_error_reaches_the_trainer_with_its_traceback():
    channel = LocalChannel(maxsize=1)
    receiver = ExperienceReceiver(channel, explorers=1, capacity=2)
    receiver.start()
    channel.send((FAILED, "Traceback (most recent call last):\n  ...\nValueError: reward file returned 3 scores"))
    with pytest.raises(RuntimeError, match="(?s)^an explorer failed:\n.*ValueError: reward file returned 3 scores"):
        receiver.take(0)


# --------------------------------------------------------------------------------- stopping
class _Recorder:
    """A receiver or publisher stand-in that records how long `stop` let it wait."""

    def __init__(self):
        self.waits = []

    def drain(self):
        pass

    def join(self, timeout):
        self.waits.append(timeout)

    close = join


@pytest.mark.parametrize("preempted, most", [(True, 5.0), (False, 600.0)])
def test_a_preempted_trainer_waits_seconds_for_its_explorers_not_the_link_timeout(preempted, most):
    """Preempted, the job is ending and an explorer may be gone for good (kill -9): the trainer
    waits at most 5 s in all for the explorers' last messages, so it exits before torchrun's
    kill 30 s after SIGTERM; otherwise it waits up to the link's timeout."""
    from lightrft.explorers.link import PREEMPTED_STOP_WAIT_S, ExplorerLink

    link = ExplorerLink.__new__(ExplorerLink)
    link.timeout_s, link.receiver, link.publisher = 600.0, _Recorder(), _Recorder()
    link.stop(preempted=preempted)
    waits = link.publisher.waits + link.receiver.waits
    assert len(waits) == 2 and most - 1.0 < waits[0] <= most and waits[1] <= waits[0]
    assert PREEMPTED_STOP_WAIT_S == 5.0
