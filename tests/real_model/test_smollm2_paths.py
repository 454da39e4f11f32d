"""The other ways weights travel, on the real checkpoint (SmolLM2-135M-Instruct; test_smollm2.py
has the checkpoint itself, packing, the engines, a bucketed vLLM sync and the doctor).

- a LoRA actor whose vLLM engine serves the adapter, synced alone after each change, and its
  merged export;
- a tensor-parallel vLLM replica (over three ranks: vLLM needs the tensor-parallel size to divide
  the model's 9 attention heads, so 2 is refused) synced in buckets;
- the trainer -> explorer weight publication, over the broadcast and the folder transport;
- `lightrft.cli.serve --watch` picking up a new export, and `lightrft.cli.bench` scoring exports.

Each check also measures what a transfer that never arrived would show (the previous adapter, the
unsynced replica, the pretrained weights), so it cannot pass with stale weights. The exports and
the moved weights are `moved()` from test_smollm2.py: every weight shifted by 5% of its mean
magnitude, 0.1 to 0.7 nats per token away from the pretrained ones. float32 throughout; responses
are at most 8 tokens.
"""

import csv
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM

from lightrft.config import RolesConfig
from lightrft.datasets.toy import write_jsonl
from lightrft.models import ActorLanguage
from lightrft.rewards.rules import get_rule_reward
from lightrft.rollout import RolloutManager, SamplingParams
from lightrft.rollout.checks import ENGINE_GAP_TOLERANCE
from lightrft.serving.records import read_records
from lightrft.strategy import DeepspeedStrategy, StrategyConfig
from lightrft.strategy.hf_export import export_hf_folder
from lightrft.explorers.explorer import load_named_weights
from lightrft.explorers.link import ExplorerLink
from lightrft.rollout.manager import WeightStream
from lightrft.explorers.weights import WeightSubscriber
from lightrft.explorers.roles import ControlChannel
from tests.conftest import REPO_ROOT, run_torchrun, subprocess_env
from tests.real_model.test_smollm2 import actor, prompt_ids, tokenizer  # noqa: F401 (the module's fixtures)
from tests.real_model.test_smollm2 import (GAP_MAX, GAP_MEAN, IM_END, INDUCTOR_CACHE, QUESTIONS, gap, moved,
                                           needs_vllm, trainer_log_probs)
from tests.explorers.test_roles import gloo_pair

# Correct transfers are held to test_smollm2's GAP_MEAN / GAP_MAX (1e-4 / 1e-3 nats, ten times
# tighter than the float32 ENGINE_GAP_TOLERANCE a run stops at; measured ~1e-5 / ~4e-5 on every
# path here). A stale one must stand out by ten times that alarm threshold, not just from ~1e-5.
STALE_MEAN = 10 * ENGINE_GAP_TOLERANCE["float32"][0]
MAX_NEW = 8
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, n=2, seed=0)
LORA_RANK = 8


@pytest.fixture(scope="module")
def moved_actor(actor):
    return moved(actor)


@pytest.fixture(scope="module")
def moved_export(tmp_path_factory, moved_actor, tokenizer) -> Path:
    """The moved weights as train_ppo --save_hf_ckpt writes step 1 under its --ckpt_path."""
    return export_hf_folder(moved_actor, moved_actor.state_dict(), tokenizer,
                            tmp_path_factory.mktemp("run") / "global_step1_hf")


# ----------------------------------------------------------------------------------------- LoRA
@needs_vllm
def test_lora_adapter_syncs_reach_vllm_and_the_merged_export_reloads(smollm2, tokenizer, prompt_ids, tmp_path):
    """Only the adapter travels (peft files, a new adapter id per sync) to an engine holding the
    pretrained base. LoRA's B starts at zero, so the first adapter is drawn at random; then one
    Adam step changes it. The first adapter's rollout against the trainer after the step is what
    an adapter sync that never arrived would show."""
    from lightrft.rollout import VLLMEngine

    lora_actor = ActorLanguage(smollm2, lora_rank=LORA_RANK, lora_alpha=16).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in lora_actor.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02, generator=generator)
    adapter = [p for name, p in lora_actor.named_parameters() if ".lora_" in name]
    assert {p.requires_grad for p in lora_actor.parameters()} == {True, False}
    assert {p for p in lora_actor.parameters() if p.requires_grad} == set(adapter)
    engine = VLLMEngine(str(smollm2), IM_END, IM_END, seed=0, dtype="float32", kv_cache_gb=0.25, max_model_len=256,
                        enforce_eager=True, lora_rank=LORA_RANK)
    try:
        manager = RolloutManager.for_actor(engine, DeepspeedStrategy(StrategyConfig()), lora_actor)
        out = manager.generate(prompt_ids, PARAMS)                 # a new engine starts stale: this syncs
        first = gap(out, trainer_log_probs(lora_actor, out))
        without_adapter = gap(out, trainer_log_probs(lora_actor.adapter_disabled(), out))
        assert manager.syncs == 1 and engine.adapter.lora_int_id == 1
        assert manager.last_sync_bytes == sum(p.numel() * p.element_size() for p in adapter)

        optimizer = torch.optim.Adam(adapter, lr=1e-3)             # raise the sampled tokens' log-probs
        log_probs = lora_actor(out.sequences, out.action_mask.size(1), attention_mask=out.attention_mask)
        (-(log_probs * out.action_mask).sum() / out.action_mask.sum()).backward()
        optimizer.step()
        stale = gap(out, trainer_log_probs(lora_actor, out))       # the engine's first adapter, unsynced
        manager.mark_stale()
        out = manager.generate(prompt_ids, PARAMS)
        synced = gap(out, trainer_log_probs(lora_actor, out))
        assert manager.syncs == 2 and engine.adapter.lora_int_id == 2
    finally:
        engine.shutdown()
    print(f"LoRA engine vs trainer mean gap: first adapter {first[0]:.1e}, after the step {synced[0]:.1e} (max "
          f"{max(first[1], synced[1]):.1e}); stale adapter {stale[0]:.2f}, no adapter {without_adapter[0]:.2f}")
    for measured in (first, synced):
        assert measured[0] < GAP_MEAN and measured[1] < GAP_MAX, measured
    assert stale[0] > STALE_MEAN and without_adapter[0] > STALE_MEAN, (stale, without_adapter)

    # The export merges the adapter into the base weights: a plain tied Llama with the actor's logits.
    export_hf_folder(lora_actor.model, lora_actor.model.state_dict(), tokenizer, tmp_path / "merged")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    assert not [name for name in plain.state_dict() if "lora" in name]
    real = out.attention_mask.bool()
    with torch.no_grad():
        expected = lora_actor.model(input_ids=out.sequences, attention_mask=out.attention_mask).logits[real]
        merged = plain(input_ids=out.sequences, attention_mask=out.attention_mask).logits[real]
    difference = (merged - expected).abs().max().item()
    print(f"merged export vs LoRA actor: max logit difference {difference:.1e} (logits up to "
          f"{expected.abs().max().item():.0f})")
    torch.testing.assert_close(merged, expected, atol=1e-3, rtol=0)


# ------------------------------------------------------------------------------ tensor parallel
@needs_vllm
@pytest.mark.dist
def test_a_tensor_parallel_replica_follows_a_bucketed_sync(smollm2, tmp_path):
    """dist_smollm2_tp.py: one replica of tensor parallel 3 over three ranks, against the trainer's
    weights as loaded, moved but not synced, and synced in buckets through the manager."""
    result = tmp_path / "tp.json"
    run_torchrun(["tests/real_model/dist_smollm2_tp.py", result, smollm2], nproc=3,
                 env={"TORCHINDUCTOR_CACHE_DIR": INDUCTOR_CACHE})
    rows = json.loads(result.read_text())
    assert [row["rank"] for row in rows] == [0, 1, 2]
    as_loaded, stale = rows[0]["as_loaded"], rows[0]["stale"]
    print(f"TP=3 engine vs trainer mean gap: as loaded {as_loaded[0]:.1e} (max {as_loaded[1]:.1e}), stale "
          f"{stale[0]:.2f}, synced " + ", ".join(f"{row['synced'][0]:.1e}" for row in rows) + " on ranks 0, 1, 2")
    assert as_loaded[0] < GAP_MEAN and as_loaded[1] < GAP_MAX and stale[0] > STALE_MEAN, (as_loaded, stale)
    for row in rows:
        assert row["union"] == rows[0]["union"]                    # the replica's ranks sample alike
        assert row["synced"][0] < GAP_MEAN and row["synced"][1] < GAP_MAX, row["synced"]
        assert row["replica"] == [0, 1, 2] and row["synced_rows"] == 2     # its own prompt's 2 samples
        # Every weight once, whole, to each rank (each keeps its shard); the embedding, also the
        # LM head, is a 113 MB bucket of its own and the head is never sent under its own name.
        assert row["syncs"] == 1 and row["sync_bytes"] == row["model_bytes"]
        assert row["buckets"][0] == ["model.embed_tokens.weight"] and len(row["buckets"]) > 2
        assert not [name for bucket in row["buckets"] for name in bucket if "lm_head" in name]


# ---------------------------------------------------------------------------- explorer weights
@pytest.mark.parametrize("method", ["broadcast", "checkpoint"])
def test_an_explorer_loads_exactly_the_published_weights(smollm2, moved_actor, prompt_ids, method, tmp_path):
    """The trainer's end (`ExplorerLink.publish`, version = its step) and the explorer's
    (`WeightSubscriber`, then `load_named_weights` into the policy copy an HF-engine explorer
    builds from the pretrained folder) over a real gloo control channel, two ranks as two
    threads of this process; `checkpoint` sends a file path instead of the bytes."""
    trainer_group, explorer_group = gloo_pair()
    subscriber = WeightSubscriber(ControlChannel(explorer_group), explorer_index=0)
    link = ExplorerLink(None, ControlChannel(trainer_group), 1, RolesConfig(explorer_ranks=1, sync_method=method),
                        str(tmp_path / "explorer_weights"), timeout_s=60.0)
    # What the trainer hands its experience source: the actor's weight stream (64 MB buckets).
    link.context = SimpleNamespace(weight_buckets=WeightStream(DeepspeedStrategy(StrategyConfig()), moved_actor,
                                                               64).buckets)
    explorer = ActorLanguage(smollm2).model.eval()
    expected = moved_actor.model.state_dict()
    assert max((explorer.state_dict()[name] - t).abs().max().item() for name, t in expected.items()) > 1e-3
    try:
        link.publish(3)                 # version 3: the trainer's step
        subscriber.wait(lambda: subscriber.newest() >= 0)
        version, named = subscriber.take(3)
        load_named_weights(explorer, named)
    finally:
        link.publisher.close(60.0)
    assert version == 3 and subscriber.start_batch == 3 and link.publisher.error is None
    names = [name for name, _ in named]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names   # sent once, as the embedding
    got = explorer.state_dict()
    assert set(got) == set(expected) and "lm_head.weight" in got
    assert not [name for name, tensor in expected.items() if not torch.equal(got[name], tensor)]
    assert explorer.lm_head.weight is explorer.model.embed_tokens.weight
    if method == "checkpoint":
        assert [p.name for p in (tmp_path / "explorer_weights").iterdir()] == ["policy_v00000003.pt"]
    else:
        assert not (tmp_path / "explorer_weights").exists()        # the bytes went over the channel
    with torch.no_grad():
        logits = [model(torch.tensor(prompt_ids[:1])).logits for model in (explorer, moved_actor.model)]
    assert torch.equal(*logits)


# ---------------------------------------------------------------------------------------- serve
def token_log_probs(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """Teacher-forced log-probs of the response under `model` at temperature 1. Shape: (A,)"""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()            # (A, V)
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response_ids)[:, None]).squeeze(1)


def test_serve_watch_answers_with_the_weights_of_a_new_export(smollm2, actor, moved_actor, moved_export, tmp_path):
    """`serve --watch` on the pretrained folder; the moved weights then appear in the watched
    folder as train_ppo writes them (a complete folder renamed into place as global_step1_hf)."""
    watch, record = tmp_path / "ckpt", tmp_path / "record"
    watch.mkdir()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "lightrft.cli.serve", "--pretrain", str(smollm2), "--port", "0",
                             "--record", str(record), "--watch", str(watch), "--watch_interval", "0.2",
                             "--generate_max_len", str(MAX_NEW)],
                            cwd=REPO_ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = proc.stdout.readline()
        if "http://" not in line:
            pytest.fail(f"serve did not start: {line!r}\n{(tmp_path / 'serve.log').read_text()[-3000:]}")
        url = "http://" + line.split("http://")[1].split("/v1")[0]
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        def ask():
            reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                                   max_tokens=MAX_NEW, temperature=0, logprobs=True)
            record_of = {r.id: r for r, _ in read_records(record)[0]}[reply.id]
            assert record_of.log_probs == [t.logprob for t in reply.choices[0].logprobs.content]
            return reply, record_of, token_log_probs(actor.model, record_of.prompt_token_ids,
                                                     record_of.response_token_ids)

        before, served, pretrained = ask()
        assert before.system_fingerprint == "lightrft-policy-v0" and served.policy_version == 0
        assert torch.tensor(served.log_probs) == pytest.approx(pretrained, abs=1e-4)

        shutil.copytree(moved_export, watch / ".global_step1_hf.tmp")
        os.rename(watch / ".global_step1_hf.tmp", watch / "global_step1_hf")
        deadline = time.time() + 120
        while httpx.get(url + "/health").json()["policy_version"] != 1:
            assert time.time() < deadline, "the server did not load global_step1_hf"
            time.sleep(0.2)
        after, served, pretrained = ask()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert after.system_fingerprint == "lightrft-policy-v1" and served.policy_version == 1
    expected = token_log_probs(moved_actor.model, served.prompt_token_ids, served.response_token_ids)
    stale = (pretrained - torch.tensor(served.log_probs)).abs().mean().item()
    print(f"served after the reload vs the export: max {(torch.tensor(served.log_probs) - expected).abs().max():.1e};"
          f" vs the pretrained weights: mean {stale:.2f}")
    assert torch.tensor(served.log_probs) == pytest.approx(expected, abs=1e-4)
    assert stale > STALE_MEAN
    # Greedy: every served token is the export's most likely one.
    ids = torch.tensor([served.prompt_token_ids + served.response_token_ids])
    with torch.no_grad():
        logits = moved_actor.model(ids).logits[0, len(served.prompt_token_ids) - 1:-1]
    assert logits.argmax(dim=-1).tolist() == served.response_token_ids


# ---------------------------------------------------------------------------------------- bench
SUMS = [(2, 3), (4, 5), (7, 1), (6, 6), (3, 8)]


def greedy_math_reward(folder: Path, tokenizer, rows: list[dict]) -> float:
    """The mean `math` reward of the greedy answers of the model in `folder`, decoded by
    transformers' own `generate`, one unpadded prompt at a time."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    responses = []
    for row in rows:
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["input"]}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=IM_END, pad_token_id=IM_END)
        responses.append(tokenizer.decode(out[0, ids.size(1):], skip_special_tokens=True))
    return get_rule_reward("math")(responses, [row["label"] for row in rows]).mean().item()


def test_bench_scores_each_export_with_its_own_weights(smollm2, tokenizer, moved_export, tmp_path):
    """`bench` over a --ckpt_path holding the moved export as step 1, with the pretrained folder as
    step 0: each row is the score its own checkpoint's greedy answers get, computed here with
    transformers' `generate`; the moved weights answer 6 + 6 wrongly, the pretrained ones do not."""
    rows = [{"input": f"What is {a} plus {b}? Answer with the number only.", "label": str(a + b)} for a, b in SUMS]
    eval_data, out = write_jsonl(rows, tmp_path / "eval.jsonl"), tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "lightrft.cli.bench", "--ckpt_path", str(moved_export.parent),
                           "--pretrain", str(smollm2), "--eval_data", str(eval_data), "--input_key", "input",
                           "--label_key", "label", "--apply_chat_template", "--remote_rm_url", "math",
                           "--generate_max_len", str(MAX_NEW), "--output_dir", str(out)],
                          cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "bench.csv") as f:
        table = list(csv.DictReader(f))
    assert [(int(r["step"]), r["checkpoint"]) for r in table] == [(0, str(smollm2)), (1, str(moved_export))]
    expected = [greedy_math_reward(folder, tokenizer, rows) for folder in (smollm2, moved_export)]
    scores = [float(r["eval/reward_greedy"]) for r in table]
    print(f"bench greedy math reward: pretrained {scores[0]:.2f}, moved export {scores[1]:.2f}")
    assert scores == pytest.approx(expected, abs=1e-6)
    assert scores[0] != scores[1]               # the two checkpoints answer differently
    markdown = (out / "bench.md").read_text().splitlines()
    assert markdown[0] == "| step | checkpoint | eval/reward_greedy |" and len(markdown) == 2 + len(table)
    assert (out / "bench.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


# ------------------------------------------------------------------------ sequence parallel
@pytest.mark.dist
def test_a_row_split_over_three_ranks_gives_the_unsplit_log_probs_and_gradients(smollm2, tmp_path):
    """dist_smollm2_sp.py: a packed row of three chat answers split over three ranks
    (--sequence_parallel_size 3; the 9 query and 3 key/value heads allow no 2) against the unsplit row."""
    result = tmp_path / "sp.json"
    run_torchrun(["tests/real_model/dist_smollm2_sp.py", result, smollm2], nproc=3)
    r = json.loads(result.read_text())
    assert r["actions"] == 24 and r["log_prob_scale"] > 1.0 and r["grad_scale"] > 0.1
    # Equal up to float32 rounding of the split's other matmul shapes: 0.0 on one x86 runner, 9.5e-6
    # (log-probs) and 6.1e-5 (entropies of a 49,152-token vocabulary, several nats) on another; a
    # split that loses the attention exchange or a slice is off by 0.1 or more.
    assert r["log_probs"] < 1e-4 and r["entropy"] < 1e-4 and r["loss"] < 1e-4
    assert r["grads"] < 1e-5 * r["grad_scale"]
