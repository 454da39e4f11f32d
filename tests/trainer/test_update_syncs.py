"""Host syncs of a whole packed update (train_ppo's own wiring, ZeRO-2, one rank): lightrft code
reads no scalar out of a tensor during the optimizer step's micro-batches, and the reads that
remain (DeepSpeed's optimizer step: its overflow and gradient-norm checks) come per optimizer
step, not per micro-batch. On the CPU every `.item()`, `bool(t)` and `int(t)` is counted as a
dispatch of `aten._local_scalar_dense`, wherever the tensor lives; on a GPU each is a sync.
(tests/models/test_host_syncs.py shows, on the meta device, that the model's forward, losses and
backward read nothing back, however many layers and sequences.)"""

import collections
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightrft.trainer.ppo_trainer import PPOTrainer
from tests.trainer.ppo_harness import make_task, run

LIGHTRFT = str(Path(__file__).resolve().parents[2] / "lightrft")
READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.item.default}


class ScalarReads(TorchDispatchMode):
    """Counts scalar reads by the package whose code made them (the innermost non-torch frame)."""

    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            where = frames[-1].filename
            self.counts["lightrft" if where.startswith(LIGHTRFT) else
                        "deepspeed" if "/deepspeed/" in where else where] += 1
        return func(*args, **(kwargs or {}))


def counting_trainer(counts: collections.Counter):
    class Counting(PPOTrainer):
        def training_step(self, experience, global_steps, group_counts):
            counts["micro_batches"] += 1
            with ScalarReads(counts):
                return super().training_step(experience, global_steps, group_counts)
    return Counting


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_task(tmp_path_factory.mktemp("task"))


def test_a_packed_update_reads_scalars_per_optimizer_step_not_per_micro_batch(task, tmp_path):
    by_split = {}
    for micro in (8, 4):            # 2 and 4 micro-batches in the one optimizer step of 16 samples
        counts = collections.Counter()
        run(task, tmp_path / f"micro{micro}", trainer_cls=counting_trainer(counts), packing_samples=True,
            max_steps=1, micro_train_batch_size=micro)
        micro_batches = counts.pop("micro_batches")
        by_split[micro_batches] = dict(counts)
    assert sorted(by_split) == [2, 4]
    assert all(reads.get("lightrft", 0) == 0 for reads in by_split.values()), by_split
    assert by_split[2] == by_split[4] and set(by_split[2]) <= {"deepspeed"}, by_split
