"""ActorLanguage(torch_compile=...): every decoder layer under torch.compile around lightrft's packed
attention (`lightrft.models.compiled_layers`) gives the eager actor's log-probs, entropies and
parameter gradients on every tiny architecture, in float32, and compiles nothing new for
micro-batches of other lengths and sequence counts; with gradient checkpointing, LoRA (and its
adapter-disabled reference), shared-prompt rows, padded batches and KV-cache decoding too, for the
critic, past the recompile limit, and through train_ppo under ZeRO-2.

Cost: inductor's CPU compile takes 6-25 s per architecture (180 s for all), so every architecture
runs under "aot_eager" (dynamo's capture, its graph breaks and dynamic shapes, and AOTAutograd's
forward and backward graphs, run without code generation; 2-13 s each) and two under inductor.
"""

import copy
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightrft.models import ActorLanguage, Critic, attention
from lightrft.models import compiled_layers
from lightrft.models.compiled_layers import decoder_layers
from lightrft.utils.tiny import TINY_ARCHS, build_tiny_arch, save_tiny_arch

from .conftest import assert_close_grads, make_batch
from .test_shared_packed_prompts import grouped_row

ATOL = 1e-5  # float32: compiled graphs reorder and fuse the same arithmetic
TEMPERATURE = 0.7
# Two micro-batches of different lengths and sequence counts, longer than the 8-token windows.
MICRO_BATCHES = [((5, 12, 3, 9), (10, 4, 14, 6)), ((7, 2, 11), (12, 9, 3))]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test counts the graphs it compiles from an empty dynamo cache."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def twins(arch: str, backend: str = "aot_eager", seed: int = 1, **kwargs):
    """(eager, compiled) actors over equal copies of a tiny `arch` model (equal LoRA adapters too)."""
    model = build_tiny_arch(arch, seed=seed)
    torch.manual_seed(0)
    eager = ActorLanguage(copy.deepcopy(model), temperature=TEMPERATURE, **kwargs)
    torch.manual_seed(0)
    compiled = ActorLanguage(model, temperature=TEMPERATURE, torch_compile=backend, **kwargs)
    return eager, compiled


def run(actor, *args, **kwargs):
    """(log-probs, entropy, {name: grad}) of a loss that weights every action's log-prob and
    entropy differently."""
    actor.zero_grad()
    log_probs, output = actor(*args, return_output=True, return_entropy=True, **kwargs)
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(2, *log_probs.shape, generator=gen)
    ((weights[0] * log_probs).sum() + (weights[1] * output["entropy"]).sum()).backward()
    grads = {name: p.grad.clone() for name, p in actor.named_parameters() if p.grad is not None}
    return log_probs.detach(), output["entropy"].detach(), grads


def assert_same(compiled, eager, atol=ATOL):
    (log_probs, entropy, grads), (ref_log_probs, ref_entropy, ref_grads) = compiled, eager
    assert log_probs[log_probs != 0].std() > 0.05  # log-probs that vary: not a comparison of constants
    torch.testing.assert_close(log_probs, ref_log_probs, atol=atol, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=atol, rtol=0)
    assert_close_grads(grads, ref_grads, atol)


def packed_runs(eager, compiled) -> list[int]:
    """Runs both actors over `MICRO_BATCHES` packed, checks they agree, and returns the compiled
    actor's graph count after each micro-batch."""
    counts = []
    for seed, (prompts, responses) in enumerate(MICRO_BATCHES):
        batch = make_batch(prompts, responses, seed=seed)
        args = (batch.packed_ids, batch.response_lens)
        assert_same(run(compiled, *args, packed_seq_lens=batch.packed_seq_lens),
                    run(eager, *args, packed_seq_lens=batch.packed_seq_lens))
        counts.append(compiled.compiled_layers.graphs)
    return counts


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_compiled_layers_equal_eager_and_do_not_recompile(arch):
    eager, compiled = twins(arch)
    counts = packed_runs(eager, compiled)
    assert counts[0] > 0
    # Other lengths and sequence counts reuse the graphs. Under transformers 5.19 DeepSeek-V3
    # compiles one more graph on its second forward whatever the lengths (the same micro-batch
    # twice does too, a third compiles nothing; 5.25 compiles none): dynamo meets its dense first
    # layer's MLP, a class its mixture-of-experts layers use at another size, in a piece of layer
    # code that the first forward split at a data-dependent expert count.
    assert counts[1] == counts[0] or (arch == "deepseek_v3" and counts[1] == counts[0] + 1)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_inductor_layers_equal_eager(arch):
    """Inductor's generated kernels (C++ on the CPU): grouped-query attention and rotary (Llama);
    soft-capped attention, alternating windows and tied embeddings (Gemma 2)."""
    counts = packed_runs(*twins(arch, backend="inductor"))
    assert counts[0] > 0 and counts[1] == counts[0]


def test_gradient_checkpointing_recomputes_through_the_compiled_layers(monkeypatch):
    eager, _ = twins("qwen2")
    _, compiled = twins("qwen2", gradient_checkpointing=True)
    assert compiled.model.model.layers[0].gradient_checkpointing
    calls = []
    outside = attention._attention_outside_graphs

    @torch.compiler.disable
    def counting(*args, **kwargs):
        calls.append(1)
        return outside(*args, **kwargs)

    monkeypatch.setattr(attention, "_attention_outside_graphs", counting)   # reached from compiled layers only
    counts = packed_runs(eager, compiled)
    # Each layer's compiled forward ran twice per micro-batch: in the forward and in the backward's
    # recomputation (transformers 5.19 checkpoints the layer's call, 5.25 its class's forward).
    assert len(calls) == 2 * 2 * len(MICRO_BATCHES)
    assert counts[1] == counts[0] > 0


def test_lora_actor_and_its_adapter_disabled_reference():
    eager, compiled = twins("qwen2", lora_rank=4, lora_alpha=8)
    for actor in (eager, compiled):   # non-zero adapters, so that switching them off changes the log-probs
        for name, param in actor.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.05, generator=torch.Generator().manual_seed(3))
    batch = make_batch(*MICRO_BATCHES[0], seed=0)
    args = (batch.packed_ids, batch.response_lens)
    result = run(compiled, *args, packed_seq_lens=batch.packed_seq_lens)
    assert result[2] and all("lora_" in name for name in result[2])  # only the adapters train
    assert_same(result, run(eager, *args, packed_seq_lens=batch.packed_seq_lens))
    with torch.no_grad():
        reference = compiled.adapter_disabled()(*args, packed_seq_lens=batch.packed_seq_lens)
        expected = eager.adapter_disabled()(*args, packed_seq_lens=batch.packed_seq_lens)
        trained = eager(*args, packed_seq_lens=batch.packed_seq_lens)
    torch.testing.assert_close(reference, expected, atol=ATOL, rtol=0)
    assert (reference - trained).abs().max() > 1e-3   # the adapters were off


def test_shared_prompt_rows():
    """Gemma 2: windowed and full layers, soft-capped attention per segment."""
    eager, compiled = twins("gemma2")
    layers = len(decoder_layers(compiled.model))
    calls = []
    attend = compiled.prompt_sharing.forward

    def counting(*args):
        forward = args[-1]
        return attend(*args[:-1], lambda shared, layout: (forward(shared, layout), calls.append(layout.calls))[0])

    compiled.prompt_sharing.forward = counting
    ids, seq_lens, actions, groups = grouped_row()
    assert_same(run(compiled, ids, actions, packed_seq_lens=seq_lens, prompt_groups=groups),
                run(eager, ids, actions, packed_seq_lens=seq_lens, prompt_groups=groups))
    assert calls == [layers]       # every layer applied the shared-prompt layout inside its compiled code
    graphs = compiled.compiled_layers.graphs
    ids, seq_lens, actions, groups = grouped_row(seed=1)
    assert_same(run(compiled, ids, actions, packed_seq_lens=seq_lens, prompt_groups=groups),
                run(eager, ids, actions, packed_seq_lens=seq_lens, prompt_groups=groups))
    assert compiled.compiled_layers.graphs == graphs


def test_critic_values_and_gradients(tmp_path):
    folder = save_tiny_arch(tmp_path / "qwen2", "qwen2", seed=1)
    torch.manual_seed(0)
    eager = Critic(folder).train()
    torch.manual_seed(0)
    compiled = Critic(folder, torch_compile="aot_eager").train()
    assert compiled.compiled_layers.graphs == 0 and len(compiled.compiled_layers.layers) == 2
    for seed, (prompts, responses) in enumerate(MICRO_BATCHES):
        batch = make_batch(prompts, responses, seed=seed)
        results = []
        for critic in (compiled, eager):
            critic.zero_grad()
            values = critic(batch.packed_ids, batch.response_lens, packed_seq_lens=batch.packed_seq_lens)
            (values * torch.rand(values.shape, generator=torch.Generator().manual_seed(0))).sum().backward()
            results.append((values.detach(), {n: p.grad.clone() for n, p in critic.named_parameters()}))
        (values, grads), (ref_values, ref_grads) = results
        assert values.std() > 1e-3
        torch.testing.assert_close(values, ref_values, atol=ATOL, rtol=0)
        for name, grad in grads.items():
            scale = ref_grads[name].abs().max().clamp(min=1.0)
            torch.testing.assert_close(grad / scale, ref_grads[name] / scale, atol=ATOL, rtol=0, msg=name)
        if seed == 0:
            graphs = compiled.compiled_layers.graphs
    assert compiled.compiled_layers.graphs == graphs > 0


def test_padded_batches_and_decoding_with_a_kv_cache():
    eager, compiled = twins("llama")
    batch = make_batch(*MICRO_BATCHES[0], seed=0)
    args = (batch.sequences, batch.num_actions)
    assert_same(run(compiled, *args, attention_mask=batch.attention_mask),
                run(eager, *args, attention_mask=batch.attention_mask))
    graphs = compiled.compiled_layers.graphs
    # Decoding runs the layers eagerly (a growing cache would compile at every step): the same tokens.
    prompt = batch.sequences[:1, -8:]
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        tokens = compiled.model.generate(prompt, **options)
        expected = eager.model.generate(prompt, **options)
    assert torch.equal(tokens, expected) and tokens.size(1) == prompt.size(1) + 6
    assert compiled.compiled_layers.graphs == graphs


def test_past_the_recompile_limit_new_kinds_of_input_run_eagerly(monkeypatch):
    """With a limit of one version per piece of layer code, forwards that would need a second
    (without gradients, then padded) compile nothing more and still give the eager log-probs."""
    monkeypatch.setattr(compiled_layers, "RECOMPILE_LIMIT", 1)
    eager, compiled = twins("llama")
    batch = make_batch(*MICRO_BATCHES[0], seed=0)
    packed = (batch.packed_ids, batch.response_lens)
    assert_same(run(compiled, *packed, packed_seq_lens=batch.packed_seq_lens),
                run(eager, *packed, packed_seq_lens=batch.packed_seq_lens))
    graphs = compiled.compiled_layers.graphs
    with torch.no_grad():
        for args, kwargs in ((packed, {"packed_seq_lens": batch.packed_seq_lens}),
                             ((batch.sequences, batch.num_actions), {"attention_mask": batch.attention_mask})):
            torch.testing.assert_close(compiled(*args, **kwargs), eager(*args, **kwargs), atol=ATOL, rtol=0)
    assert compiled.compiled_layers.graphs == graphs > 0


def test_a_deep_copy_runs_its_own_layers():
    """A copy of a compiled model (EMA, export) computes with the copy's weights, not the original's,
    and keeps its layers compiled."""
    _, compiled = twins("llama")
    copied = copy.deepcopy(compiled)
    with torch.no_grad():
        for param in copied.model.model.layers[0].parameters():
            param.add_(0.5)
    batch = make_batch(*MICRO_BATCHES[0], seed=0)
    args = (batch.packed_ids, batch.response_lens)
    with torch.no_grad():
        moved = copied(*args, packed_seq_lens=batch.packed_seq_lens)
        kept = compiled(*args, packed_seq_lens=batch.packed_seq_lens)
    assert (moved - kept).abs().max() > 1e-2
    assert type(copied.model.model.layers[0]) is type(compiled.model.model.layers[0])


def test_refusals_name_the_flag():
    model = build_tiny_arch("llama")
    with pytest.raises(ValueError, match="--torch_compile must be one of inductor, aot_eager"):
        ActorLanguage(copy.deepcopy(model), torch_compile="cudagraphs")
    with pytest.raises(ValueError, match="--torch_compile .* uses 'sdpa'.*drop --attn_implementation"):
        ActorLanguage(copy.deepcopy(model), attn_implementation="sdpa", torch_compile="aot_eager")
    model._no_split_modules = None
    with pytest.raises(ValueError, match="--torch_compile: --pretrain is a LlamaForCausalLM, whose decoder layers"):
        ActorLanguage(model, torch_compile="aot_eager")


def test_state_dict_and_parameter_names_are_unchanged():
    eager, compiled = twins("gpt2")
    assert list(compiled.state_dict()) == list(eager.state_dict())
    reloaded = AutoModelForCausalLM.from_config(compiled.model.config)
    reloaded.load_state_dict(compiled.model.state_dict())


def test_train_ppo_with_compiled_layers_trains_as_the_eager_layers(tmp_path, caplog):
    """`--torch_compile` through train_ppo's own wiring under ZeRO-2: two GRPO steps (KL reference
    on, compiled too; the Hugging Face engine decodes with the actor's layers, eagerly) end with
    the eager run's weights to float32 rounding."""
    from tests.trainer.ppo_harness import make_task, max_weight_change, run as run_ppo

    task = make_task(tmp_path)
    flags = dict(init_kl_coef=0.01, use_kl_loss=True, packing_samples=True)
    eager_logs, eager = run_ppo(task, tmp_path / "eager", **flags)
    with caplog.at_level(logging.INFO, logger="lightrft.models.compiled_layers"):
        compiled_logs, compiled = run_ppo(task, tmp_path / "compiled", torch_compile="aot_eager", **flags)
    assert "--pretrain --torch_compile aot_eager: graph 1 compiled" in caplog.text   # the run's layers compiled
    # Measured up to 1.5e-5, on an AVX2-only CPU (the rounding depends on the CPU's vector kernels).
    assert max_weight_change(eager, compiled) < 5e-5
    for key in ("train/policy_loss", "train/kl_loss", "rollout/kl"):
        assert compiled_logs[key] == pytest.approx(eager_logs[key], rel=1e-4, abs=1e-6), key
