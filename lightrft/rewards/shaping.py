"""Reward shaping terms added to the task reward."""

import torch


def overlong_penalty(response_lengths: torch.Tensor, max_len: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), times
    `penalty_factor`:

        R(|y|) = 0                                   if |y| <= L_max - L_cache
               = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
               = -1                                  if |y| > L_max

    with L_max = `max_len` (the generation limit, `--generate_max_len`) and L_cache =
    `buffer_len` (`--overlong_buffer_len`). The penalty falls linearly from 0 to -1 over the last
    `buffer_len` tokens before the limit. Add it to the task reward.
    Shape: (B,) -> (B,) float32, values in [-penalty_factor, 0].
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer_len must be in (0, max_len={max_len}] (--overlong_buffer_len), "
                         f"got {buffer_len}")
    if penalty_factor < 0:
        raise ValueError(f"overlong penalty_factor must be >= 0 (--overlong_penalty_factor), got {penalty_factor}")
    lengths = response_lengths.to(torch.float32)
    expected = max_len - buffer_len
    penalty = ((expected - lengths) / buffer_len).clamp(min=-1.0, max=0.0)
    return penalty * penalty_factor
