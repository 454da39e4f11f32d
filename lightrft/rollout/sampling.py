"""One decoding step of token sampling: filters and the draw, as pure functions of logits.

The log-probability reported for a sampled token is log softmax(logits / T) of the *unfiltered*
logits: the distribution the trainer's actor computes, not the top-k/top-p renormalised one the
token was drawn from. Importance-sampling corrections between the rollout engine and the trainer
compare like with like that way.
"""

import torch


def filter_top_k_top_p(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Sets logits outside the top-k tokens, and outside the smallest set whose probability
    reaches top_p (nucleus sampling, Holtzman et al. 2019, arXiv 1904.09751), to -inf.

    The most likely token is always kept. `top_k=0` and `top_p=1.0` switch the filters off.
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


def sample_next_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
    banned_token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws one token per row and returns it with its log-probability.

    Tokens are drawn from softmax(filter(logits) / T) with `banned_token_ids` removed (used for
    `min_new_tokens`); `temperature == 0` takes the argmax instead. The returned log-prob is
    log softmax(logits / T)[token] on the raw logits, with T = 1 for greedy decoding.
    Shape: logits (B, V) float -> tokens (B,) long, log_probs (B,) float32.
    """
    logits = logits.float()
    scale = temperature if temperature > 0 else 1.0
    log_probs = torch.log_softmax(logits / scale, dim=-1)  # (B, V), reported distribution

    draw_logits = logits
    if banned_token_ids is not None and banned_token_ids.numel() > 0:
        draw_logits = draw_logits.clone()
        draw_logits[:, banned_token_ids] = float("-inf")
    if temperature == 0:
        tokens = draw_logits.argmax(dim=-1)
    else:
        filtered = filter_top_k_top_p(draw_logits / temperature, top_k, top_p)
        probs = torch.softmax(filtered, dim=-1)
        tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
