"""Ulysses sequence parallelism: a packed row split over two ranks computes what the unsplit row
does (log-probs, entropies, KL, losses and weight gradients to float rounding), for grouped-query
attention, sliding windows (on some layers, on all), soft-capped attention, multi-head attention,
gradient checkpointing, compiled decoder layers (`--torch_compile`), the critic's values, a mixture
of experts' load-balancing loss and vision-language policies (Idefics3, Qwen2/2.5/3-VL); and what
cannot be split is refused with the reason."""

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, LlamaConfig

from lightrft.models import ActorLanguage
from lightrft.models.sequence_parallel import SequenceParallel
from tests.conftest import read_json_lines, run_torchrun

HERE = Path(__file__).parent
ATOL = 1e-5
ARCHS = ("qwen2_gqa_window", "mistral_window", "gemma2_softcap", "llama_mha", "qwen2_gqa_window_checkpointing",
         "qwen2_gqa_window_compiled")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("sequence_parallel")
    run_torchrun([HERE / "dist_sequence_parallel.py", "--out", out / "run.jsonl"], nproc=2)
    return [{r["check"]: r for r in read_json_lines(out / f"run.jsonl.rank{rank}")} for rank in (0, 1)]


@pytest.mark.dist
@pytest.mark.parametrize("arch", ARCHS)
def test_a_split_row_gives_the_unsplit_log_probs_losses_and_gradients(records, arch):
    for rank in records:
        r = rank[arch]
        assert r["log_prob_scale"] > 1.0 and r["grad_scale"] > 1e-2      # something real was compared
        for key in ("log_probs", "entropy", "kl", "loss"):
            assert r[key] < ATOL, (key, r[key])
        assert r["grad_names"] and r["grads"] < ATOL
        assert (r["compiled_graphs"] > 0) == arch.endswith("_compiled")   # the split actor's layers compiled
    # Each rank computed part of the row: its logits cover its own action predictions (the 28 of
    # the row, between the two), and its gradient alone is far from the whole one.
    kept = [rank[arch]["logits_kept"] for rank in records]
    assert kept[0][1] == kept[1][1] == 28 and kept[0][0] + kept[1][0] == 28 and 0 < kept[0][0] < 28
    assert all(rank[arch]["share_vs_reference"] > 100 * ATOL for rank in records)


@pytest.mark.dist
def test_a_split_row_gives_the_unsplit_values_and_critic_gradients(records):
    for rank in records:
        r = rank["critic"]
        assert r["value_scale"] > 0.5
        assert r["values"] < ATOL
        assert r["grads"] < ATOL * r["grad_scale"]


@pytest.mark.dist
def test_a_split_row_gives_the_unsplit_load_balancing_loss_and_gradients(records):
    """Router statistics summed over the group: each rank's load-balancing loss is the whole
    row's (a rank's own slice gives another), and the ranks' gradient parts add up to the row's."""
    for rank in records:
        r = rank["moe"]
        assert r["routers"] == 2 and r["aux_value"] > 0.5 and r["router_grad_scale"] > 1e-4
        assert r["aux"] < ATOL and r["grads"] < ATOL and r["router_grads"] < ATOL


@pytest.mark.dist
def test_a_split_row_replays_its_slice_of_the_routes(records):
    """Routing replay with the row split: each rank's slice of the row's routes (the filler routed
    live) gives the unsplit row's log-probs and, summed over the group, its gradients, the routers'
    included."""
    for rank in records:
        r = rank["moe_replay"]
        assert r["routers"] == 2 and r["replayed_vs_live"] > 1e-2 and r["router_grad_scale"] > 1e-5
        assert r["log_probs"] < ATOL and r["grads"] < ATOL


@pytest.mark.dist
@pytest.mark.parametrize("family", ["idefics3", "qwen_2", "qwen_2.5", "qwen_3"])
def test_a_split_vision_language_row_gives_the_unsplit_log_probs_and_gradients(records, family):
    """The vision tower runs on every rank and each keeps its slice of the row (Qwen3-VL: the image
    features of its placeholders), with an image's placeholders across the split and one key/value
    head copied to both ranks: the unsplit log-probs, entropies and loss, and the summed gradients
    of the decoder and of every vision weight (each rank's own share is far from them)."""
    for rank in records:
        r = rank[f"vlm_{family}"]
        assert r["log_prob_scale"] > 1.0 and r["vision"] >= 30 and r["vision_grad_scale"] > 1e-2
        for key in ("log_probs", "entropy", "loss"):
            assert r[key] < ATOL, (key, r[key])
        assert r["grad_names"] and r["grads"] < ATOL and r["vision_grads"] < ATOL
        assert r["vision_share_vs_reference"] > 1e-3


def test_models_that_cannot_be_split_are_refused_with_the_reason():
    group = SequenceParallel(None, 2, 0)
    odd = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=32, hidden_size=24, intermediate_size=32,
                                                       num_hidden_layers=1, num_attention_heads=3,
                                                       num_key_value_heads=1))
    with pytest.raises(ValueError, match=r"--sequence_parallel_size 2: --pretrain cannot be split over ranks: its 3 "
                                         r"query heads must divide by --sequence_parallel_size 2"):
        ActorLanguage(odd).use_sequence_parallel(group)
    three_kv = LlamaConfig(vocab_size=32, hidden_size=48, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"its 3 key/value heads divide by it or it by them"):
        ActorLanguage(AutoModelForCausalLM.from_config(three_kv)).use_sequence_parallel(group)
    one_kv = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=1)
    assert group.problem(ActorLanguage(AutoModelForCausalLM.from_config(one_kv)).model) is None  # a copy per rank
    even = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2)
    eager = ActorLanguage(AutoModelForCausalLM.from_config(even), attn_implementation="eager")
    with pytest.raises(ValueError, match=r"its attention is 'eager'.*--attn_implementation lightrft_varlen"):
        eager.use_sequence_parallel(group)
    actor = ActorLanguage(AutoModelForCausalLM.from_config(even))
    assert group.problem(actor.model) is None
    actor.use_sequence_parallel(SequenceParallel(None, 1, 0))      # size 1: nothing to split
    assert actor.sequence_parallel is None
