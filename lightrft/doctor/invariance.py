"""Invariance check on the user's model: the policy loss and gradient of one batch must not depend
on how it is laid out.

The batch is one `--micro_train_batch_size` of real generated samples (at least 2), with the
trainer's own policy loss (`--policy_loss`, `--loss_agg_mode`, normalised by the batch's token and
sequence counts as `PPOTrainer` does) and advantages of +-1, so a loss gap reads directly as a gap
in probability ratios. It is computed, in training mode as the trainer runs it, as
- one padded micro-batch (the reference),
- two padded micro-batches whose losses add up,
- one packed micro-batch (when the architecture packs exactly),
- one padded micro-batch with a prompt forward per sample (when the actor shares a prompt's
  forward among its samples, `lightrft.models.shared_prompts`: the reference layout shares it),
and the old log-probs come from an eval-mode forward, as in experience making: the ratio of the
first update must be exactly 1. Dropout left on (`--keep_dropout`), attention that leaks across
padding or packed borders, or batch-dependent kernels show up here as gaps.

Gradients are taken with `torch.autograd.grad` (nothing accumulates into `.grad`, no optimizer step).
"""

from contextlib import contextmanager, nullcontext

import torch

from lightrft.doctor.report import CheckResult
from lightrft.experience.samples import Experience, collate_samples, split_experience

# Largest gap by the run's precision: loss (absolute, advantages +-1), gradient norm (relative),
# log-probs (max absolute, nats).
TOLERANCE = {"float32": {"loss": 1e-5, "grad_norm": 1e-4, "log_prob": 1e-4},
             "bfloat16": {"loss": 2e-2, "grad_norm": 5e-2, "log_prob": 0.25}}


def batch_samples(rollout, size: int, seed: int):
    """The first `size` samples of a rollout as replay-buffer Samples with +-1 advantages."""
    rows = slice(0, size)
    mask = rollout.action_mask[rows].bool()
    generator = torch.Generator().manual_seed(seed)
    advantages = (torch.randint(0, 2, mask.shape, generator=generator).float() * 2 - 1) * mask   # (B, A)
    zeros = torch.zeros(mask.shape)
    experience = Experience(sequences=rollout.sequences[rows], attention_mask=rollout.attention_mask[rows],
                            action_mask=mask, num_actions=mask.size(1), packed_seq_lens=None,
                            action_log_probs=zeros, advantages=advantages, returns=zeros)
    return split_experience(experience)


def forward(run, batch: Experience, train: bool) -> torch.Tensor:
    # The module inside the DeepSpeed engine: the engine's forward arms its gradient reduction,
    # which must not run for gradients that are only measured.
    actor = run.strategy.unwrap_model(run.trainer.actor)
    actor.train(train)
    batch = batch.to(run.strategy.device)
    return actor(batch.sequences, batch.num_actions, attention_mask=batch.attention_mask,
                 packed_seq_lens=batch.packed_seq_lens)


def loss_and_grad(run, micro_batches: list[Experience], counts: dict) -> tuple[float, float, torch.Tensor]:
    """Summed policy loss over micro-batches (one training-mode forward each), the norm of its
    gradient, and the log-probs (rows in sample order, (B, A))."""
    trainer = run.trainer
    params = [p for p in run.strategy.unwrap_model(trainer.actor).parameters() if p.requires_grad]
    total, log_probs = 0.0, []
    for batch in micro_batches:
        lp = forward(run, batch, train=True)
        loss = trainer.actor_loss_fn(lp, batch.action_log_probs.to(lp.device), batch.advantages.to(lp.device),
                                     action_mask=batch.action_mask.to(lp.device),
                                     global_num_tokens=counts["tokens"], global_num_seqs=counts["seqs"],
                                     norm_len=trainer.algo.norm_len)
        total = total + loss
        log_probs.append(lp.detach().float().cpu())
    grads = torch.autograd.grad(total, params, allow_unused=True)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)).item()
    width = max(x.size(1) for x in log_probs)
    log_probs = torch.cat([torch.nn.functional.pad(x, (0, width - x.size(1))) for x in log_probs])
    return float(total.detach()), norm, log_probs


UNSHARED = "1 padded, prompt per sample"


@contextmanager
def unshared_prompts(module):
    """The actor with a prompt forward per sample for the duration."""
    before = module.share_prompts
    module.share_prompts = False
    try:
        yield
    finally:
        module.share_prompts = before


def packing_problem(run) -> str | None:
    """Why this model cannot take packed rows, or None when it can."""
    module = run.strategy.unwrap_model(run.trainer.actor)
    try:
        module.check_packing()
    except (ValueError, NotImplementedError) as err:
        return str(err)
    return None


def max_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    width = mask.size(1)
    diff = (a[:, :width] - b[:, :width]).abs()[mask.bool()]
    return diff.max().item() if diff.numel() else 0.0


def check_invariance(run, rollout) -> CheckResult:
    config, strategy, pad = run.args, run.strategy, run.tokenizer.pad_token_id
    keep_dropout = config.model.keep_dropout
    size = max(2, min(config.optim.micro_train_batch_size, rollout.sequences.size(0)))
    result = CheckResult("invariance", f"loss and gradient of {size} samples: 1 vs 2 micro-batches, padded vs "
                                       "packed, shared vs per-sample prompt forward, train vs eval forward")
    tol = TOLERANCE["bfloat16" if config.distributed.bf16 else "float32"]
    samples = batch_samples(rollout, size, config.distributed.seed)
    whole = collate_samples(samples, pad, packing=False)
    with torch.no_grad():
        old = forward(run, whole, train=False).float().cpu()           # (B, A) as experience making scores them
    for i, sample in enumerate(samples):
        sample.per_action["action_log_probs"] = old[i, :sample.num_actions]
    whole = collate_samples(samples, pad, packing=False)
    half = size // 2
    counts = {"tokens": float(whole.action_mask.sum()), "seqs": float(size)}
    layouts = {"1 padded micro-batch": [whole],
               "2 padded micro-batches": [collate_samples(samples[:half], pad, False),
                                          collate_samples(samples[half:], pad, False)]}
    cannot_pack = packing_problem(run)
    if cannot_pack is None:
        layouts["1 packed micro-batch"] = [collate_samples(samples, pad, packing=True)]
    module = strategy.unwrap_model(run.trainer.actor)
    if getattr(module, "share_prompts", False):
        layouts[UNSHARED] = [whole]
    measured = {}
    for name, batches in layouts.items():
        with unshared_prompts(module) if name == UNSHARED else nullcontext():
            measured[name] = loss_and_grad(run, batches, counts)
    ref_loss, ref_norm, ref_lp = measured["1 padded micro-batch"]
    mask = whole.action_mask
    local = [max_gap(ref_lp, old, mask)]
    for name, (loss, norm, lp) in measured.items():
        local += [abs(loss - ref_loss), abs(norm - ref_norm) / max(ref_norm, 1e-12), max_gap(lp, ref_lp, mask)]
    gaps = strategy.all_reduce(torch.tensor(local, dtype=torch.float64), op="max").tolist()
    result.figures.update(samples=size, tolerance=tol, train_vs_eval_log_prob_gap=gaps[0], packed=cannot_pack is None)
    result.rows.append(("layout", "loss", "grad norm", "loss gap", "grad norm gap (rel)", "max log-prob gap"))
    for k, (name, (loss, norm, _)) in enumerate(measured.items()):
        loss_gap, norm_gap, lp_gap = gaps[1 + 3 * k: 4 + 3 * k]
        result.figures[name] = {"loss": loss, "grad_norm": norm, "loss_gap": loss_gap, "grad_norm_gap": norm_gap,
                                "log_prob_gap": lp_gap}
        result.rows.append((name, f"{loss:.6f}", f"{norm:.6f}", f"{loss_gap:.1e}", f"{norm_gap:.1e}", f"{lp_gap:.1e}"))
        if name != "1 padded micro-batch" and (loss_gap > tol["loss"] or norm_gap > tol["grad_norm"]
                                               or lp_gap > tol["log_prob"]):
            result.add("FAIL", f"{name} gives another loss or gradient than 1 padded micro-batch (loss gap "
                               f"{loss_gap:.1e}, grad norm gap {norm_gap:.1e}, log-prob gap {lp_gap:.1e}; tolerance "
                               f"{tol['loss']:.0e} / {tol['grad_norm']:.0e} / {tol['log_prob']:.0e}): "
                               + invariance_hint(keep_dropout, name))
    result.rows.append(("train vs eval forward", "", "", "", "", f"{gaps[0]:.1e}"))
    if gaps[0] > tol["log_prob"]:
        result.add("FAIL", f"the training forward's log-probs differ from the eval forward's by up to {gaps[0]:.1e} "
                           "on the same tokens, so the first PPO update sees ratios != 1: "
                           + ("dropout is on (--keep_dropout); drop the flag" if keep_dropout else
                              "some layer behaves differently in training mode (dropout or batch statistics)"))
    if cannot_pack is not None:
        result.add("PASS", f"padded vs packed not compared: this model cannot pack exactly ({cannot_pack})")
    if not any(f.level != "PASS" for f in result.findings):
        result.add("PASS", "the loss and gradient do not depend on how the batch is split, padded or packed, or on "
                           "whether samples share their prompt's forward")
    return result


def invariance_hint(keep_dropout: bool, layout: str) -> str:
    if keep_dropout:
        return "dropout is on (--keep_dropout) and draws new masks per forward; drop the flag"
    if layout == UNSHARED:
        return ("sharing a prompt's forward among its samples changes this model's output; pass --no_prompt_sharing "
                "and report the model")
    if "packed" in layout:
        return ("packed rows attend across their borders or lose positions; try another --attn_implementation, or "
                "train without --packing_samples")
    return ("the model's output depends on the other rows or the padding (attention mask or position ids); try "
            "another --attn_implementation")
