"""Token log-probabilities and entropies from logits, without a float32 copy of the logits.

Logits are (B, T, V) with V up to ~150k, often in bf16: a float32 copy of them, and of their
softmax for the backward pass, is the largest tensor of a training step. Both functions here walk
over blocks of at most `chunk_size` rows (default: about 2^25 logits per block), up-cast only the
block, and keep only per-row numbers (log-sum-exp) for the backward pass, which recomputes the
block's softmax. The gradient is written into one tensor of the logits' own dtype, as autograd
would produce anyway.
"""

from collections.abc import Iterator

import torch
from torch import Tensor

from lightrft.algorithms.checks import check_ndim

CHUNK_ELEMENTS = 1 << 25


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _blocks(batch: int, length: int, vocab: int, chunk_size: int | None) -> Iterator[tuple[slice, slice]]:
    """(batch slice, time slice) pairs covering (B, T) in blocks of at most `chunk_size` rows.
    Each block is a view of the logits, so a non-contiguous input is never copied whole."""
    rows = chunk_size or max(1, CHUNK_ELEMENTS // vocab)
    if length >= rows:
        for b in range(batch):
            for t in range(0, length, rows):
                yield slice(b, b + 1), slice(t, min(t + rows, length))
    else:
        per_block = max(1, rows // max(length, 1))  # whole sequences per block
        for b in range(0, batch, per_block):
            yield slice(b, min(b + per_block, batch)), slice(0, length)


def _scaled_block(logits: Tensor, rows: tuple[slice, slice], temperature: float) -> Tensor:
    """z = logits[block] / temperature in the compute dtype (a fresh tensor)."""
    block = logits[rows].to(_compute_dtype(logits), copy=True)
    return block.div_(temperature) if temperature != 1.0 else block


class _LabelLogProbs(torch.autograd.Function):
    """log softmax(logits / T)[label] with gradient (onehot(label) - softmax(z)) / T."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size):
        batch, length, vocab = logits.shape
        out = torch.empty(batch, length, dtype=_compute_dtype(logits), device=logits.device)
        log_norm = torch.empty_like(out)  # (B, T) logsumexp of z, reused by backward
        for rows in _blocks(batch, length, vocab, chunk_size):
            z = _scaled_block(logits, rows, temperature)
            log_norm[rows] = torch.logsumexp(z, dim=-1)
            out[rows] = z.gather(-1, labels[rows].unsqueeze(-1)).squeeze(-1) - log_norm[rows]
        ctx.save_for_backward(logits, labels, log_norm)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, labels, log_norm = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for rows in _blocks(*logits.shape, ctx.chunk_size):
            probs = (_scaled_block(logits, rows, ctx.temperature) - log_norm[rows].unsqueeze(-1)).exp_()
            g = grad_out[rows].unsqueeze(-1).to(probs.dtype)
            block_grad = probs.mul_(-g).scatter_add_(-1, labels[rows].unsqueeze(-1), g)
            grad[rows] = block_grad.div_(ctx.temperature)
        return grad, None, None, None


class _Entropy(torch.autograd.Function):
    """H = logsumexp(z) - sum_v softmax(z)_v z_v with z = logits / T, and
    dH/dz_k = -p_k (log p_k + H)."""

    @staticmethod
    def forward(ctx, logits, temperature, chunk_size):
        batch, length, vocab = logits.shape
        out = torch.empty(batch, length, dtype=_compute_dtype(logits), device=logits.device)
        log_norm = torch.empty_like(out)  # (B, T)
        for rows in _blocks(batch, length, vocab, chunk_size):
            z = _scaled_block(logits, rows, temperature)
            log_norm[rows] = torch.logsumexp(z, dim=-1)
            probs = (z - log_norm[rows].unsqueeze(-1)).exp_()
            out[rows] = log_norm[rows] - (probs * z).sum(-1)
        ctx.save_for_backward(logits, log_norm, out)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, log_norm, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for rows in _blocks(*logits.shape, ctx.chunk_size):
            log_probs = _scaled_block(logits, rows, ctx.temperature).sub_(log_norm[rows].unsqueeze(-1))
            probs = log_probs.exp()
            # dH/dz_k = -p_k (log p_k + H), then the chain rule through z = logits / T
            scale = -(grad_out[rows] / ctx.temperature).unsqueeze(-1).to(probs.dtype)
            grad[rows] = probs.mul_(log_probs.add_(entropy[rows].unsqueeze(-1))).mul_(scale)
        return grad, None, None


def _as_3d(logits: Tensor) -> Tensor:
    if logits.dim() == 2:
        return logits.unsqueeze(0)  # (N, V) -> (1, N, V)
    check_ndim("logits", logits, 3, "(B, T, V) or (N, V)")
    return logits


def _check_temperature(temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")


def log_probs_from_logits(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> Tensor:
    """log p(label) = z[label] - logsumexp(z) with z = logits / temperature: the log-probability
    each position assigns to its label (no shift: align logits and labels before calling).
    Returns float32 (float64 for float64 logits); differentiable in the logits.
    Shape: logits (B, T, V), labels (B, T) -> (B, T); or (N, V), (N,) -> (N,)."""
    _check_temperature(temperature)
    logits3d = _as_3d(logits)
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels has shape {tuple(labels.shape)} but logits has shape {tuple(logits.shape)}; "
            f"labels must have shape {tuple(logits.shape[:-1])}"
        )
    labels3d = labels.reshape(logits3d.shape[:2]).long()  # (N,) -> (1, N) for 2-D input
    out = _LabelLogProbs.apply(logits3d, labels3d, float(temperature), chunk_size)
    return out.reshape(labels.shape)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, chunk_size: int | None = None) -> Tensor:
    """Entropy of softmax(z), z = logits / temperature, per position:
    H = logsumexp(z) - sum_v softmax(z)_v * z_v. Logits must be finite.
    Returns float32 (float64 for float64 logits); differentiable in the logits.
    Shape: logits (B, T, V) -> (B, T); or (N, V) -> (N,)."""
    _check_temperature(temperature)
    logits3d = _as_3d(logits)
    return _Entropy.apply(logits3d, float(temperature), chunk_size).reshape(logits.shape[:-1])
