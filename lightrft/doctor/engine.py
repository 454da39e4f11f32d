"""Engine check: the rollout engine's log-probs against the trainer's, and a weight-sync round trip.

1. The engine samples responses to real prompts at the run's temperature (top-k/top-p off, so both
   sides score the same distribution); the actor scores the same tokens in a teacher-forced
   forward. Their gap (mean and max over response tokens) is what truncated importance sampling
   (`--tis_cap`) would have to correct.
2. A few of the actor's weights (embeddings, last decoder layer, final norm and head) are moved by
   a small seeded amount, large enough to shift its log-probs well past the tolerance; the rollout
   manager is told the weights changed (`mark_stale`), samples again (which syncs), and the engine's
   log-probs must now match the moved actor. An engine whose sync does not arrive still scores with
   the old weights and fails. The weights are then put back and synced again.
"""

import re
from contextlib import contextmanager

import torch

from lightrft.config.run import PPORunConfig
from lightrft.experience.placement import arrive
from lightrft.models.media import media_keywords
from lightrft.doctor.report import CheckResult
from lightrft.rollout.base import RolloutOutput, SamplingParams
from lightrft.rollout.checks import ENGINE_GAP_TOLERANCE, engine_gap_tolerance

# Largest mean / max gap per response token (nats) between engine and trainer log-probs, by the
# run's precision: the numbers every training step checks too (`lightrft.rollout.checks`).
TOLERANCE = ENGINE_GAP_TOLERANCE


def sampling_params(config: PPORunConfig, seed: int) -> SamplingParams:
    """The run's temperature, response length and samples per prompt; top-k/top-p off."""
    return SamplingParams(temperature=config.rollout.temperature, max_new_tokens=config.rollout.generate_max_len,
                          n=config.algorithm.n_samples_per_prompt, seed=seed)


@torch.no_grad()
def actor_log_probs(run, rollout: RolloutOutput, replay_routes: bool = False) -> torch.Tensor:
    """The actor's log-probs of the rollout's response tokens, 0 on padding; `replay_routes`: a
    mixture-of-experts actor replays the rollout's routes (`RolloutOutput.routes`). Shape: (B, A)."""
    actor, device, micro = run.trainer.actor, run.strategy.device, run.args.rollout.micro_rollout_batch_size
    actor.eval()
    out = []
    for i in range(0, rollout.sequences.size(0), micro):
        rows = slice(i, i + micro)
        routes = {"routes": rollout.routes[rows].to(device)} if replay_routes else {}
        out.append(actor(rollout.sequences[rows].to(device), rollout.num_actions,
                         attention_mask=rollout.attention_mask[rows].to(device), **routes,
                         **media_keywords(rollout.media[rows] if rollout.media is not None else None)).float().cpu())
    return torch.cat(out) * rollout.action_mask.float()


def gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Mean and max |a - b| over the masked positions."""
    diff = (a.float() - b.float()).abs()[mask.bool()]
    return (diff.mean().item(), diff.max().item()) if diff.numel() else (0.0, 0.0)


def perturbed_names(module: torch.nn.Module) -> list[str]:
    """Parameters outside the decoder layers (embeddings, final norm, head) and those of the last layer."""
    names = [n for n, p in module.named_parameters()]
    layers = [int(m.group(1)) for n in names if (m := re.search(r"\.(\d+)\.", n))]
    last = max(layers, default=None)
    return [n for n in names if not re.search(r"\.\d+\.", n) or f".{last}." in n]


@contextmanager
def moved_weights(run, scale: float, seed: int):
    """Adds scale x mean|w| x N(0, 1) to `perturbed_names` of the actor (the same noise on every
    rank), yields, and restores the exact old values."""
    strategy = run.strategy
    module = strategy.unwrap_model(run.trainer.actor)
    params = dict(module.named_parameters())
    generator = torch.Generator().manual_seed(seed)
    saved = {}
    with gathered(strategy, [params[n] for n in perturbed_names(module)]):
        for name in perturbed_names(module):
            param = params[name]
            saved[name] = param.data.detach().to("cpu", copy=True)
            noise = torch.randn(param.shape, generator=generator) * scale * param.data.float().abs().mean().cpu()
            param.data.add_(noise.to(param.device, param.dtype))
    try:
        yield
    finally:
        with gathered(strategy, [params[n] for n in saved]):
            for name, value in saved.items():
                params[name].data.copy_(value.to(params[name].device))


@contextmanager
def gathered(strategy, params: list):
    """Whole parameters to change in place: under ZeRO-3 gathered and written back to the shards
    when the block ends; otherwise the parameters themselves."""
    if strategy.config.zero_stage != 3:
        yield
        return
    # The strategy has no public "modify gathered parameters" helper yet; DeepSpeed's own does it.
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        yield


def check_engine(run, prompts: list[str], prompt_ids: list[list[int]], rollout: RolloutOutput) -> CheckResult:
    """`rollout` was sampled from `prompts` (tokenised to `prompt_ids`; with their images, when they
    carry some) through the run's rollout manager with `sampling_params`."""
    config, strategy, manager = run.args, run.strategy, run.trainer.rollout
    engine, seed = config.rollout.rollout_engine, config.distributed.seed
    result = CheckResult("engine", f"{engine} engine log-probs vs the trainer's, weight-sync round trip")
    tol_mean, tol_max = engine_gap_tolerance(config.distributed.bf16)
    mask = rollout.action_mask
    before = actor_log_probs(run, rollout)
    gap_now = gap(rollout.rollout_log_probs, before, mask)

    # Move the weights enough to be seen: the actor's own log-probs must change by 20x the tolerance.
    scale, effect = 0.02, (0.0, 0.0)
    for _ in range(6):
        with moved_weights(run, scale, seed):
            effect = gap(actor_log_probs(run, rollout), before, mask)
        effect = tuple(strategy.all_reduce(torch.tensor(effect), op="min").tolist())
        if effect[0] >= 20 * tol_mean:
            break
        scale *= 4
    params = sampling_params(config, seed + strategy.rank + 1)
    with moved_weights(run, scale, seed):
        manager.mark_stale()
        generator = run.trainer.experience_services.generator
        inputs = generator.engine_inputs(prompts)
        moved_rollout = arrive(generator.with_media(manager.generate(prompt_ids, params, **inputs),
                                                    inputs.get("media"), params.n))
        gap_moved = gap(moved_rollout.rollout_log_probs, actor_log_probs(run, moved_rollout), moved_rollout.action_mask)
    manager.mark_stale()
    manager.sync_weights()

    gaps = strategy.all_reduce(torch.tensor([*gap_now, *gap_moved]), op="max").tolist()
    result.figures.update(gap_mean=gaps[0], gap_max=gaps[1], moved_gap_mean=gaps[2], moved_gap_max=gaps[3],
                          weight_change_effect_mean=effect[0], perturbation_scale=scale, tolerance=(tol_mean, tol_max),
                          response_tokens=int(mask.sum()), syncs=manager.syncs,
                          shares_live_weights=manager.shares_live_weights)
    result.rows += [("engine vs trainer log-probs", "mean gap", "max gap", "tolerance (mean / max)"),
                    ("as built", f"{gaps[0]:.2e}", f"{gaps[1]:.2e}", f"{tol_mean:.0e} / {tol_max:.0e}"),
                    ("after moving the weights and a sync", f"{gaps[2]:.2e}", f"{gaps[3]:.2e}",
                     f"(the move alone shifts them by {effect[0]:.2e})")]
    judge_engine(result, gaps, effect, (tol_mean, tol_max), engine)
    return result


def judge_engine(result: CheckResult, gaps: list[float], effect: tuple, tol: tuple[float, float],
                 rollout_engine: str) -> None:
    tol_mean, tol_max = tol
    if gaps[0] > tol_mean:
        result.add("FAIL", f"the engine's log-probs differ from the trainer's by {gaps[0]:.2e} per token on average "
                           f"(tolerance {tol_mean:.0e}): the engine samples from another policy than the one trained; "
                           "check that --pretrain, --bf16 and --temperature reach both, or set --tis_cap")
    elif gaps[1] > tol_max:
        result.add("WARN", f"largest engine vs trainer log-prob gap {gaps[1]:.2e} (tolerance {tol_max:.0e}); "
                           "--tis_cap bounds the importance weights such tokens get")
    if effect[0] < 20 * tol_mean:
        result.add("WARN", f"moving the weights shifted the actor's log-probs by only {effect[0]:.2e}: the sync round "
                           "trip cannot tell a missing sync from a good one on this model")
    elif gaps[2] > tol_mean:
        result.add("FAIL", f"after the trainer's weights moved and the engine was synced, their log-probs differ by "
                           f"{gaps[2]:.2e} per token (the move itself: {effect[0]:.2e}): the weight sync does not "
                           f"reach the {rollout_engine} engine, so every rollout after the first step would come "
                           "from stale weights")
    if not result.findings:
        result.add("PASS", f"the engine scores its samples as the trainer does (mean gap {gaps[0]:.1e}) and follows "
                           f"the trainer's weights after a sync (mean gap {gaps[2]:.1e})")
