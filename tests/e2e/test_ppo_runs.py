"""End-to-end `train_ppo` runs on two CPU ranks: layouts and ZeRO stages agree, resume is exact,
reward files and HTTP servers drive a run, and a broken reward server stops it with a clear error."""

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_torchrun, run_torchrun_many
from tests.e2e.conftest import copy_run, grpo_flags, summary_line, tensorboard_scalars
from tests.rewards.test_remote import ScriptedServer

pytestmark = pytest.mark.dist

SMALL = dict(rollout_batch_size=16, n_samples_per_prompt=4, train_batch_size=32, micro_train_batch_size=8,
             micro_rollout_batch_size=32)


def run_ppo(toy, out, **overrides):
    proc = run_torchrun(["lightrft.cli.train_ppo", *grpo_flags(toy, out, **{**SMALL, **overrides})], module=True)
    return summary_line(proc.stdout), tensorboard_scalars(out / "tb")


def first_step(scalars, tag):
    steps = dict(scalars[tag])
    return steps[1]


KNOBS = dict(overlap_comm="off", zero_reduce_bucket_size=4096, zero3_prefetch_bucket_size=1024,
             zero3_max_live_parameters=100_000, zero3_param_persistence_threshold=0)
LAYOUTS = {
    "padded-zero2": dict(),
    "padded-zero3": dict(zero_stage=3),
    "padded-unshared": dict(no_prompt_sharing=True),
    "packed-zero2": dict(packing_samples=True),
    "packed-zero3": dict(packing_samples=True, zero_stage=3, **KNOBS),
}
# 16 prompts a step: 4 steps in all, interrupted after step 2 (mid-episode, or exactly at the end
# of the first of two episodes).
RESUMES = {"zero2-mid-episode": dict(max_samples=64, num_episodes=1, save_steps=-1, zero_stage=2),
           "zero3-at-episode-boundary": dict(max_samples=32, num_episodes=2, save_steps=-1, zero_stage=3)}
DAPO = dict(max_steps=2, dynamic_sampling=True, max_sampling_rounds=3, use_kl_loss=True, kl_estimator="k3",
            init_kl_coef=0.01, entropy_coef=0.01, pretrain_output_key="output", ptx_coef=0.1, enable_ema=True,
            max_epochs=2, eval_steps=2, eval_n_samples=4, eps_clip_low_high="0.2 0.28", rollout_correction="geo_mask",
            rollout_mask_band="0.9 1.1")


@pytest.fixture(scope="module")
def runs(toy, tmp_path_factory):
    """The runs that finish, in one torchrun launch (tests/e2e/run_many.py; each builds and closes
    its own process group, models and engine), each in its own folder: the five layouts' first
    steps, the uninterrupted and the interrupted runs of each resume case (the resumes are launches
    of their own), DAPO with the regularisers, and PPO with a critic and a reward model."""
    root = tmp_path_factory.mktemp("ppo_runs")
    reward_model = train_first_digit_reward_model(toy["model"], root / "rm")
    flags = {**{name: dict(max_steps=1, **extra) for name, extra in LAYOUTS.items()},
             **{f"{case}/full": four for case, four in RESUMES.items()},
             **{f"{case}/part": dict(four, max_steps=2) for case, four in RESUMES.items()},
             "dapo": dict(DAPO, pretrain_data=toy["train"], eval_data=toy["eval"]),
             "ppo": dict(advantage_estimator="gae", critic_pretrain=toy["model"], reward_pretrain=reward_model,
                         remote_rm_url=None, n_samples_per_prompt=1, rollout_batch_size=64, train_batch_size=32,
                         micro_train_batch_size=16, max_samples=320, num_episodes=2, init_kl_coef=0.01,
                         critic_learning_rate=5e-3, actor_learning_rate=1e-3, lambd=0.95)}
    outputs = run_torchrun_many([grpo_flags(toy, root / name, **{**SMALL, **extra}) for name, extra in flags.items()],
                                root)
    return {name: (root / name, output) for name, output in zip(flags, outputs)}


def test_packing_and_zero3_give_the_same_first_step(runs):
    """Padded runs share each prompt's forward among its 4 samples through a KV cache (ZeRO-2 and
    ZeRO-3, where the prompt and response forwards gather the weights twice), packed runs through
    the shared-prompt row; --no_prompt_sharing does not share: all agree. The packed ZeRO-3 run
    moves its data otherwise (no overlap, tiny prefetch, reduce and persistence buckets): when data
    moves changes nothing computed."""
    layouts = {name: (summary_line(runs[name][1]), tensorboard_scalars(runs[name][0] / "tb")) for name in LAYOUTS}
    reference = layouts["padded-zero2"][1]
    # The rollouts are identical (same seeds, same weights), so the rewards agree exactly ...
    for name, (summary, scalars) in layouts.items():
        assert summary["step"] == 1 and summary["stop_reason"] == "max_steps", name
        assert first_step(scalars, "rollout/reward") == first_step(reference, "rollout/reward"), name
    # ... and the losses of the first optimizer steps agree to float32 rounding.
    for name, (_, scalars) in layouts.items():
        for tag in ("train/policy_loss", "train/ratio_mean", "train/approx_kl"):
            assert first_step(scalars, tag) == pytest.approx(first_step(reference, tag), abs=1e-5), (name, tag)
    # The step moved the policy (a loss of exactly zero would make the comparison empty).
    assert abs(first_step(reference, "train/policy_loss")) > 1e-4


@pytest.mark.parametrize("case", list(RESUMES))
def test_resume_reproduces_the_uninterrupted_run_exactly(toy, tmp_path, runs, case):
    # The uninterrupted run and the interrupted one ran in the shared launch; the resume is a new process.
    (full_out, full_output), (part, part_output) = runs[f"{case}/full"], runs[f"{case}/part"]
    assert summary_line(full_output)["step"] == 4 and summary_line(part_output)["step"] == 2
    full = tensorboard_scalars(full_out / "tb")
    resumed_summary, resumed = run_ppo(toy, copy_run(part, tmp_path / "part"), load_checkpoint=True, **RESUMES[case])
    assert resumed_summary["step"] == 4
    for tag in ("rollout/reward", "train/policy_loss", "train/ratio_max", "rollout/response_length"):
        continued = dict(resumed[tag])
        for step in (3, 4):
            assert continued[step] == dict(full[tag])[step], (tag, step)   # bit for bit
    final_full = load_file(full_out / "model" / "model.safetensors")
    final_resumed = load_file(tmp_path / "part" / "model" / "model.safetensors")
    assert final_full.keys() == final_resumed.keys()
    for name in final_full:
        assert torch.equal(final_full[name], final_resumed[name]), name


def test_resume_with_nothing_to_load_or_a_changed_option_is_refused(toy, tmp_path):
    empty = run_torchrun(["lightrft.cli.train_ppo", *grpo_flags(toy, tmp_path, **{**SMALL, "load_checkpoint": True})],
                         module=True, check=False)
    assert empty.returncode != 0
    assert f"no complete checkpoint under {tmp_path / 'ckpt'}" in empty.stderr
    assert "--load_checkpoint if_present" in empty.stderr
    fresh, _ = run_ppo(toy, tmp_path, max_steps=1, load_checkpoint="if_present")   # starts fresh instead
    assert fresh["step"] == 1
    flags = grpo_flags(toy, tmp_path, **{**SMALL, "n_samples_per_prompt": 8, "load_checkpoint": True})
    proc = run_torchrun(["lightrft.cli.train_ppo", *flags], module=True, check=False)
    assert proc.returncode != 0
    assert "--n_samples_per_prompt: checkpoint has 4, this run has 8" in proc.stderr + proc.stdout


REWARD_FILE = '''
import torch

CALLS = []

def reward_func(queries, prompts, labels):
    # OpenRLHF convention: a dict with "rewards". One point per response character.
    responses = [q[len(p):] for q, p in zip(queries, prompts)]
    with open(__file__ + ".calls", "a") as f:
        f.write(str(len(queries)) + "\\n")
    return {"rewards": torch.tensor([float(len(r)) for r in responses])}
'''


def test_reward_file_and_http_server_drive_a_run(toy, tmp_path):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text(REWARD_FILE)
    server = ScriptedServer()             # scores each query as len(query) / 10
    try:
        summary, scalars = run_ppo(toy, tmp_path, max_steps=2, remote_rm_url=f"{reward_file},{server.url}")
    finally:
        server.close()
    assert summary["step"] == 2
    # Each rank sent its 8 prompts x 4 samples per step to the server and to the file.
    sizes = [len(r["body"]["query"]) for r in server.requests]
    assert sizes == [32] * 4
    assert [int(n) for n in (tmp_path / "my_reward.py.calls").read_text().split()] == [32] * 4
    for request in server.requests:
        body = request["body"]
        assert all(q.startswith(p) for q, p in zip(body["query"], body["prompts"]))
        for prompt, label in zip(body["prompts"], body["labels"]):      # labels travel with their prompts
            a, b = prompt[:-1].split("+")
            assert label == str(int(a) + int(b))
    # The server's counters reach the logs (source 1 in --remote_rm_url order), summed over ranks.
    assert dict(scalars["rollout/reward_source1_requests"]) == {1: 2.0, 2: 4.0}
    assert dict(scalars["rollout/reward_source1_retries"]) == {1: 0.0, 2: 0.0}
    # Reward = response length (file) + (prompt + response length) / 10 (server): both positive,
    # and at least the 1-character EOS-only response gives more than 0.5 per sample.
    assert all(value > 0.5 for _, value in scalars["rollout/reward"])


def test_a_reward_server_with_the_wrong_number_of_scores_stops_the_run_with_a_clear_error(toy, tmp_path):
    server = ScriptedServer()
    server.script = ["wrong_count"]
    started = time.time()
    try:
        flags = grpo_flags(toy, tmp_path, **{**SMALL, "remote_rm_url": server.url, "max_steps": 1,
                                             "reward_retries": 1, "reward_timeout": 2})
        proc = run_torchrun(["lightrft.cli.train_ppo", *flags], module=True, check=False, timeout=300)
    finally:
        server.close()
    assert proc.returncode != 0
    output = proc.stderr + proc.stdout
    assert server.url.split("/get_reward")[0] in output
    assert "31" in output and "32" in output, output[-3000:]   # got 31 scores for 32 queries
    assert time.time() - started < 300


def test_ppo_with_critic_and_reward_model_raises_the_reward(runs):
    scalars = tensorboard_scalars(runs["ppo"][0] / "tb")
    rewards = [value for _, value in scalars["rollout/reward"]]
    assert len(rewards) == 10 and "train/critic_loss" in scalars
    print("reward-model score per step:", [round(r, 3) for r in rewards])
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.5, rewards


def train_first_digit_reward_model(base_model, out):
    """A RewardModel that prefers answers starting with '1' (trained pairwise in process), so a
    policy can raise its score by changing what it writes."""
    from transformers import AutoTokenizer

    from lightrft.models import PairWiseLoss, RewardModel

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    model = RewardModel(str(base_model), init_value_head=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = PairWiseLoss()
    generator = torch.Generator().manual_seed(0)

    def encode(texts):
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
        width = max(map(len, ids))
        tensor = torch.tensor([[0] * (width - len(r)) + r for r in ids])
        return tensor, (tensor != 0).long()

    for _ in range(120):
        a, b = torch.randint(0, 20, (2, 16), generator=generator)
        second = torch.randint(0, 10, (16,), generator=generator)
        other = torch.randint(2, 10, (16,), generator=generator)
        prompts = [f"{x}+{y}=" for x, y in zip(a.tolist(), b.tolist())]
        chosen = [p + f"1{d}" for p, d in zip(prompts, second.tolist())]
        rejected = [p + f"{o}{d}" for p, o, d in zip(prompts, other.tolist(), second.tolist())]
        chosen_ids, chosen_mask = encode(chosen)
        rejected_ids, rejected_mask = encode(rejected)
        loss = loss_fn(model(chosen_ids, attention_mask=chosen_mask), model(rejected_ids, attention_mask=rejected_mask))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "train_loss.json").write_text(json.dumps({"final_pairwise_loss": loss.item()}))
    return out


def test_dapo_and_regularisers_run_together(runs):
    """Dynamic sampling, KL loss (k3), entropy bonus, PTX loss, EMA, two epochs, pass@k and a rollout
    correction (geometric-mean sequence mask) in one run."""
    tmp_path, output = runs["dapo"]
    summary, scalars = summary_line(output), tensorboard_scalars(tmp_path / "tb")
    assert summary["step"] == 2
    last = {tag: dict(series)[2] for tag, series in scalars.items()}
    assert last["train/ptx_loss"] > 0 and last["train/entropy"] > 0 and last["train/kl_loss"] >= 0
    # Equal-reward groups are common on this task: some were dropped and refilled from more prompts.
    assert last["train/dropped_groups"] > 0 and last["train/sampling_rounds"] > 2
    # The rollout correction and its mismatch metrics reach the loss: the HF engine samples with
    # the trainer's own module, so nothing is masked and the ratios are 1.
    assert last["train/rollout_corrected_seq_frac"] == 0.0 and abs(last["train/mismatch_kl_k3"]) < 1e-6
    assert abs(last["train/rollout_ratio_p05"] - 1) < 1e-3 and abs(last["train/rollout_ratio_p95"] - 1) < 1e-3
    # pass@k (any of k right) is never below the mean per-sample reward of the same samples.
    assert 0 <= last["eval/reward_mean"] <= last["eval/pass@4"] <= 1
    assert (tmp_path / "ckpt" / "_ema" / "latest").exists()
