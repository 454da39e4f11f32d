"""Routing replay for mixture-of-experts models: record the experts each token went through, and
make a later forward send every token through the same experts.

A rollout engine and the trainer choose experts independently: where two router scores are
nearly tied, another kernel, dtype or batch shape flips the choice, the flips compound over
layers, and a token's log-prob can differ by nats. Routing replay fixes the discrete choice to the
one recorded (the rollout's, or the old policy's forward) and keeps the gate weights live: the
chosen experts' weights are the live router's scores gathered at the recorded experts, so the
router still learns.

How: every MoE layer of a Hugging Face model has a router module (`Qwen3MoeTopKRouter`,
`MixtralTopKRouter`, `DeepseekV3TopkRouter`, ...) that picks its top-k experts with `topk` over
the (tokens, experts) scores. Within a router's forward, a torch function mode (thread-local)
sees that one call: recording keeps its indices, replay returns the recorded indices and the
scores gathered there instead. Everything the router computes around it (softmax before or after,
normalisation, scaling, bias corrections) is the family's own code, so every family whose router
chooses with `topk` is served alike, and what gets replayed is exactly the selection.

Routes are laid out per token of a sequence: (tokens, MoE layers, top-k), int8 where the experts'
ids fit (at most 127 experts), else int16; -1 marks a token with no record (padding, a response's
last token, which no engine forward sees), whose experts the live router chooses.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

NO_ROUTE = -1
# --routing_replay: off; replay the rollout's routes (R3); replay the old policy's forward's (R2).
ROUTING_REPLAY_MODES = ("off", "rollout", "old")


class RoutingUnsupported(ValueError):
    """The model has no router routing replay knows."""


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed integer type holding expert ids and the -1 of a token without a record."""
    return torch.int8 if num_experts <= 127 else torch.int16


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The router modules of `model`'s MoE layers, in layer order: modules whose class name has
    "Router", with integer `top_k` and `num_experts` (every MoE family of transformers 5 has one
    per sparse layer). Empty for a dense model."""
    routers = []
    for module in model.modules():
        if ("router" in type(module).__name__.lower() and isinstance(getattr(module, "top_k", None), int)
                and isinstance(getattr(module, "num_experts", None), int)):
            routers.append(module)
    return routers


class _Plan:
    """What the routers of one model do in the current forward (shared by its `_RouterState`s)."""

    def __init__(self):
        self.routes: torch.Tensor | None = None       # (N, L, K) replayed, or None: live routing
        self.pending: torch.Tensor | None = None      # what the next decoder forward replays
        self.armed = False                            # whether `pending` was set for it
        self.recording = False
        self.recorded: dict[int, list[torch.Tensor]] = {}
        self.flips = torch.zeros(())                  # (token, layer) pairs whose live set differed
        self.pairs = torch.zeros(())                  # (token, layer) pairs replayed
        self.token_counts: list[tuple[torch.Tensor, torch.Tensor]] | None = None   # per router call, per token


class _RouterState:
    """One router's layer index and the model's plan; kept on the router module, so a copy of the
    model (`copy.deepcopy`) gets its own."""

    def __init__(self, layer: int, plan: _Plan, num_experts: int, top_k: int):
        self.layer, self.plan, self.num_experts, self.top_k = layer, plan, num_experts, top_k
        self.mode: _ChoiceMode | None = None
        self.calls = 0


class _ChoiceMode(TorchFunctionMode):
    """Active only inside one router's forward: the `topk` over (tokens, experts) scores with the
    router's k is the expert choice, recorded or replaced."""

    def __init__(self, state: _RouterState):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.topk or func is torch.Tensor.topk:
            scores = args[0]
            k = args[1] if len(args) > 1 else kwargs.get("k")
            if (isinstance(scores, torch.Tensor) and scores.dim() == 2 and scores.size(-1) == self.state.num_experts
                    and int(k) == self.state.top_k):
                return self._choose(func, scores, args, kwargs)
        return func(*args, **kwargs)

    def _choose(self, func, scores: torch.Tensor, args, kwargs):
        state, plan = self.state, self.state.plan
        state.calls += 1
        live = func(*args, **kwargs)
        if plan.recording:
            plan.recorded.setdefault(state.layer, []).append(live.indices.detach())
        if plan.routes is None:
            return live
        if plan.routes.size(0) != scores.size(0):
            raise ValueError(f"routing replay: the routes cover {plan.routes.size(0)} tokens but MoE layer "
                             f"{state.layer}'s router saw {scores.size(0)}: the routes must be laid out like the "
                             "forward's tokens")
        fixed = plan.routes[:, state.layer].to(device=scores.device, dtype=torch.long)         # (N, K)
        known = (fixed >= 0).all(dim=-1, keepdim=True)                                       # (N, 1)
        chosen = torch.where(known, fixed, live.indices)
        differs = (chosen.sort(dim=-1).values != live.indices.sort(dim=-1).values).any(dim=-1)
        plan.flips = plan.flips.to(scores.device) + differs.sum()
        plan.pairs = plan.pairs.to(scores.device) + known.sum()
        if plan.token_counts is not None:
            plan.token_counts.append((differs & known.squeeze(-1), known.squeeze(-1)))
        return torch.return_types.topk((scores.gather(-1, chosen), chosen))


def _enter(module, args):
    state = module._lightrft_routing
    state.mode = _ChoiceMode(state)
    state.mode.__enter__()


def _start_forward(module, args, kwargs):
    """Before each decoder forward: replay what was set for it, else route live. A recomputation
    under gradient checkpointing runs layers, not the decoder, so it keeps the forward's routes."""
    plan = module._lightrft_routing_plan
    plan.routes = plan.pending if plan.armed else None
    plan.pending, plan.armed = None, False


def _leave(module, args, output):
    state = module._lightrft_routing
    if state.mode is not None:
        state.mode.__exit__(None, None, None)
        state.mode = None


class RoutingReplay:
    """Records and replays the expert choice of every MoE layer of `model` (a Hugging Face model,
    or a peft wrapper of one). Raises `RoutingUnsupported` for a model without routers.

    - `replay(routes)` sets the routes of the next decoder forward (and of its recomputation under
      gradient checkpointing): (N, L, K) in the forward's token order (a padded batch's rows one
      after another; a packed row's tokens), `NO_ROUTE` where the live router chooses; None: live
      routing. A decoder forward nothing was set for routes live (a rollout engine's, say).
    - `recording()`/`take()` collect the live choices of the forwards in between:
      one (N, L, K) tensor per forward.
    - `take_agreement()`: the (token, layer) pairs replayed since the last call and how many of
      them the live router would have routed to another expert set.
    """

    def __init__(self, model: nn.Module, flag: str = "--pretrain", record_rollouts: bool = False):
        routers = find_routers(model)
        if not routers:
            raise RoutingUnsupported(f"{flag}: routing replay needs a mixture-of-experts model whose MoE layers "
                                     f"have a router module choosing experts with topk; {type(model).__name__} has "
                                     "none (drop --routing_replay for a dense model)")
        self.plan = _Plan()
        self.row_routes: torch.Tensor | None = None
        self.routers = routers
        # The Hugging Face engine decoding with this model records each rollout's routes (`recorder_of`).
        self.record_rollouts = record_rollouts
        object.__setattr__(model, "_lightrft_routing_replay", self)
        self.top_k = routers[0].top_k
        self.num_experts = max(r.num_experts for r in routers)
        if any(r.top_k != self.top_k for r in routers):
            raise RoutingUnsupported(f"{flag}: routing replay needs one top-k over the MoE layers, got "
                                     f"{sorted({r.top_k for r in routers})}")
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        if not hasattr(decoder, "_lightrft_routing_plan"):
            decoder.register_forward_pre_hook(_start_forward, with_kwargs=True)
        decoder._lightrft_routing_plan = self.plan
        for layer, router in enumerate(routers):
            if not hasattr(router, "_lightrft_routing"):
                router.register_forward_pre_hook(_enter)
                router.register_forward_hook(_leave, always_call=True)
            router._lightrft_routing = _RouterState(layer, self.plan, router.num_experts, router.top_k)

    @property
    def layers(self) -> int:
        return len(self.routers)

    @property
    def dtype(self) -> torch.dtype:
        return route_dtype(self.num_experts)

    def replay(self, routes: torch.Tensor | None, keep_row: bool = False) -> None:
        """`routes` (N, L, K) for the next forward, None for live routing. `row_routes` keeps what
        the caller gave; `keep_row` leaves it (a layout of them for another token order)."""
        if routes is not None and (routes.dim() != 3 or routes.size(1) != self.layers or routes.size(2) != self.top_k):
            raise ValueError(f"routing replay: routes must be (tokens, {self.layers} MoE layers, top-k {self.top_k}), "
                             f"got {tuple(routes.shape)}: were they recorded with another model?")
        self.plan.pending, self.plan.armed = routes, True
        if not keep_row:
            self.row_routes = routes

    def start_recording(self) -> None:
        self.plan.recording = True
        self.plan.recorded = {}

    def stop_recording(self) -> None:
        self.plan.recording = False
        self.plan.recorded = {}

    def take(self) -> list[torch.Tensor]:
        """The choices recorded since the last `take` (or `start_recording`): per forward, an
        (N, L, K) tensor in its token order. Raises when a layer's router did not choose with topk."""
        recorded, self.plan.recorded = self.plan.recorded, {}
        if not recorded:
            return []
        calls = {len(v) for v in recorded.values()}
        if len(recorded) != self.layers or len(calls) != 1:
            missing = [i for i in range(self.layers) if i not in recorded]
            raise RoutingUnsupported(f"routing replay: MoE layers {missing} chose no experts with topk in the "
                                     "recorded forwards: this family's router is not one routing replay knows")
        return [torch.stack([recorded[layer][i] for layer in range(self.layers)], dim=1).to(self.dtype)
                for i in range(calls.pop())]

    def count_per_token(self, on: bool) -> None:
        """Start (or stop and drop) counting flips per token (`take_token_counts`)."""
        self.plan.token_counts = [] if on else None

    def take_token_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token of the forwards since `count_per_token(True)`, one forward's tokens after
        another's: the MoE layers where the live router would have chosen another expert set,
        and the layers replayed. Shape: (N,) long, (N,) long."""
        counts, self.plan.token_counts = self.plan.token_counts or [], []
        forwards = [counts[i:i + self.layers] for i in range(0, len(counts), self.layers)]
        flips = [torch.stack([f for f, _ in calls]).sum(dim=0) for calls in forwards]
        pairs = [torch.stack([k for _, k in calls]).sum(dim=0) for calls in forwards]
        if not flips:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        return torch.cat(flips), torch.cat(pairs)

    def take_agreement(self) -> tuple[int, int]:
        """(pairs replayed, pairs whose live expert set differed) since the last call."""
        pairs, flips = int(self.plan.pairs), int(self.plan.flips)
        self.plan.pairs, self.plan.flips = torch.zeros(()), torch.zeros(())
        return pairs, flips


def routing_of(model) -> RoutingReplay | None:
    """The `RoutingReplay` of a policy (an `ActorLanguage`, the DeepSpeed engine around one, or a
    LoRA actor's adapter-disabled reference, which shares the actor's), or None."""
    for candidate in (model, getattr(model, "module", None), getattr(model, "actor", None)):
        routing = getattr(candidate, "routing", None) if candidate is not None else None
        if isinstance(routing, RoutingReplay):
            return routing
    return None


def recorder_of(model: nn.Module) -> RoutingReplay | None:
    """The `RoutingReplay` installed on `model` (a Hugging Face model, or a peft wrapper of one)
    when it records rollouts, else None: what a rollout engine decoding with it consults."""
    routing = getattr(model, "_lightrft_routing_replay", None)
    if routing is None and hasattr(model, "get_base_model"):
        routing = getattr(model.get_base_model(), "_lightrft_routing_replay", None)
    return routing if routing is not None and routing.record_rollouts else None


def padded_routes(routes: torch.Tensor) -> torch.Tensor:
    """(B, T, L, K) routes of a padded batch in the forward's token order: (B*T, L, K)."""
    return routes.reshape(-1, routes.size(-2), routes.size(-1))


def load_balancing_loss(router_logits, num_experts: int, top_k: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The mixture-of-experts load-balancing loss (Switch Transformer eq. 4, as transformers computes it
    over a packed row: E x sum_e f_e P_e, f the share of top-k assignments to each expert and P the
    mean router probability, over every layer's tokens) from the router logits (one (S, E) tensor per
    layer), each token counted `weights` times (S,): a shared-prompt row's prompt tokens once per
    sample that shares them, so the value is the unshared row's. None: each token once."""
    tokens = router_logits[0].size(0)
    w = torch.ones(tokens) if weights is None else weights.float()
    w = w.to(router_logits[0].device)
    routed = torch.zeros(num_experts, device=w.device)
    prob_sums = torch.zeros(num_experts, device=w.device)
    for layer in router_logits:
        probs = torch.softmax(layer, dim=-1)             # in the router's dtype, as transformers does
        chosen = torch.topk(probs, top_k, dim=-1).indices                                         # (S, k)
        routed = routed.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        prob_sums = prob_sums + (probs.float() * w.unsqueeze(-1)).sum(dim=0)
    total = w.sum() * len(router_logits)
    return num_experts * ((routed / total) * (prob_sums / total)).sum()
