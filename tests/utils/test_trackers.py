"""TensorBoard logging: every scalar of a step reads back under its name and step, written as one
event per step (each event wakes the writer thread on rank 0 while the other ranks wait)."""

from pathlib import Path

from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from lightrft.utils.trackers import MetricsTracker
from tests.e2e.conftest import tensorboard_scalars


def test_scalars_of_a_step_read_back_from_one_event(tmp_path):
    tracker = MetricsTracker(is_rank_0=True, config={"lr": 0.1}, use_tensorboard=str(tmp_path))
    steps = {1: {"rollout/reward": 0.25, "train/policy_loss": -1.5, "perf/step_time": 3.0},
             2: {"rollout/reward": 0.5, "train/policy_loss": 2.0, "perf/step_time": 0.125}}
    for step, metrics in steps.items():
        tracker.log(metrics, step=step)
    tracker.log({}, step=3)                 # nothing to write
    tracker.close()
    scalars = tensorboard_scalars(tmp_path)
    assert scalars == {name: [(step, steps[step][name]) for step in steps] for name in steps[1]}
    files = list(Path(tmp_path).glob("events.out.tfevents.*"))
    assert len(files) == 1
    events = [e for e in EventFileLoader(str(files[0])).Load() if e.HasField("summary")]
    scalar_events = [e for e in events if all(v.tag in steps[1] for v in e.summary.value)]   # not the config text
    assert [(e.step, len(e.summary.value)) for e in scalar_events] == [(1, 3), (2, 3)]


def test_other_ranks_write_nothing(tmp_path):
    tracker = MetricsTracker(is_rank_0=False, config={}, use_tensorboard=str(tmp_path / "tb"))
    tracker.log({"rollout/reward": 1.0}, step=1)
    tracker.close()
    assert not tracker.active and not (tmp_path / "tb").exists()
