"""Routing replay (`lightrft.utils.routing`): the experts each token went through are recorded
(by the Hugging Face engine, or by a forward) and replayed in later forwards, the choice fixed and
the gate weights live. Checked on six mixture-of-experts families: replaying the recorded routes
changes nothing; other routes give what a hand-written router with that fixed choice gives (values
and router gradients); the rollout's routes make a trainer whose router flips near-ties reproduce
the engine's log-probs; padded = packed = shared-prompt rows."""

import copy
import importlib.util
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, GptOssConfig, Qwen2MoeConfig

from lightrft.experience.samples import Experience, collate_samples, split_experience
from lightrft.models import ActorLanguage
from lightrft.utils.routing import NO_ROUTE, RoutingReplay, RoutingUnsupported, find_routers
from lightrft.rollout.base import RolloutOutput, SamplingParams
from lightrft.rollout.hf_engine import hf_engine_for
from lightrft.utils.tiny import build_char_tokenizer, build_tiny_arch, save_tiny_arch, tiny_tokenizer

_SIZES = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
              max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# Families beyond the architecture matrix's four, at tiny size: their routers differ (softmax after
# top-k with a router bias; shared experts beside the routed ones).
EXTRA = {
    "qwen2_moe": lambda: Qwen2MoeConfig(**_SIZES, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "gpt_oss": lambda: GptOssConfig(**_SIZES, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                    head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
}
FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", *EXTRA]


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny float32 model of `family` with seeded weights (std 0.1: routers far from uniform)."""
    if family not in EXTRA:
        return build_tiny_arch(family, tiny_tokenizer(family), seed=seed).float().eval()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(EXTRA[family]()).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.1)
    return model


def tokens(seed: int = 0, shape=(3, 11)) -> torch.Tensor:
    return torch.randint(4, 100, shape, generator=torch.Generator().manual_seed(seed))


def shifted(routes: torch.Tensor, experts: int) -> torch.Tensor:
    """Every recorded expert id moved to the next (mod `experts`): another valid top-k choice."""
    return torch.where(routes >= 0, (routes.long() + 1) % experts, routes.long()).to(routes.dtype)


def record(routing: RoutingReplay, model, ids) -> torch.Tensor:
    routing.start_recording()
    with torch.no_grad():
        model(input_ids=ids)
    routes = routing.take()
    routing.stop_recording()
    assert len(routes) == 1
    return routes[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_replaying_the_recorded_routes_changes_nothing_and_other_routes_do(family):
    model = build(family)
    routing = RoutingReplay(model)
    ids = tokens()
    routes = record(routing, model, ids)
    assert routes.shape == (ids.numel(), routing.layers, 2) and routes.dtype == torch.int8
    assert routing.layers == 2      # DeepSeek-V3's tiny config: a dense first layer, then 2 MoE layers
    with torch.no_grad():
        live = model(input_ids=ids).logits
        routing.replay(routes)
        replayed = model(input_ids=ids).logits
        assert routing.take_agreement() == (ids.numel() * routing.layers, 0)
        routing.replay(shifted(routes, routing.num_experts))
        other = model(input_ids=ids).logits
        pairs, flips = routing.take_agreement()
    assert torch.equal(replayed, live)
    assert (other - live).abs().max() > 0.1
    assert pairs == ids.numel() * routing.layers and flips > pairs // 2


def hand_router(top_k: int, norm: bool, chosen: torch.Tensor):
    """A softmax-then-top-k router (Qwen3-MoE, Mixtral) written out with the choice fixed to
    `chosen` (N, K): the scores of the chosen experts from the live softmax, normalised."""
    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        weights = probs.gather(1, chosen)
        if norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), chosen
    return forward


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_replayed_routes_equal_a_hand_written_router_with_the_same_fixed_choice(family):
    model = build(family)
    reference = copy.deepcopy(model)
    routing = RoutingReplay(model)
    ids = tokens(1)
    routes = shifted(record(routing, model, ids), routing.num_experts)
    for layer, router in enumerate(find_routers(reference)):
        norm = getattr(router, "norm_topk_prob", True)
        router.forward = types.MethodType(hand_router(router.top_k, norm, routes[:, layer].long()), router)
    routing.replay(routes)
    out = model(input_ids=ids).logits
    expected = reference(input_ids=ids).logits
    (out.square().mean()).backward()
    (expected.square().mean()).backward()
    assert (out - expected).abs().max() < 1e-6
    for mine, theirs in zip(routing.routers, find_routers(reference)):
        assert mine.weight.grad.abs().sum() > 0                        # the router still learns
        assert torch.allclose(mine.weight.grad, theirs.weight.grad, atol=1e-7, rtol=1e-5)


def near_tied(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose routers score experts 1 and 2 alike up to a relative 1e-6 (expert 2's row is
    expert 1's scaled by 1 + 1e-6): where the two compete for the last top-k slot, the copy's
    choice flips by the sign of the score, a difference far below float tolerance."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for router in find_routers(copied):
            router.weight[2] = router.weight[1] * (1 + 1e-6)
    return copied


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_rollout_routes_make_a_flipping_trainer_reproduce_the_engine(family):
    tokenizer = tiny_tokenizer(family)
    engine_model = build(family)
    with torch.no_grad():
        for router in find_routers(engine_model):
            router.weight[2] = router.weight[1]          # exact ties between experts 1 and 2
    trainer_model = near_tied(engine_model)
    engine_actor = ActorLanguage(engine_model, routing_replay="rollout")
    engine = hf_engine_for(engine_actor.model, tokenizer)
    prompts = [tokenizer.encode(text) for text in ("12+7=", "a long prompt here", "x")]
    rollout = engine.generate(prompts, SamplingParams(max_new_tokens=10, n=2, seed=0))
    assert rollout.routes is not None and rollout.routes.shape[:2] == rollout.sequences.shape
    # Every real token that a forward saw has its routes (all but the last of the longest
    # responses, whose decoding stopped there); padding has none.
    recorded = (rollout.routes >= 0).all(dim=-1).all(dim=-1)
    real = rollout.attention_mask.bool()
    assert torch.equal(recorded.sum(dim=1), real.sum(dim=1) - real[:, -1].long())
    assert not recorded[~real].any()

    actor = ActorLanguage(trainer_model, routing_replay="rollout")
    mask = rollout.action_mask
    args = (rollout.sequences, rollout.num_actions)
    live = actor(*args, attention_mask=rollout.attention_mask)
    replayed = actor(*args, attention_mask=rollout.attention_mask, routes=rollout.routes)
    pairs, flips = actor.routing.take_agreement()
    live_gap = ((live - rollout.rollout_log_probs).abs() * mask).max()
    replayed_gap = ((replayed - rollout.rollout_log_probs).abs() * mask).max()
    assert flips > 0 and live_gap > 1e-2, (flips, live_gap)        # the flips move log-probs by far more than 1e-5
    assert replayed_gap < 1e-5
    ratios = torch.exp(replayed - rollout.rollout_log_probs)[mask]
    assert (ratios - 1).abs().max() < 1e-5
    # The gate weights still receive gradients through the replayed forward.
    replayed = actor(*args, attention_mask=rollout.attention_mask, routes=rollout.routes)
    (replayed * mask).sum().backward()
    assert all(router.weight.grad.abs().sum() > 0 for router in actor.routing.routers)


def test_engine_routes_are_those_of_a_teacher_forced_forward():
    """The routes the engine records while decoding (prefill, then a token per step) are the
    choices a forward over the whole sequence makes (no near-ties in a random tiny model)."""
    tokenizer = tiny_tokenizer("qwen3_moe")
    actor = ActorLanguage(build("qwen3_moe"), routing_replay="rollout")
    rollout = hf_engine_for(actor.model, tokenizer).generate(
        [tokenizer.encode(t) for t in ("3+4=", "hello", "q")], SamplingParams(max_new_tokens=8, n=2, seed=1))
    routing = actor.routing
    routing.record_rollouts = False
    routing.start_recording()
    with torch.no_grad():
        actor(rollout.sequences, rollout.num_actions, attention_mask=rollout.attention_mask)
    forward = routing.take()[0].view(*rollout.sequences.shape, routing.layers, -1)
    routing.stop_recording()
    recorded = (rollout.routes >= 0).all(dim=-1).all(dim=-1)
    same = (rollout.routes.sort(dim=-1).values == forward.sort(dim=-1).values).all(dim=-1).all(dim=-1)
    assert recorded.sum() > 40 and same[recorded].all()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "qwen2_moe"])
def test_padded_packed_and_shared_prompt_rows_replay_alike(family):
    """Routes other than the live ones, so replay decides every expert: the padded batch, the
    packed row and the packed row sharing prompts give the same log-probs."""
    model = build(family)
    actor = ActorLanguage(model, routing_replay="old", packing_samples=True)
    tokenizer = build_char_tokenizer()
    prompts = [tokenizer.encode("12+7="), tokenizer.encode("abc")]
    responses = [[20, 21, 22], [30, 2], [40, 41, 42, 43], [50]]
    rollout = RolloutOutput.from_token_lists([prompts[0], prompts[0], prompts[1], prompts[1]], responses,
                                             [[0.0] * len(r) for r in responses], 0, [2])
    routing = actor.routing
    routing.start_recording()
    with torch.no_grad():
        actor(rollout.sequences, rollout.num_actions, attention_mask=rollout.attention_mask)
    routes = routing.take()[0].view(*rollout.sequences.shape, routing.layers, -1)
    routing.stop_recording()
    routes = shifted(routes, routing.num_experts)
    routes[~rollout.attention_mask.bool()] = NO_ROUTE
    zeros = torch.zeros(rollout.action_mask.shape)
    exp = Experience(sequences=rollout.sequences, attention_mask=rollout.attention_mask,
                     action_mask=rollout.action_mask, num_actions=rollout.num_actions, packed_seq_lens=None,
                     action_log_probs=None, advantages=zeros, returns=zeros, routes=routes)
    samples = split_experience(exp)
    padded = collate_samples(samples, 0, packing=False)
    packed = collate_samples(samples, 0, packing=True)
    assert packed.prompt_groups == [0, 0, 2, 2] and packed.routes.shape[1] == sum(packed.packed_seq_lens)
    with torch.no_grad():
        expected = actor(padded.sequences, padded.num_actions, attention_mask=padded.attention_mask,
                         routes=padded.routes)
        live = actor(padded.sequences, padded.num_actions, attention_mask=padded.attention_mask)
        unshared = actor(packed.sequences, packed.num_actions, packed_seq_lens=packed.packed_seq_lens,
                         routes=packed.routes)
        shared = actor(packed.sequences, packed.num_actions, packed_seq_lens=packed.packed_seq_lens,
                       routes=packed.routes, prompt_groups=packed.prompt_groups)
    mask = padded.action_mask
    assert actor.prompt_sharing.reason is None
    assert ((expected - live).abs() * mask).max() > 1e-2          # the routes matter
    assert ((unshared - expected).abs() * mask).max() < 1e-5
    assert ((shared - expected).abs() * mask).max() < 1e-5


def test_a_dense_model_and_misshapen_routes_are_refused_with_the_flag():
    with pytest.raises(RoutingUnsupported, match="--pretrain: routing replay needs a mixture-of-experts model"):
        ActorLanguage(build_tiny_arch("qwen2"), routing_replay="rollout")
    actor = ActorLanguage(build("mixtral"), routing_replay="old")
    ids = tokens(shape=(1, 6))
    with pytest.raises(ValueError, match="routes must be \\(tokens, 2 MoE layers, top-k 2\\)"):
        actor(ids, 2, attention_mask=torch.ones_like(ids), routes=torch.zeros(1, 6, 3, 2, dtype=torch.int8))
    with pytest.raises(ValueError, match="the routes cover 5 tokens but MoE layer 0's router saw 6"):
        actor(ids, 2, attention_mask=torch.ones_like(ids), routes=torch.zeros(1, 5, 2, 2, dtype=torch.int8))
    plain = ActorLanguage(build("mixtral"))
    with pytest.raises(ValueError, match="routing replay is off for this model"):
        plain(ids, 2, attention_mask=torch.ones_like(ids), routes=torch.zeros(1, 6, 2, 2, dtype=torch.int8))


def test_train_ppo_replays_routes_logs_their_agreement_and_resumes_exactly(tmp_path, capsys):
    """GRPO through `train_ppo` on a tiny Qwen3-MoE with packed rows: replaying the old policy's
    routes trains like live routing (the Hugging Face engine decodes with the trainer's own
    module, so nothing flips); replaying the rollout's, with a KL reference that replays them too,
    has on-policy ratios 1, logs routing/* (flip share 0), and a run saved at step 2 and resumed
    ends with the uninterrupted run's weights bit for bit; what has no routes is refused."""
    from tests.trainer.ppo_harness import make_task, max_weight_change, run

    task = make_task(tmp_path)
    task["model"] = save_tiny_arch(tmp_path / "moe", "qwen3_moe")
    flags = dict(packing_samples=True, max_steps=2)
    live_logs, live = run(task, tmp_path / "off", **flags)
    old_logs, old = run(task, tmp_path / "old", routing_replay="old", **flags)
    rollout = dict(flags, routing_replay="rollout", init_kl_coef=0.01, save_steps=2, max_steps=4)
    replayed_logs, replayed = run(task, tmp_path / "rollout", **rollout)
    run(task, tmp_path / "cut", **{**rollout, "max_steps": 2})
    resumed_logs, resumed = run(task, tmp_path / "cut", **rollout, load_checkpoint=True)
    assert "routing/flip_share" not in live_logs and "routing/flip_share" not in old_logs
    assert replayed_logs["routing/flip_share"] == 0.0
    assert replayed_logs["routing/logprob_gap_replayed"] < 1e-5 and replayed_logs["routing/logprob_gap_live"] < 1e-5
    for logs in (replayed_logs, old_logs):
        assert abs(logs["train/ratio_max"] - 1) < 1e-5 and abs(logs["train/ratio_min"] - 1) < 1e-5
    assert replayed_logs["rollout/kl"] > 0
    # Float rounding only: replayed and live routes pick the same experts. Measured up to 1.2e-5 on an
    # AVX2-only CPU (the rounding depends on the CPU's vector kernels).
    assert max_weight_change(live, old) < 5e-5
    assert resumed_logs["rollout/kl"] == replayed_logs["rollout/kl"] and max_weight_change(replayed, resumed) == 0.0
    with pytest.raises(SystemExit):
        run(task, tmp_path / "vllm", routing_replay="rollout", rollout_engine="vllm", **flags)
    assert "--routing_replay rollout cannot be combined with --rollout_engine vllm" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_packed_rows_share_prompts_with_the_load_balancing_loss(family):
    """A shared-prompt row counts each prompt token once per sample sharing it in the router
    statistics: the unshared row's load-balancing loss, log-probs and gradients (the routers'
    included), with the prompts computed once."""
    tokenizer = build_char_tokenizer()
    prompts = [tokenizer.encode("12+7="), tokenizer.encode("abc")]
    responses = [[20, 21, 22], [30, 2], [40, 41, 42, 43], [50], [60, 61]]
    rows = [prompts[0], prompts[0], prompts[1], prompts[1], prompts[1]]
    sequences = [torch.tensor(p + r) for p, r in zip(rows, responses)]
    ids, lens, actions = torch.cat(sequences).unsqueeze(0), [len(s) for s in sequences], [len(r) for r in responses]
    results = {}
    for shared in (False, True):
        actor = ActorLanguage(build(family), packing_samples=True)
        calls = []
        inner = actor._shared_row_forward
        actor._shared_row_forward = lambda *args: calls.append(1) or inner(*args)
        log_probs, output = actor(ids, actions, packed_seq_lens=lens, return_output=True, return_aux_loss=True,
                                  prompt_groups=[0, 0, 2, 2, 2] if shared else None)
        (log_probs.sum() + 10 * output["aux_loss"]).backward()
        assert len(calls) == int(shared)
        results[shared] = (log_probs.detach(), output["aux_loss"].detach(),
                           [r.weight.grad.clone() for r in find_routers(actor.model)])
    (lp, aux, grads), (lp_shared, aux_shared, grads_shared) = results[False], results[True]
    assert aux > 0.5 and abs(aux_shared - aux) < 1e-6
    assert (lp_shared - lp).abs().max() < 1e-5
    for g, g_shared in zip(grads, grads_shared):
        assert g.abs().max() > 1e-4 and torch.allclose(g_shared, g, atol=1e-6, rtol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_why_vllms_cpu_build_returns_no_routes():
    """vLLM captures routed experts (`enable_return_routed_experts`) in its second-generation GPU
    model runner only; the CPU build's runner derives from the first-generation one, which has no
    capture. So `--routing_replay rollout` refuses vLLM (`EngineCapabilities.routes` is False) and
    `old` replays the trainer's own old-policy routes. When this fails, the CPU runner can return
    routes and lightrft's vLLM engine should ask for them."""
    import inspect

    from vllm.v1.worker import cpu_model_runner, gpu_model_runner
    from vllm.v1.worker.gpu import model_runner as runner_v2

    assert "aux_output_connector" in inspect.getsource(runner_v2)          # where vLLM captures routes
    assert cpu_model_runner.CPUModelRunner.__mro__[1] is gpu_model_runner.GPUModelRunner
    assert "aux_output" not in inspect.getsource(gpu_model_runner)
    assert "aux_output" not in inspect.getsource(cpu_model_runner)
    from lightrft.rollout import engine_capabilities
    assert not engine_capabilities("vllm").routes and engine_capabilities("hf").routes
