"""One decoding step of token sampling: filters and the draw, as pure functions of logits.

Reported log-probabilities are those of the distribution the token was drawn from: the
log-softmax of the logits after the `min_new_tokens` ban, the temperature and the top-k/top-p
filters, renormalised over the kept tokens (vLLM's `logprobs_mode="processed_logprobs"`). That is
the behaviour policy mu of the rollout, the denominator an importance weight pi_old / mu needs
(docs/rollout.md, "Log-prob semantics"). With the filters off it equals log softmax(logits / T),
what the trainer's actor computes; greedy decoding reports temperature-1 values.

Draws use inverse-CDF sampling from one uniform per row and step, supplied by the caller, so
each row can come from its own seeded stream while the step stays one vectorised operation.
"""

import torch


def filter_top_k_top_p(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sets logits outside the top-k tokens, and outside the smallest set whose probability
    reaches top_p (nucleus sampling, Holtzman et al. 2019, arXiv 1904.09751), to -inf.

    Top-k applies first and top-p to the distribution it leaves (vLLM's order). The most likely
    token is always kept. `top_k=0` and `top_p=1.0` switch the filters off.
    Shape: (B, V) -> (B, V); returns a new tensor.
    """
    logits = logits.clone()
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits.masked_fill_(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocab order
        logits.masked_fill_(drop, float("-inf"))
    return logits


def inverse_cdf_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative-probability interval holds each row's uniform draw.

    Tokens of probability 0 are never returned, also when rounding puts the draw past the
    last cumulative sum. Shape: probs (B, V), uniforms (B,) in [0, 1) -> tokens (B,) long.
    """
    cdf = torch.cumsum(probs.double(), dim=-1)  # (B, V), float64 so the tail keeps its resolution
    targets = (uniforms.double().to(probs.device) * cdf[:, -1]).unsqueeze(-1)  # (B, 1)
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1)  # first index with cdf > target
    vocab = probs.shape[-1]
    last_positive = vocab - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)  # (B,)
    return torch.minimum(tokens, last_positive)


def sample_next_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    uniforms: torch.Tensor | None,
    banned_token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws one token per row and returns it with its log-probability.

    Tokens are drawn from softmax(filter((logits with `banned_token_ids` at -inf) / T)) by
    inverse CDF with `uniforms` (one per row, in [0, 1)); `temperature == 0` takes the argmax
    instead and needs no uniforms. The returned log-prob is that of the same distribution (T = 1
    for greedy), see the module docstring.
    Shape: logits (B, V) float, uniforms (B,) -> tokens (B,) long, log_probs (B,) float32.
    """
    logits = logits.float()
    if banned_token_ids is not None and banned_token_ids.numel() > 0:
        logits = logits.clone()
        logits[:, banned_token_ids] = float("-inf")
    if temperature == 0:
        log_probs = torch.log_softmax(logits, dim=-1)  # (B, V)
        tokens = logits.argmax(dim=-1)
    else:
        if uniforms is None:
            raise ValueError("sampling at temperature > 0 needs one uniform draw per row")
        log_probs = torch.log_softmax(filter_top_k_top_p(logits / temperature, top_k, top_p), dim=-1)
        tokens = inverse_cdf_draw(log_probs.exp(), uniforms)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
