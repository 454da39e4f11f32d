"""The doctor's `moe` check: for a mixture-of-experts policy, how often the trainer's router
chooses other experts than the rollout engine did on a sample batch, and whether routing replay
closes the log-prob gap that makes.

The run's engine samples the batch (the Hugging Face engine recording each token's experts; the
check installs routing replay on the actor for the measurement when the run has it off). The actor
then scores the samples twice, routed live and replaying the engine's routes: the share of (token,
MoE layer) pairs whose expert set differs, and the mean and max log-prob gap to the engine's both
ways. An engine that records no routes (vLLM) gets the live gap only, and the advice to replay
the old policy's routes. A dense policy passes at once.
"""

import torch

from lightrft.doctor.engine import actor_log_probs, gap, sampling_params
from lightrft.doctor.report import CheckResult
from lightrft.experience.placement import arrive
from lightrft.utils.routing import RoutingReplay, find_routers
from lightrft.rollout.manager import engine_capabilities_of
from lightrft.rollout.checks import engine_gap_tolerance


def check_moe(run, prompts: list[str], prompt_ids: list[list[int]]) -> CheckResult:
    config, strategy = run.args, run.strategy
    engine = config.rollout.rollout_engine
    result = CheckResult("moe", f"mixture-of-experts routing: the trainer's experts vs the {engine} engine's, "
                                "and the log-prob gap with and without routing replay")
    actor = strategy.unwrap_model(run.trainer.actor)
    routers = find_routers(actor.model)
    if not routers:
        result.add("PASS", "the policy is dense (no router modules): nothing to check")
        return result
    mode = config.model.routing_replay
    result.figures.update(moe_layers=len(routers), experts=routers[0].num_experts, top_k=routers[0].top_k,
                          routing_replay=mode)
    records = engine_capabilities_of(run.trainer.rollout.engine).routes
    installed = actor.routing is None and records
    if installed:        # for this measurement only: the engine records, the actor replays
        actor.routing = RoutingReplay(actor.model, record_rollouts=True)
    elif actor.routing is not None and records:
        actor.routing.record_rollouts = True
    try:
        generator = run.trainer.experience_services.generator
        params = sampling_params(config, config.distributed.seed + strategy.rank + 7)
        inputs = generator.engine_inputs(prompts)
        rollout = arrive(generator.with_media(run.trainer.rollout.generate(prompt_ids, params, **inputs),
                                              inputs.get("media"), params.n))
        live = gap(rollout.rollout_log_probs, actor_log_probs(run, rollout), rollout.action_mask)
        if rollout.routes is None:
            figures = strategy.all_reduce(torch.tensor(live), op="max").tolist()
            result.figures.update(gap_live_mean=figures[0], gap_live_max=figures[1])
            result.rows += [("routed", "mean gap", "max gap"), ("live", f"{figures[0]:.2e}", f"{figures[1]:.2e}")]
            result.add("WARN", f"the {engine} engine records no routes, so the trainer's routing cannot be compared "
                               f"with the engine's (live log-prob gap {figures[0]:.1e} mean, {figures[1]:.1e} max); "
                               "--routing_replay old keeps the routing fixed across a rollout's optimizer steps")
            return result
        actor.routing.take_agreement()
        replayed = gap(rollout.rollout_log_probs, actor_log_probs(run, rollout, replay_routes=True),
                       rollout.action_mask)
        pairs, flips = actor.routing.take_agreement()
    finally:
        if installed:
            actor.routing = None
        elif actor.routing is not None:
            actor.routing.record_rollouts = mode == "rollout"
    totals = strategy.all_reduce(torch.tensor([float(pairs), float(flips)]), op="sum").tolist()
    gaps = strategy.all_reduce(torch.tensor([*live, *replayed]), op="max").tolist()
    share = totals[1] / totals[0] if totals[0] else 0.0
    result.figures.update(pairs=int(totals[0]), flips=int(totals[1]), flip_share=share, gap_live_mean=gaps[0],
                          gap_live_max=gaps[1], gap_replayed_mean=gaps[2], gap_replayed_max=gaps[3])
    result.rows += [("routed", "mean gap", "max gap", "(token, MoE layer) pairs with other experts"),
                    ("live (no replay)", f"{gaps[0]:.2e}", f"{gaps[1]:.2e}", f"{int(totals[1])} of {int(totals[0])}"),
                    ("replaying the engine's routes", f"{gaps[2]:.2e}", f"{gaps[3]:.2e}", "0")]
    tol_mean, _ = engine_gap_tolerance(config.distributed.bf16)
    if gaps[2] > tol_mean:
        result.add("FAIL", f"even replaying the engine's routes the trainer's log-probs differ by {gaps[2]:.2e} per "
                           f"token (tolerance {tol_mean:.0e}): the gap is not the routing's (see the engine check)")
    elif totals[1] > 0 and mode != "rollout":
        result.add("WARN", f"the trainer routes {share:.1%} of (token, MoE layer) pairs to other experts than the "
                           f"engine did (live gap {gaps[0]:.1e}, replayed {gaps[2]:.1e}): turn on --routing_replay "
                           "rollout (docs/moe.md)")
    else:
        result.add("PASS", f"routing agrees on {1 - share:.1%} of (token, MoE layer) pairs; replaying the engine's "
                           f"routes leaves a log-prob gap of {gaps[2]:.1e} (live: {gaps[0]:.1e})")
    return result
