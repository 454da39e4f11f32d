"""Host syncs in a training micro-batch: lightrft's packed forward, losses and backward read no
value back from the device and make no blocking copy to it, however many layers and sequences.

A value read from a GPU (`.item()`, `bool(t)`, `.tolist()`, a data-dependent shape) stalls the
host until the device has caught up. On the "meta" device tensors have shapes and no values, so
every such read goes through `aten._local_scalar_dense` (or `is_nonzero`) on a meta tensor:
`DeviceReads` counts them (and answers them, so the run goes on). A blocking copy of a host tensor
to the device (`.to(device)` without `non_blocking`) synchronises the stream after it on CUDA (the
first GPU profile found five per micro-batch, the packed row's positions and indices): counted too. The optimizer step is
DeepSpeed's and is not part of this count."""

import collections
import copy
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from lightrft.algorithms.kl import compute_approx_kl
from lightrft.models import ActorLanguage, Critic
from lightrft.models.loss import PolicyLoss, ValueLoss
from lightrft.utils.tiny import TINY_ARCHS, build_tiny_arch, save_tiny_arch

from .conftest import make_batch

READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.item.default}
# Its model code reshapes the padding mask before the mask function sees it, which then reads it
# once per forward to know the packed row has no padding.
READS_PER_FORWARD = {"gpt2": 1}
MOE = {"qwen3_moe", "mixtral", "olmoe", "deepseek_v3"}  # grouped expert matmuls take bf16 on the meta device


def blocking_upload(func, args, kwargs) -> bool:
    """A copy from host memory to the device that is not `non_blocking`: on CUDA, PyTorch waits for
    the device's queued work after it (a stream synchronisation), as it does for a read."""
    if func is torch.ops.aten._to_copy.default:
        target = kwargs.get("device")
        return args[0].device.type == "cpu" and target is not None and target.type == "meta" and \
            not kwargs.get("non_blocking", False)
    if func is torch.ops.aten.copy_.default:
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return args[0].is_meta and args[1].device.type == "cpu" and not non_blocking
    return False


class DeviceReads(TorchDispatchMode):
    """Counts, by the line of lightrft or model code that made it, each read of a meta tensor's
    value and each blocking copy from the host to it (`blocking_upload`)."""

    def __init__(self):
        super().__init__()
        self.where = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS and any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
            self.count_here()
            return True if func is torch.ops.aten.is_nonzero.default else 1
        if blocking_upload(func, args, kwargs):
            self.count_here()
        return func(*args, **kwargs)

    def count_here(self) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename]
        self.where[f"{frames[-1].filename}:{frames[-1].lineno}"] += 1

    @property
    def count(self) -> int:
        return sum(self.where.values())


def twice_as_deep(model):
    """The same architecture with twice the layers (random weights)."""
    config = copy.deepcopy(model.config)
    text = config.get_text_config()
    text.num_hidden_layers *= 2
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types) * 2
    return AutoModelForCausalLM.from_config(config).float()


def on_meta(module, arch):
    return module.to("meta", dtype=torch.bfloat16 if arch in MOE else torch.float32)


def actor_micro_batch(actor, batch) -> None:
    """A policy micro-batch as `PPOUpdate.training_step_actor` computes it: forward with entropy,
    policy loss with metrics, KL loss, entropy bonus, backward."""
    ids = batch.packed_ids.to("meta", non_blocking=True)   # (the trainer uploads its batch so too)
    log_probs, output = actor(ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens, return_output=True,
                              return_entropy=True)
    mask = torch.ones_like(log_probs, dtype=torch.bool)
    old, advantages = log_probs.detach() + 0.1, torch.ones_like(log_probs)
    tokens, seqs = mask.sum().float(), torch.tensor(float(mask.size(0)), device="meta")
    loss, metrics = PolicyLoss()(log_probs, old, advantages, action_mask=mask, rollout_log_probs=old,
                                 return_metrics=True, global_num_tokens=tokens, global_num_seqs=seqs)
    kl = compute_approx_kl(log_probs, old - 0.2, mask, kl_estimator="k3")
    entropy = (output["entropy"] * mask).sum() / tokens
    (loss + 0.01 * (kl * mask).sum() / tokens - 0.001 * entropy).backward()


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_a_packed_policy_micro_batch_reads_nothing_back_from_the_device(arch):
    small = make_batch([5, 12, 3, 9], [10, 4, 14, 6], seed=0)
    large = make_batch([5, 12, 3, 9] * 3, [10, 4, 14, 6] * 3, seed=1)
    counts = {}
    for deeper, batch in ((False, small), (True, large)):
        model = build_tiny_arch(arch, seed=1)
        if deeper:
            model = twice_as_deep(model)
        actor = ActorLanguage(on_meta(model, arch)).train()
        with DeviceReads() as reads:
            actor_micro_batch(actor, batch)
        layers = model.config.get_text_config().num_hidden_layers
        counts[(layers, len(batch.packed_seq_lens))] = (reads.count, dict(reads.where))
    assert len(counts) == 2
    expected = READS_PER_FORWARD.get(arch, 0)
    assert all(count == expected for count, _ in counts.values()), counts


def test_a_packed_value_micro_batch_reads_nothing_back_from_the_device(tmp_path):
    batch = make_batch([5, 12, 3, 9], [10, 4, 14, 6], seed=0)
    critic = on_meta(Critic(save_tiny_arch(tmp_path / "qwen2", "qwen2", seed=1)), "qwen2").train()
    with DeviceReads() as reads:
        values = critic(batch.packed_ids.to("meta", non_blocking=True), batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
        mask = torch.ones_like(values, dtype=torch.bool)
        loss = ValueLoss(0.2)(values, values.detach() + 0.1, values.detach() - 0.1, action_mask=mask,
                              global_num_tokens=mask.sum().float())
        loss.backward()
    assert reads.count == 0, dict(reads.where)


def test_a_read_of_a_device_value_and_a_blocking_upload_are_counted():
    with DeviceReads() as reads:
        t = torch.ones(3, device="meta")
        bool(t.all()), t.sum().item()
        t.copy_(torch.arange(3)), torch.arange(3).to("meta")
        t.copy_(torch.arange(3), non_blocking=True), torch.arange(3).to("meta", non_blocking=True)
    assert reads.count == 4
