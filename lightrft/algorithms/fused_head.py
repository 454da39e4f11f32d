"""Token log-probabilities and entropies from the last hidden states and the LM head, without
ever holding (tokens x vocabulary) logits.

The plain route computes logits = hidden @ W.T for every kept position ((N, V), V up to ~150k)
and then `logprobs.log_probs_from_logits`; the logits, and their gradient in the backward pass,
are the largest tensors of a training step (16k tokens x 151,936 in bf16: 5 GB each). Here the
head runs over blocks of at most `chunk_tokens` rows: each block's logits are computed, turned
into log-probs (and entropies), and dropped; the backward pass recomputes them block by block and
accumulates the gradients of the hidden states (N, H), the weight (V, H) and the bias (V,).
Per row only the log-sum-exp (and the entropy) are kept between the passes.

The logits of a block are transformed as the model's head and the sampler transform them:

    l = hidden @ W.T + b                  in the inputs' dtype, as the model's own head computes it
    c = cap * tanh(l / cap)               final-logit soft-capping (Gemma 2), when `softcap` is set
    c[banned] = -1e9                      ids no rollout engine samples (`ActorLanguage._without_banned`)
    z = c / T                             sampling temperature, in float32 (float64 for float64 inputs)
    log p(y) = z_y - logsumexp(z)
    H = logsumexp(z) - sum_v p_v z_v

and the backward pass applies the chain rule through the same steps, with p = softmax(z) and
upstream gradients g (log-probs) and g_H (entropy):

    dL/dz_k = g (1[k = y] - p_k) - g_H p_k (log p_k + H)
    dL/dc_k = dL/dz_k / T, and 0 at the banned ids (the fill is a constant)
    dL/dl_k = dL/dc_k (1 - tanh^2(l_k / cap))          (1 without soft-capping)
    dL/dhidden = dL/dl @ W,   dL/dW = dL/dl.T @ hidden,   dL/db = sum over rows of dL/dl

The matrix products run in the inputs' dtype (bf16 inputs: bf16 products with the block's
gradient rounded to bf16, as autograd rounds the plain route's logit gradient); the weight and
bias gradients are summed over blocks in float32 and cast to the weight's dtype at the end.
A tied head (W is the input embedding) needs nothing special: autograd adds this gradient to the
embedding's own.
"""

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from lightrft.algorithms.checks import check_ndim

# Rows of logits per block: 1024 x 151,936 float32 logits are 0.6 GB; a block's backward holds two
# or three tensors of that size (logits, probabilities, the soft-cap's derivative).
CHUNK_TOKENS = 1024
BANNED_FILL = -1e9  # the value `ActorLanguage._without_banned` gives banned logits (float32 and wider)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(rows: int, chunk_tokens: int) -> Iterator[slice]:
    for start in range(0, rows, chunk_tokens):
        yield slice(start, min(start + chunk_tokens, rows))


def _scaled_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, banned: Tensor | None,
                   temperature: float, softcap: float | None) -> Tensor:
    """z = transform(hidden @ W.T + b) / T for one block, in the compute dtype (a fresh tensor).
    Shape: hidden (n, H), weight (V, H) -> (n, V)"""
    logits = F.linear(hidden, weight, bias)  # (n, V) in the inputs' dtype, a fresh tensor
    z = logits.to(_compute_dtype(logits.dtype))  # itself when already float32 / float64
    del logits
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    if banned is not None:
        z.index_fill_(-1, banned, BANNED_FILL)
    return z.div_(temperature) if temperature != 1.0 else z


class _HeadLogProbs(torch.autograd.Function):
    """(log p(label), entropy) per row from hidden states and the LM head (see the module doc)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, banned, temperature, softcap, want_entropy, chunk_tokens):
        rows = hidden.size(0)
        dtype = _compute_dtype(hidden.dtype)
        log_probs = torch.empty(rows, dtype=dtype, device=hidden.device)
        log_norm = torch.empty_like(log_probs)  # (N,) logsumexp of z, reused by backward
        entropy = torch.empty_like(log_probs) if want_entropy else None
        for block in _chunks(rows, chunk_tokens):
            z = _scaled_logits(hidden[block], weight, bias, banned, temperature, softcap)  # (n, V)
            log_norm[block] = torch.logsumexp(z, dim=-1)
            log_probs[block] = z.gather(-1, labels[block].unsqueeze(-1)).squeeze(-1) - log_norm[block]
            if entropy is not None:
                probs = (z - log_norm[block].unsqueeze(-1)).exp_()
                entropy[block] = log_norm[block] - probs.mul_(z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, labels, banned, log_norm, entropy)
        ctx.temperature, ctx.softcap, ctx.chunk_tokens = temperature, softcap, chunk_tokens
        # Unused outputs get None as gradient, not zeros: a loss on the log-probs alone skips the
        # entropy's terms.
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, bias, labels, banned, log_norm, entropy = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        if grad_log_probs is None and grad_entropy is None:
            return (None,) * 9
        temperature, softcap = ctx.temperature, ctx.softcap
        dtype = _compute_dtype(hidden.dtype)
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        # Summed over blocks in float32 (float64), cast to the parameters' dtype at the end.
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if needs_bias else None
        for block in _chunks(hidden.size(0), ctx.chunk_tokens):
            h = hidden[block]  # (n, H)
            log_p = _scaled_logits(h, weight, bias, banned, temperature, softcap)  # (n, V) z, then log p
            # The soft-cap's derivative 1 - tanh^2(l / cap), from z = cap * tanh(l / cap) / T.
            cap_slope = log_p.mul(temperature / softcap).square_().neg_().add_(1) if softcap is not None else None
            log_p.sub_(log_norm[block].unsqueeze(-1))
            grad = _block_grad(log_p, labels[block], _rows_of(grad_log_probs, block, dtype),
                               _rows_of(grad_entropy, block, dtype), entropy[block] if entropy is not None else None)
            del log_p
            if temperature != 1.0:
                grad.div_(temperature)
            if cap_slope is not None:
                grad.mul_(cap_slope)
                del cap_slope
            if banned is not None:
                grad.index_fill_(-1, banned, 0.0)
            if needs_bias:
                grad_bias.add_(grad.sum(0))
            grad = grad.to(weight.dtype)  # (n, V): the products run in the inputs' dtype
            if needs_hidden:
                grad_hidden[block] = grad @ weight
            if needs_weight:
                if grad_weight.dtype == weight.dtype:
                    grad_weight.addmm_(grad.T, h)
                else:
                    grad_weight.add_(grad.T @ h)
        grad_weight = grad_weight.to(weight.dtype) if needs_weight else None
        grad_bias = grad_bias.to(bias.dtype) if needs_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def _rows_of(grad: Tensor | None, block: slice, dtype: torch.dtype) -> Tensor | None:
    """The upstream gradient of one block as a column (n, 1), or None."""
    return None if grad is None else grad[block].to(dtype).unsqueeze(-1)


def _block_grad(log_p: Tensor, labels: Tensor, grad_lp: Tensor | None, grad_h: Tensor | None,
                entropy: Tensor | None) -> Tensor:
    """dL/dz = g (onehot(label) - p) - g_H p (log p + H) for one block; consumes `log_p`.
    Shape: log_p (n, V), labels (n,), grad_lp, grad_h (n, 1) or None, entropy (n,) -> (n, V)"""
    probs = log_p.exp()
    if grad_h is not None:
        coef = log_p.add_(entropy.unsqueeze(-1)).mul_(grad_h)  # g_H (log p + H), in place of log p
        if grad_lp is not None:
            coef.add_(grad_lp)
        grad = probs.mul_(coef).neg_()
    else:
        grad = probs.mul_(-grad_lp)
    if grad_lp is not None:
        grad.scatter_add_(-1, labels.unsqueeze(-1), grad_lp)
    return grad


def _check_inputs(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None, temperature: float,
                  softcap: float | None, banned_ids: Tensor | None, chunk_tokens: int) -> None:
    check_ndim("hidden", hidden, 2, "(N, H)")
    check_ndim("weight", weight, 2, "(V, H)")
    if weight.size(1) != hidden.size(1):
        raise ValueError(f"weight has shape {tuple(weight.shape)} but hidden has shape {tuple(hidden.shape)}; "
                         f"weight must be (V, {hidden.size(1)})")
    if tuple(labels.shape) != (hidden.size(0),):
        raise ValueError(f"labels has shape {tuple(labels.shape)} but hidden has shape {tuple(hidden.shape)}; "
                         f"labels must have shape ({hidden.size(0)},)")
    if bias is not None and tuple(bias.shape) != (weight.size(0),):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; it must have shape ({weight.size(0)},), one per "
                         "vocabulary entry of weight")
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.dtype != hidden.dtype:
            raise ValueError(f"{name} is {tensor.dtype} but hidden is {hidden.dtype}; the head's inputs must share "
                             "one dtype, as the model's own head computes them")
    if banned_ids is not None and banned_ids.dim() != 1:
        raise ValueError(f"banned_ids must be a 1-D tensor of token ids; got shape {tuple(banned_ids.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0 or None; got {softcap}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an int >= 1; got {chunk_tokens!r}")


def log_probs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    banned_ids: Tensor | None = None,
    return_entropy: bool = False,
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[Tensor, Tensor | None]:
    """Log-probability of each row's label, and optionally the entropy, under the LM head
    (`weight`, `bias`) applied to `hidden`, with the logits transformed as the module doc writes
    (soft-cap, banned ids, temperature); the logits of at most `chunk_tokens` rows exist at once.

    Equal to `log_probs_from_logits(transform(hidden @ weight.T + bias), labels, temperature)` and
    `entropy_from_logits(...)` (no shift: align hidden states and labels before calling), in
    values and in gradients with respect to `hidden`, `weight` and `bias`. Returns float32
    (float64 for float64 inputs); entropy is None unless `return_entropy`.
    Shape: hidden (N, H), weight (V, H), labels (N,), bias (V,), banned_ids (k,) -> (N,), (N,)
    """
    _check_inputs(hidden, weight, labels, bias, temperature, softcap, banned_ids, chunk_tokens)
    banned = banned_ids.to(device=hidden.device, dtype=torch.long) if banned_ids is not None else None
    log_probs, entropy = _HeadLogProbs.apply(hidden, weight, bias, labels.long(), banned, float(temperature),
                                             None if softcap is None else float(softcap), return_entropy,
                                             chunk_tokens)
    return log_probs, entropy
