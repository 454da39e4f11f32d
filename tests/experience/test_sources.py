"""The experience-source seam: the step trains on whatever a source hands it, and the prompt
sampler resumes where a run stopped."""

import copy

import pytest
from torch.utils.data import DataLoader

from lightrft.trainer import PPOTrainer
from lightrft.trainer.callbacks import TrainerCallback
from lightrft.experience.sources import ColocatedSource, PromptSampler, SourceBatch
from lightrft.utils.distributed_sampler import DistributedSampler
from tests.trainer.ppo_harness import make_task, max_weight_change, run


class RecordExperiences(TrainerCallback):
    """Keeps a copy of every step's experiences, as the step received them."""

    def __init__(self):
        self.steps = []

    def on_rollout_end(self, trainer, experiences):
        self.steps.append(copy.deepcopy(experiences))


class ReplaySource:
    """An experience source of fixed batches: the seam a user's own source plugs into."""

    checks_engine = True

    def __init__(self, steps, prompts_per_step):
        self.steps, self.prompts_per_step = steps, prompts_per_step
        self.after = []

    def start(self, context):
        self.first_step = context.first_step

    def next(self, step, params):
        if step >= len(self.steps):
            return None
        return SourceBatch(copy.deepcopy(self.steps[step]), self.prompts_per_step, counters={"dropped_groups": 1})

    def after_step(self, step):
        self.after.append(step)
        return {"rollout/replayed": 1.0}

    def stop(self, preempted=False):
        self.stopped = preempted

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_a_source_replaying_a_runs_experience_trains_the_same_weights(tmp_path):
    (tmp_path / "task").mkdir()
    task = make_task(tmp_path / "task")
    recorder = RecordExperiences()
    logs, weights = run(task, tmp_path / "colocated", callbacks=[recorder])
    assert len(recorder.steps) == 2
    source = ReplaySource(recorder.steps, prompts_per_step=4)

    class ReplayTrainer(PPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "experience_source": source})

    replay_logs, replayed = run(task, tmp_path / "replayed", trainer_cls=ReplayTrainer)
    # Same experiences in, same update out, bit for bit: the step needs nothing but what the
    # source handed over.
    assert max_weight_change(weights, replayed) == 0.0
    assert replay_logs["rollout/reward"] == logs["rollout/reward"]
    # The source's counters and logs reach the trainer's logs; its hooks ran once per step.
    assert source.after == [1, 2] and source.stopped is False
    assert replay_logs["train/dropped_groups"] == 2.0 and replay_logs["rollout/replayed"] == 1.0


def test_the_prompt_sampler_resumes_mid_episode_where_the_run_stopped():
    prompts = [(f"p{i}", i) for i in range(10)]

    def loader():
        return DataLoader(prompts, batch_size=3, sampler=DistributedSampler(prompts, 1, 0, shuffle=True, seed=5),
                          collate_fn=lambda rows: tuple(zip(*rows)), drop_last=True)

    whole = list(PromptSampler(loader(), rollout_batch_size=3, num_episodes=2).batches(0))
    assert len(whole) == 6          # 3 whole batches of 3 per episode (one prompt left over)
    # Each episode is one shuffle of the prompts, and the two episodes' orders differ.
    first, second = [sum((b[1] for b in whole[k:k + 3]), []) for k in (0, 3)]
    assert len(set(first)) == 9 and first != second
    for done in range(6):
        resumed = list(PromptSampler(loader(), rollout_batch_size=3, num_episodes=2).batches(3 * done))
        assert resumed == whole[done:]
    # Past the planned episodes only when asked (dynamic sampling may need more prompts).
    endless = PromptSampler(loader(), rollout_batch_size=3, num_episodes=2, endless=True).batches(18)
    assert len(next(endless)[0]) == 3


def test_the_colocated_source_resumes_its_seed_count_from_the_checkpoint_state():
    source = ColocatedSource()
    source.load_state_dict({"rollout_calls": 7, "global_step": 3})
    assert source.state_dict() == {"rollout_calls": 7}
    fresh = ColocatedSource()
    fresh.load_state_dict({})          # a checkpoint from before the source kept state
    assert fresh.state_dict() == {"rollout_calls": 0}


def test_a_source_of_the_earlier_protocol_is_called_without_the_sampling_parameters():
    # next(step, params) is the protocol; a source written as next(step) still runs, warned once.
    from lightrft.experience.sources import next_batch
    from lightrft.rollout.base import SamplingParams

    class EarlierSource(ReplaySource):
        def next(self, step):
            return super().next(step, None)

    params = SamplingParams(max_new_tokens=3, n=2)
    source = EarlierSource([["a"], ["b"]], prompts_per_step=4)
    with pytest.warns(FutureWarning, match=r"EarlierSource.next\(step\) takes no sampling parameters"):
        assert next_batch(source, 0, params).experiences == ["a"]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert next_batch(source, 1, params).experiences == ["b"]      # once per class
        seen = []

        class Current(ReplaySource):
            def next(self, step, params):
                seen.append(params)
                return super().next(step, params)

        assert next_batch(Current([["c"]], 4), 0, params).experiences == ["c"] and seen == [params]


def test_after_step_hands_the_step_logs_to_sources_that_take_them():
    from lightrft.experience.sources import after_step

    class Earlier:
        def after_step(self, step):
            return {"seen": float(step)}

    class Current:
        def after_step(self, step, logs=None):
            return {"kl": logs["train/mismatch_kl_k3"] + step}

    logs = {"train/mismatch_kl_k3": 0.25}
    assert after_step(Earlier(), 3, logs) == {"seen": 3.0}
    assert after_step(Current(), 3, logs) == {"kl": 3.25}
