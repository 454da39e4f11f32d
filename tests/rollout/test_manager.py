"""RolloutManager's lifecycle with a recording engine, and the weight buckets it syncs from
(`DeepspeedStrategy.iter_parameter_buckets` on a plain model; ZeRO-3 in dist_vllm_sync.py)."""

import pytest
import torch

from lightrft.rollout import EngineCapabilities, HFEngine, RolloutManager, RolloutOutput, SamplingParams
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from lightrft.strategy.deepspeed_strategy import _fused_group_key
from tests.rollout.contract import build_contract_model


class RecordingEngine:
    """Records the calls a manager makes; refuses what a real separate engine refuses."""

    # A separate copy of the weights that sleep may drop (it does not say it keeps them).
    capabilities = EngineCapabilities(weight_syncs=frozenset({"full", "delta"}), sleep=True)
    sync_bucket_mb = 0.25
    weight_sync = "auto"
    weight_dtype = None

    def __init__(self):
        self.calls = []
        self.asleep = False

    def generate(self, prompt_token_ids, params, seeds=None):
        assert not self.asleep, "generated while asleep"
        self.calls.append(("generate", seeds))
        return RolloutOutput.from_token_lists(prompt_token_ids, [[2]] * len(prompt_token_ids),
                                              [[-1.0]] * len(prompt_token_ids), 0, [2])

    def update_weights(self, named_params):
        assert not self.asleep, "loaded weights while asleep"
        self.calls.append(("update", [name for name, _ in named_params]))

    def sleep(self):
        self.asleep = True
        self.calls.append(("sleep",))

    def wake_up(self):
        self.asleep = False
        self.calls.append(("wake_up",))


def kinds(engine):
    return [call[0] for call in engine.calls]


def test_wake_sync_only_when_stale_generate_sleep():
    engine = RecordingEngine()
    buckets = [[("a.weight", torch.zeros(2))], [("b.weight", torch.zeros(3)), ("b.bias", torch.zeros(1))]]
    manager = RolloutManager(engine, lambda: iter(buckets))
    params = SamplingParams(max_new_tokens=2)
    assert manager.stale  # a separate engine may hold other weights than the actor (resume)

    manager.generate([[5]], params, seeds=[7])
    assert engine.calls == [("update", ["a.weight"]), ("update", ["b.weight", "b.bias"]), ("generate", [7])]
    assert manager.syncs == 1 and manager.last_sync_bytes == (2 + 3 + 1) * 4

    manager.sleep()
    manager.sleep()  # idempotent
    manager.generate([[5]], params)  # evaluation after the rollout: wakes, weights still current
    assert kinds(engine)[3:] == ["sleep", "wake_up", "generate"]

    manager.sleep()
    manager.mark_stale()  # an optimizer phase ended
    manager.generate([[5]], params)
    assert kinds(engine)[6:] == ["sleep", "wake_up", "update", "update", "generate"]
    assert manager.syncs == 2 and not manager.stale


def test_a_live_weight_engine_is_never_synced():
    tokenizer, model = build_contract_model()
    engine = HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    manager = RolloutManager(engine)
    assert not manager.stale
    manager.mark_stale()
    out = manager.generate([tokenizer.encode("abc")], SamplingParams(temperature=0.0, max_new_tokens=3))
    assert manager.syncs == 0 and not manager.stale and out.sequences.shape[0] == 1


def test_a_separate_engine_needs_a_weight_source():
    with pytest.raises(ValueError, match="needs weight_buckets"):
        RolloutManager(RecordingEngine())


def test_for_actor_syncs_from_the_strategy_in_the_engine_bucket_size():
    _, model = build_contract_model(hidden_size=128)

    class Actor(torch.nn.Module):  # the ActorLanguage layout: the HF model under `.model`
        def __init__(self):
            super().__init__()
            self.model = model

    engine = RecordingEngine()
    manager = RolloutManager.for_actor(engine, DeepspeedStrategy(StrategyConfig()), Actor())
    manager.sync_weights()
    loaded = [name for call in engine.calls for name in call[1]]
    assert loaded == [name for name, _ in model.named_parameters()]
    assert len(engine.calls) > 2  # 0.25 MB buckets split this 1.5 MB model


@pytest.mark.parametrize("name, key", [
    ("model.layers.3.self_attn.q_proj.weight", "model.layers.3"),
    ("model.layers.12.mlp.experts.7.up_proj.weight", "model.layers.12"),
    ("model.embed_tokens.weight", "model.embed_tokens"),
    ("lm_head.weight", "lm_head"),
    ("model.norm.weight", "model.norm"),
])
def test_fused_group_key_is_the_decoder_layer_or_the_module(name, key):
    assert _fused_group_key(name) == key


@pytest.mark.parametrize("bucket_mb", [0.01, 0.3, 1.0, 100.0])
def test_buckets_cover_every_parameter_once_with_whole_layers(bucket_mb):
    _, model = build_contract_model(hidden_size=128)
    strategy = DeepspeedStrategy(StrategyConfig())
    buckets = list(strategy.iter_parameter_buckets(model, bucket_mb))
    names = [name for bucket in buckets for name, _ in bucket]
    assert names == [name for name, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    for bucket in buckets:
        for name, tensor in bucket:
            assert torch.equal(tensor, params[name])
    # A layer never straddles two buckets.
    owner = {}
    for i, bucket in enumerate(buckets):
        for name, _ in bucket:
            assert owner.setdefault(_fused_group_key(name), i) == i
    # Buckets stay under the size unless one group alone is larger.
    limit = bucket_mb * 2**20
    for bucket in buckets:
        groups = {_fused_group_key(name) for name, _ in bucket}
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= limit or len(groups) == 1
    if bucket_mb == 100.0:
        assert len(buckets) == 1
    if bucket_mb == 0.01:
        assert len(buckets) == len({_fused_group_key(n) for n in names})  # one group each


def test_buckets_strip_the_prefix_and_reject_a_bad_size():
    _, model = build_contract_model()
    wrapper = torch.nn.Module()
    wrapper.model = model
    strategy = DeepspeedStrategy(StrategyConfig())
    names = [name for bucket in strategy.iter_parameter_buckets(wrapper, 1.0, prefix="model.") for name, _ in bucket]
    assert names == [name for name, _ in model.named_parameters()]
    with pytest.raises(ValueError, match="--vllm_sync_bucket_mb"):
        list(strategy.iter_parameter_buckets(model, 0))
