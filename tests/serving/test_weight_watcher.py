"""serve --watch (`WeightWatcher`) on real export folders: an export still being copied is retried
once its files change, a broken export with a high step does not block the newer good ones
written after it, and weights holding NaN are never served."""

import logging
import shutil

import torch
from safetensors.torch import load_file, save_file

from lightrft.serving.policy import ServedPolicy, WeightWatcher
from lightrft.utils.tiny import build_char_tokenizer, save_tiny_model


def served(tmp_path) -> ServedPolicy:
    base = save_tiny_model(tmp_path / "base", seed=0)
    tokenizer = build_char_tokenizer()
    return ServedPolicy(base, tokenizer, [tokenizer.eos_token_id])


def export(ckpt, step: int, seed: int):
    """A global_stepN_hf export of another tiny model (same tokenizer)."""
    return save_tiny_model(ckpt / f"global_step{step}_hf", seed=seed)


def first_weight(policy: ServedPolicy) -> torch.Tensor:
    return next(policy.model.parameters()).detach().clone()


def test_an_export_seen_half_written_is_loaded_once_complete(tmp_path, caplog):
    policy, ckpt = served(tmp_path), tmp_path / "ckpt"
    watcher = WeightWatcher(policy, ckpt, interval=1.0)
    folder = export(ckpt, 1, seed=1)
    weights = folder / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])          # the copy is half way through
    with caplog.at_level(logging.ERROR, logger="lightrft.serve"):
        assert watcher.poll() is False and policy.version == 0
        assert watcher.poll() is False                     # unchanged: not tried again
    assert caplog.text.count("loading new weights from") == 1
    weights.write_bytes(whole)                              # the copy finished
    assert watcher.poll() is True and policy.version == 1
    assert watcher.poll() is False


def test_a_broken_export_with_a_high_step_does_not_block_newer_ones(tmp_path):
    policy, ckpt = served(tmp_path), tmp_path / "ckpt"
    watcher = WeightWatcher(policy, ckpt, interval=1.0)
    stray = export(ckpt, 99, seed=9)
    (stray / "model.safetensors").write_bytes(b"not a safetensors file")
    assert watcher.poll() is False and policy.version == 0
    export(ckpt, 2, seed=2)
    before = first_weight(policy)
    assert watcher.poll() is True and policy.version == 2
    assert not torch.equal(first_weight(policy), before)
    export(ckpt, 3, seed=3)                                  # and the next one after it
    assert watcher.poll() is True and policy.version == 3


def test_weights_with_nan_are_not_served(tmp_path, caplog):
    policy, ckpt = served(tmp_path), tmp_path / "ckpt"
    watcher = WeightWatcher(policy, ckpt, interval=1.0)
    folder = export(ckpt, 1, seed=1)
    state = load_file(folder / "model.safetensors")
    name = sorted(state)[0]
    state[name][0] = float("nan")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    before = first_weight(policy)
    with caplog.at_level(logging.ERROR, logger="lightrft.serve"):
        assert watcher.poll() is False
    assert policy.version == 0 and torch.equal(first_weight(policy), before)
    assert "hold NaN or infinite values" in caplog.text and "not served" in caplog.text
    shutil.rmtree(folder)
    export(ckpt, 1, seed=1)                                  # a clean export under the same name
    assert watcher.poll() is True and policy.version == 1
