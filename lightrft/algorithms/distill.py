"""On-policy distillation: a teacher's per-token signal on the student's own samples.

The student samples y ~ pi_S; a teacher sharing its tokenizer scores the same tokens. With
d_t = log pi_S(y_t) - log pi_T(y_t) on each sampled token, the reverse KL of a response is
KL(pi_S || pi_T) = E_{y ~ pi_S}[sum_t d_t] (GKD, Agarwal et al. 2024, arXiv 2306.13649, with
student-generated data and the reverse KL; MiniLLM, Gu et al. 2024; Thinking Machines' "On-policy
distillation", 2025). Two forms, `--distill_mode`:

    reward   r_t = coef * (log pi_T(y_t) - log pi_S(y_t)) = -coef * d_t, a dense per-token reward
             added to the token rewards before the returns, as the KL penalty is. With gamma = 1
             the policy gradient of its return is the gradient of -coef * KL(pi_S || pi_T) of the
             whole response; it needs an estimator that reads per-token rewards.
    loss     coef * d_t^2 / 2 (the k2 estimator) on the student's current log-probs. On-policy its
             gradient d_t * grad log pi_S(y_t) is the per-token part of the reverse-KL gradient
             (no credit to earlier tokens); it works beside any estimator, GRPO's included.

Both bound one token's d (or k2) as `--kl_clamp` bounds the KL (`lightrft.algorithms.kl`): a
token the teacher finds nearly impossible (log pi_T = -30) does not outweigh a whole batch.
"""

from torch import Tensor

from lightrft.algorithms.kl import compute_approx_kl

DISTILL_MODES = ("reward", "loss")


def distill_token_rewards(student_log_probs: Tensor, teacher_log_probs: Tensor, action_mask: Tensor | None,
                          coef: float, clamp: str = "scale") -> Tensor:
    """Per-token distillation rewards r_t = coef * (log pi_T(y_t) - log pi_S(y_t)), with d_t
    bounded to [-10, 10] under `clamp`; 0 outside `action_mask`.
    Shape: student_log_probs, teacher_log_probs, action_mask (B, A) -> (B, A)."""
    return -coef * compute_approx_kl(student_log_probs, teacher_log_probs, action_mask, "k1", clamp)


def distill_loss_per_token(log_probs: Tensor, teacher_log_probs: Tensor, action_mask: Tensor | None,
                           clamp: str = "scale") -> Tensor:
    """The per-token reverse-KL loss (log pi_S(y_t) - log pi_T(y_t))^2 / 2, differentiable in
    `log_probs` (the student's current log-probs); 0 outside `action_mask`. Aggregated like the
    policy loss and weighted by `--distill_coef` by the caller.
    Shape: log_probs, teacher_log_probs, action_mask (B, A) -> (B, A)."""
    return compute_approx_kl(log_probs, teacher_log_probs.detach(), action_mask, "k2", clamp)
