import pytest
import torch

from lightrft.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss, dp_loss_scale, loss_normalizers

F64 = torch.float64
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode, norm_len, expected",
    [
        ("token-mean", None, (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-mean", None, ((1 + 2 + 3) / 3 + 4 / 1) / 2),
        ("seq-mean-token-sum", None, ((1 + 2 + 3) + 4) / 2),
        ("seq-mean-token-sum-norm", 4, ((1 + 2 + 3) + 4) / (2 * 4)),
        ("seq-mean-token-sum-norm", None, ((1 + 2 + 3) + 4) / (2 * 3)),  # defaults to A = 3
    ],
)
def test_modes_by_hand(mode, norm_len, expected):
    assert aggregate_loss(LOSS, MASK, mode, norm_len=norm_len).item() == pytest.approx(expected)


def test_empty_mask_gives_zero():
    for mode in LOSS_AGG_MODES:
        assert aggregate_loss(LOSS, torch.zeros_like(MASK), mode).item() == 0.0


def test_normalizers_count_tokens_and_non_empty_sequences():
    tokens, seqs = loss_normalizers(torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 0]]))
    assert (tokens.item(), seqs.item()) == (3, 2)


def random_batch(seed, B=8, A=7):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, A + 1, (B,), generator=gen)
    lengths[3] = 0  # an empty sequence
    mask = torch.arange(A)[None, :] < lengths[:, None]  # right-padded responses
    loss = torch.randn(B, A, generator=gen, dtype=F64)
    return loss, mask


def split(loss, mask, parts):
    """Cuts the batch into `parts` row blocks, each trimmed to its own longest response, as
    micro-batches padded separately would be."""
    out = []
    for rows in torch.arange(loss.shape[0]).chunk(parts):
        width = max(int(mask[rows].sum(-1).max()), 1)
        out.append((rows, width))
    return out


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", range(2))
def test_split_over_ranks_and_micro_batches_equals_whole_batch(mode, seed):
    base, mask = random_batch(seed)
    norm_len = 7  # a constant, e.g. --generate_max_len

    whole_input = base.clone().requires_grad_(True)
    whole = aggregate_loss(whole_input, mask, mode, norm_len=norm_len)
    whole.backward()

    for parts in (1, 2, 4):
        pieces = split(base, mask, parts)
        counts = [loss_normalizers(mask[rows, :width]) for rows, width in pieces]
        global_tokens = sum(c[0] for c in counts)
        global_seqs = sum(c[1] for c in counts)
        split_input = base.clone().requires_grad_(True)
        total = 0.0
        for rows, width in pieces:
            part = aggregate_loss(split_input[rows, :width], mask[rows, :width], mode,
                                  global_num_tokens=global_tokens, global_num_seqs=global_seqs, norm_len=norm_len)
            part.backward()
            total = total + part.detach()
        torch.testing.assert_close(total, whole.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(split_input.grad, whole_input.grad, rtol=1e-6, atol=1e-6)


def test_deepspeed_scaling_recovers_the_whole_batch_gradient():
    """world_size=2 ranks x GAS=2 micro-batches: DeepSpeed divides each micro-batch loss by GAS and
    averages the accumulated gradients over ranks; dp_loss_scale undoes both."""
    base, mask = random_batch(5)
    whole_input = base.clone().requires_grad_(True)
    aggregate_loss(whole_input, mask, "token-mean").backward()
    world, gas = 2, 2
    scale = dp_loss_scale(world, gas)
    assert scale == 4
    tokens = mask.sum()
    rank_grads = []
    for rank_rows in torch.arange(8).chunk(world):
        rank_input = base.clone().requires_grad_(True)
        for rows in rank_rows.chunk(gas):
            loss = aggregate_loss(rank_input[rows], mask[rows], "token-mean", global_num_tokens=tokens)
            (loss * scale / gas).backward()  # what DeepSpeed's engine.backward does with GAS
        rank_grads.append(rank_input.grad)
    averaged = sum(rank_grads) / world  # the data-parallel all-reduce mean
    torch.testing.assert_close(averaged, whole_input.grad)
    with pytest.raises(ValueError, match="world_size and grad_accum_steps must be >= 1"):
        dp_loss_scale(0, 1)


def test_bad_input():
    with pytest.raises(ValueError, match=r"unknown --loss_agg_mode 'mean'; choose one of: token-mean, seq-mean-"):
        aggregate_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match=r"mask has shape \(2, 2\) but loss has shape \(2, 3\)"):
        aggregate_loss(LOSS, MASK[:, :2])
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm over a split batch needs norm_len"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", global_num_seqs=4)
