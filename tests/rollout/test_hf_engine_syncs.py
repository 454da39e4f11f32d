"""HFEngine's host syncs per decoding step. On CUDA a read of a device value (`.item()`,
`bool(t)`) waits for every queued kernel, so a read per step keeps the host from queueing the next
step while the device runs the last. With the trainer's attention (VARLEN_ATTENTION, the actor's
default) the mask of a cached step is built without reading the padding mask, and "has every row
ended?" is read once per `stop_check_steps`. On the CPU every such read still dispatches
`aten._local_scalar_dense`, which is what is counted here; the output is the same for any value of
`stop_check_steps`."""


import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightrft.models.hf_utils import VARLEN_ATTENTION
from lightrft.rollout import HFEngine, SamplingParams
from lightrft.utils.tiny import build_tiny_arch

READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.item.default}
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15, 16, 17, 18]]


class Reads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in READS
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model():
    model = build_tiny_arch("qwen2", seed=1)        # one full and one sliding-window layer
    model.set_attn_implementation(VARLEN_ATTENTION)
    return model


def reads_of(engine, steps: int) -> int:
    params = SamplingParams(temperature=1.0, max_new_tokens=steps, min_new_tokens=steps, n=2)
    with Reads() as reads:
        out = engine.generate(PROMPTS, params, seeds=[1, 2, 3, 4])
    assert out.action_mask.shape[1] == steps
    return reads.count


def test_reads_grow_with_steps_only_by_the_stop_checks(model):
    engine = HFEngine(model, 0, 2, stop_check_steps=8)
    extra = reads_of(engine, 48) - reads_of(engine, 16)
    assert extra == (48 - 16) // 8, extra           # one stop check per 8 steps, nothing per forward
    every_step = HFEngine(model, 0, 2, stop_check_steps=1)
    assert reads_of(every_step, 48) - reads_of(every_step, 16) == 48 - 16


def test_the_stop_check_interval_does_not_change_the_output(model):
    """Many end-of-sequence ids (a third of the vocabulary): rows end at different steps, early;
    with checks every 8 steps the engine decodes past the last end and trims it."""
    eos = list(range(40, 80))
    params = SamplingParams(temperature=1.0, max_new_tokens=40, n=3)
    outs = [HFEngine(model, 0, eos, stop_check_steps=k).generate(PROMPTS, params, seeds=[7, 8, 9, 10])
            for k in (1, 8, 64)]
    lengths = outs[0].action_mask.sum(-1)
    assert lengths.min() < lengths.max() < 40       # rows ended at different steps, all before the limit
    for out in outs[1:]:
        assert torch.equal(out.sequences, outs[0].sequences)
        assert torch.equal(out.action_mask, outs[0].action_mask)
        assert torch.equal(out.rollout_log_probs, outs[0].rollout_log_probs)
        assert torch.equal(out.truncated, outs[0].truncated)


def test_a_bad_stop_check_interval_is_refused(model):
    with pytest.raises(ValueError, match="stop_check_steps must be >= 1"):
        HFEngine(model, 0, 2, stop_check_steps=0)
