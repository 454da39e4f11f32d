"""Fixtures for the model-wrapper tests: tiny Qwen2/Llama folders saved once per session, and a
padded batch with its packed twin (prompts left-padded, responses right-padded)."""

from dataclasses import dataclass

import pytest
import torch

from lightrft.models.packing import pack_padded
from lightrft.utils.tiny import save_tiny_model

PAD = 0


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """{'qwen2': folder, 'llama': folder} of tiny causal LMs with the character tokenizer."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: save_tiny_model(root / arch, arch=arch, seed=1) for arch in ("qwen2", "llama")}


@dataclass
class Batch:
    sequences: torch.Tensor  # (B, T) prompts left-padded, responses right-padded
    attention_mask: torch.Tensor  # (B, T)
    prompt_lens: list[int]
    response_lens: list[int]  # num_actions per sequence
    num_actions: int  # A = max response length
    packed_ids: torch.Tensor  # (1, P)
    packed_seq_lens: list[int]

    def action_mask(self) -> torch.Tensor:
        """1 on real response tokens of the (B, A) layout. Shape: (B, A)"""
        cols = torch.arange(self.num_actions).unsqueeze(0)
        return (cols < torch.tensor(self.response_lens).unsqueeze(1)).float()


def make_batch(prompt_lens, response_lens, seed=0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    max_p, max_r = max(prompt_lens), max(response_lens)
    rows, masks = [], []
    for p, r in zip(prompt_lens, response_lens):
        tokens = torch.randint(4, 100, (p + r,), generator=gen)
        rows.append(torch.cat([torch.full((max_p - p,), PAD), tokens, torch.full((max_r - r,), PAD)]))
        masks.append(torch.cat([torch.zeros(max_p - p), torch.ones(p + r), torch.zeros(max_r - r)]))
    sequences, attention_mask = torch.stack(rows), torch.stack(masks).long()
    packed = pack_padded(sequences, attention_mask)
    return Batch(sequences, attention_mask, list(prompt_lens), list(response_lens), max_r,
                 packed.input_ids, packed.seq_lens)


@pytest.fixture
def batch() -> Batch:
    return make_batch(prompt_lens=[3, 6, 2, 4], response_lens=[4, 1, 5, 2], seed=0)


def assert_close_grads(grads: dict, ref_grads: dict, atol: float) -> None:
    """The same parameters got gradients, each within `atol` of the reference's relative to its
    largest entry (or absolutely, where that is below 1)."""
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().clamp(min=1.0)
        torch.testing.assert_close(grad / scale, ref_grads[name] / scale, atol=atol, rtol=0, msg=name)
