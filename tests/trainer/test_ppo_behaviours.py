"""What the PPO layer does with the options a user passes, checked in-process on one rank through
train_ppo's own wiring: options that must change the update do, and options that must not, don't."""

import argparse
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from lightrft.algorithms.kl import FixedKLController
from lightrft.builders import build_scheduler
from lightrft.cli.train_ppo import parse_args
from lightrft.datasets import PromptDataset, SFTDataset
from lightrft.strategy.deepspeed_strategy import DeepspeedStrategy
from lightrft.experience.dynamic_sampling import fill_to_size
from lightrft.experience.samples import Experience
from lightrft.trainer.ppo_trainer import AlgorithmConfig
from lightrft.experience.replay_buffer import NaiveReplayBuffer
from lightrft.utils.tiny import build_char_tokenizer_with_bos
from tests.trainer.ppo_harness import flags, make_task, max_weight_change, run


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return make_task(tmp_path_factory.mktemp("ppo_task"))


@pytest.fixture(scope="module")
def baseline(task, tmp_path_factory):
    """Two GRPO steps without any KL term."""
    return run(task, tmp_path_factory.mktemp("baseline"))


def test_runs_are_bit_identical_when_nothing_changes(task, baseline, tmp_path):
    # The control for every "this option changes the weights" test below.
    _, weights = run(task, tmp_path)
    assert max_weight_change(baseline[1], weights) == 0.0


@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo", "rloo", "reinforce_baseline"])
def test_a_kl_penalty_in_the_reward_changes_the_update_of_group_estimators(task, tmp_path, estimator):
    # Before: the per-token penalty was computed, logged and dropped for every group estimator.
    _, without = run(task, tmp_path / "zero", advantage_estimator=estimator, init_kl_coef=0)
    logs, with_kl = run(task, tmp_path / "half", advantage_estimator=estimator, init_kl_coef=0.5)
    assert logs["rollout/kl"] > 0            # step 2 samples from a policy that moved off the reference
    assert max_weight_change(without, with_kl) > 1e-4


def test_a_kl_loss_defaults_to_an_estimator_with_a_gradient(task, tmp_path):
    assert parse_args(flags(task, tmp_path, use_kl_loss=True, init_kl_coef=0.5)).kl_estimator == "k3"
    assert AlgorithmConfig(use_kl_loss=True).kl_estimator == "k3"
    assert AlgorithmConfig(use_kl_loss=False).kl_estimator == "k1"
    _, without = run(task, tmp_path / "zero", use_kl_loss=True, init_kl_coef=0)
    logs, with_loss = run(task, tmp_path / "loss", use_kl_loss=True, init_kl_coef=0.5)
    assert logs["train/kl_loss"] > 0
    assert max_weight_change(without, with_loss) > 1e-4


def test_a_kl_loss_with_k1_is_refused_naming_the_fix(task, tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(flags(task, tmp_path, use_kl_loss=True, kl_estimator="k1"))
    err = capsys.readouterr().err
    assert "--kl_estimator k1" in err and "k3" in err


def test_gspo_optimises_the_sequence_level_objective(task, tmp_path, capsys):
    assert AlgorithmConfig(policy_loss="gspo").loss_agg_mode == "seq-mean-token-mean"
    assert AlgorithmConfig(policy_loss="ppo").loss_agg_mode == "token-mean"
    with pytest.raises(SystemExit):
        parse_args(flags(task, tmp_path, policy_loss="gspo", loss_agg_mode="token-mean"))
    assert "--loss_agg_mode seq-mean-token-mean" in capsys.readouterr().err
    # The default run trains GSPO with its own aggregation.
    logs, _ = run(task, tmp_path / "gspo", policy_loss="gspo", eps_clip_low_high=(3e-4, 4e-4))
    assert "train/policy_loss" in logs


def greedy_math_reward(model_path, rows, max_new_tokens: int) -> float:
    """Mean `math` rule reward of Hugging Face `generate`'s greedy responses: an evaluation written
    independently of lightrft's engines and evaluation loop."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightrft.rewards.rules import math_answer_reward

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    responses = []
    with torch.no_grad():
        for row in rows:
            ids = tokenizer(row["input"], return_tensors="pt")["input_ids"]
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            responses.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return math_answer_reward(responses, [row["label"] for row in rows]).float().mean().item()


def test_evaluation_with_overlong_shaping_reports_the_unshaped_task_reward(task, tmp_path):
    # Before: the first evaluation crashed (the shaping needed a generation limit it was not given).
    logs, _ = run(task, tmp_path, remote_rm_url="math", overlong_buffer_len=3, eval_data=task["eval"],
                  eval_steps=1, generate_max_len=4)
    # The shaped reward would be lower (every 4-token response sits inside the 3-token buffer);
    # evaluation must report the task reward itself.
    expected = greedy_math_reward(tmp_path / "model", task["eval_rows"], max_new_tokens=4)
    assert logs["eval/reward_greedy"] == pytest.approx(expected, abs=1e-6)


def test_a_zero_learning_rate_runs_and_leaves_the_policy_unchanged(task, tmp_path):
    # Before: ZeroDivisionError inside the cosine_with_min_lr scheduler.
    logs, weights = run(task, tmp_path, actor_learning_rate=0, lr_scheduler="cosine_with_min_lr")

    initial = load_file(str(task["model"] / "model.safetensors"))
    assert logs["train/actor_lr"] == 0.0
    assert max_weight_change(initial, weights) == 0.0


def test_the_lr_schedule_ends_with_the_run_that_max_steps_cuts_short(task, tmp_path):
    # 32 prompts / 4 per step = 8 steps in the episode, but --max_steps 2: the cosine must reach its
    # floor (10% of the peak) at the last step taken, not stay near the peak.
    logs, _ = run(task, tmp_path, lr_scheduler="cosine_with_min_lr", actor_learning_rate=1e-3, max_steps=2,
                  micro_train_batch_size=16)     # one micro-batch: the logged LR is the one after the step
    assert logs["train/actor_lr"] == pytest.approx(1e-4, rel=1e-6)


def test_a_zero_lr_scheduler_is_well_defined():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.0)
    scheduler = build_scheduler(optimizer, argparse.Namespace(lr_scheduler="cosine_with_min_lr", lr_warmup_ratio=0.1),
                                0.0, 10)
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr() == [0.0]


def test_rollouts_see_the_prompt_ids_sft_trained_on():
    # A tokenizer that adds BOS (Llama, Gemma): before, rollouts dropped it while SFT kept it.
    from lightrft.experience.generation import Generator

    tokenizer = build_char_tokenizer_with_bos()
    text = "3+4="
    sft = SFTDataset([{"input": text, "output": "7"}], tokenizer, input_key="input", output_key="output")
    prompt_ids = PromptDataset([{"input": text}], tokenizer, input_key="input")
    ids = Generator(None, tokenizer, prompt_max_len=16).tokenize([prompt_ids[0][0]])[0]
    assert ids[0] == tokenizer.bos_token_id
    assert sft[0].input_ids[:len(ids)].tolist() == ids


# ---------- samples that train on nothing count nowhere ----------

class OneRank:
    """The strategy's own collectives on one rank, outside torch.distributed."""
    rank, world_size, device = 0, 1, "cpu"
    all_reduce = DeepspeedStrategy.all_reduce
    start_all_reduce = DeepspeedStrategy.start_all_reduce
    all_reduce_many = DeepspeedStrategy.all_reduce_many
    start_all_reduce_many = DeepspeedStrategy.start_all_reduce_many
    _reduce, _reduce_many = DeepspeedStrategy._reduce, DeepspeedStrategy._reduce_many


def experience(advantages, valid) -> Experience:
    adv = torch.tensor(advantages)
    mask = torch.ones_like(adv, dtype=torch.bool)
    return Experience(sequences=torch.ones(adv.size(0), adv.size(1) + 1, dtype=torch.long),
                      attention_mask=torch.ones(adv.size(0), adv.size(1) + 1, dtype=torch.long), action_mask=mask,
                      num_actions=adv.size(1), packed_seq_lens=None, action_log_probs=torch.zeros_like(adv),
                      advantages=adv, returns=adv.clone(),
                      info={"valid": torch.tensor(valid), "reward": torch.zeros(adv.size(0))})


def test_global_whitening_ignores_invalid_samples():
    buffer = NaiveReplayBuffer(2)
    buffer.append(experience([[1.0, 3.0], [0.0, 0.0], [5.0, 7.0]], [1.0, 0.0, 1.0]))
    buffer.normalize("advantages", OneRank())
    # Mean and variance of the valid tokens (1, 3, 5, 7): mean 4, var 5; the invalid row stays 0.
    expected = [(v - 4.0) / (5.0 + 1e-8) ** 0.5 for v in (1.0, 3.0, 5.0, 7.0)]
    got = [x for i in (0, 2) for x in buffer.items[i].per_action["advantages"].tolist()]
    assert got == pytest.approx(expected, abs=1e-6)
    assert buffer.items[1].per_action["advantages"].tolist() == [0.0, 0.0]


def test_loss_normalisers_count_only_samples_that_train():
    from lightrft.trainer.ppo_trainer import PPOTrainer

    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.strategy = OneRank()
    counts = trainer.global_counts([[experience([[1.0, 1.0], [1.0, 1.0]], [1.0, 0.0]),
                                     experience([[1.0, 1.0]], [1.0])],
                                    [experience([[1.0, 0.0]], [1.0])]])
    assert counts == [{"tokens": 4.0, "seqs": 2.0}, {"tokens": 2.0, "seqs": 1.0}]
    assert dict(counts[0]) == {"tokens": 4.0, "seqs": 2.0}


def test_training_mode_is_restored_whichever_level_was_switched_to_eval():
    # The trainer skips model.train() when the model already trains; a model switched to eval at
    # the wrapper (the experience maker) or inside it (HFEngine, evaluation) must train again.
    from lightrft.strategy.deepspeed_strategy import DeepspeedStrategy
    from lightrft.trainer.ppo_trainer import PPOTrainer

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))

    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.strategy = DeepspeedStrategy.__new__(DeepspeedStrategy)
    for level in ("wrapper", "inner"):
        wrapper = Wrapper()
        (wrapper if level == "wrapper" else wrapper.model).eval()
        assert not wrapper.model[1].training
        trainer._train_mode(wrapper)
        assert all(m.training for m in wrapper.modules()), level


def test_dynamic_sampling_fills_a_short_batch_with_groups_that_train_on_nothing():
    kept = [experience([[1.0], [-1.0]], [1.0, 1.0])]
    filler = [experience([[0.0], [0.0]], [1.0, 1.0])]
    batch = fill_to_size(kept, filler, target=4, group_size=2)
    assert sum(e.batch_size for e in batch) == 4
    assert torch.cat([e.info["valid"] for e in batch]).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert sum(float(e.loss_mask.sum()) for e in batch) == 2.0


def test_the_reference_forward_is_skipped_when_no_kl_can_act():
    from lightrft.experience.builder import ExperienceBuilder

    maker = ExperienceBuilder.__new__(ExperienceBuilder)
    maker.initial_model, maker.kl_ctl = object(), FixedKLController(0.0)
    assert not maker.kl_in_use()
    maker.kl_ctl = FixedKLController(0.01)
    assert maker.kl_in_use()


# ---------- sampling noise is independent across prompts and reproducible ----------

def rollout_groups(task, seed: int, rank: int = 0, calls: int = 0) -> list[tuple]:
    """Responses to 8 copies of one prompt, 4 samples each, as a run's generator draws them
    in rollout number `calls + 1`, with chunks of one prompt (micro_batch_size = G)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightrft.experience.generation import Generator, sampling_params
    from lightrft.rollout.hf_engine import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(task["model"])
    model = AutoModelForCausalLM.from_pretrained(task["model"], dtype=torch.float32)
    engine = HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, micro_batch_size=4)
    generator = Generator(engine, tokenizer, prompt_max_len=16, seed=seed, rank=rank, world_size=2)
    rollout = generator.generate(["3+4="] * 8, None, sampling_params(4, max_new_tokens=6), call=calls + 1).rollout
    rows = [tuple(r) for r in rollout.sequences.tolist()]
    return [tuple(rows[i:i + 4]) for i in range(0, 32, 4)]


def test_copies_of_one_prompt_get_independent_samples(task):
    # Before: every chunk re-used one seed, so 8 copies of a prompt gave 8 identical groups.
    groups = rollout_groups(task, seed=0)
    assert len(set(groups)) == 8
    # Within a group the samples differ too, and the same run seed and step draw the same samples.
    assert all(len(set(group)) > 1 for group in groups)
    assert rollout_groups(task, seed=0) == groups
    # Another rank (other global positions), another step, another run seed: other samples.
    for other in (rollout_groups(task, seed=0, rank=1), rollout_groups(task, seed=0, calls=1),
                  rollout_groups(task, seed=1)):
        assert not set(other) & set(groups)


TRUNCATION_REWARD = """
import torch

def reward_func(queries, prompts, labels, truncated):
    return torch.tensor([1.0 if cut else 0.0 for cut in truncated])
"""


def test_reward_functions_can_tell_a_cut_response_from_a_finished_one(task, tmp_path):
    # Before: reward functions saw only text, so a response cut at --generate_max_len looked like
    # one that ended. Up to 8 tokens sampled hot (temperature 4) from an untrained model: most are
    # cut, some end with EOS; the reward is the flag itself, so it must equal the engine's flags.
    reward = tmp_path / "cut_reward.py"
    reward.write_text(TRUNCATION_REWARD)
    logs, _ = run(task, tmp_path, remote_rm_url=reward, generate_max_len=8, temperature=4.0, max_steps=1)
    assert 0.0 < logs["rollout/truncated"] < 1.0
    assert logs["rollout/reward"] == pytest.approx(logs["rollout/truncated"], abs=1e-7)


def test_reward_sources_get_the_truncation_flags_only_when_they_take_them():
    from lightrft.rewards.base import call_reward_source

    def three(queries, prompts, labels):
        return [len(q) for q in queries]

    def four(queries, prompts, labels, truncated):
        return [float(t) for t in truncated]

    assert call_reward_source(three, ["ab", "c"], ["", ""], [None, None], [True, False]) == [2, 1]
    assert call_reward_source(four, ["ab", "c"], ["", ""], [None, None], [True, False]) == [1.0, 0.0]


# Every prompt of the tiny task whose label is even gets 0 for every sample: a group without signal.
HALF_SILENT_REWARD = """
import torch

def reward_func(queries, prompts, labels):
    out = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):]
        out.append(0.0 if int(label) % 2 == 0 else sum(c.isdigit() for c in response) / max(len(response), 1))
    return torch.tensor(out)
"""


def test_dynamic_sampling_takes_the_planned_optimizer_steps(task, tmp_path, capsys):
    # Before: extra sampling rounds used up the prompts, the run ended after about half of the 8
    # planned steps (32 prompts / 4), and the linear schedule stopped half way to zero.
    reward = tmp_path / "half_silent.py"
    reward.write_text(HALF_SILENT_REWARD)
    logs, _ = run(task, tmp_path, remote_rm_url=reward, dynamic_sampling=True, max_steps=-1, lr_scheduler="linear",
                  actor_learning_rate=1e-3, micro_train_batch_size=16)
    summary = json.loads([line for line in capsys.readouterr().out.splitlines() if line.startswith("{")][-1])
    assert summary["step"] == 8 and summary["stop_reason"] == "finished"
    assert logs["train/sampling_rounds"] > 8        # extra prompt batches were drawn ...
    assert logs["train/actor_lr"] == 0.0            # ... and the schedule still ended at its last step


@pytest.mark.parametrize("train_batch, micro_batch", [(16, 16), (8, 4)], ids=["one-step", "two-steps"])
def test_the_on_policy_shortcut_computes_what_the_separate_forward_computes(task, tmp_path, train_batch,
                                                                              micro_batch):
    # One epoch: the first optimizer step of a rollout is exactly on-policy, so its old log-probs
    # are its own forward and the experience maker skips its actor forward; with two optimizer
    # steps per rollout, the second step's samples get theirs from a forward before the first
    # update. Either way the update must equal the full path's.
    from lightrft.trainer.callbacks import TrainerCallback
    from lightrft.trainer.ppo_trainer import PPOTrainer

    class FullPath(PPOTrainer):
        reuse_old_log_probs = False

    class OldLogProbs(TrainerCallback):
        def __init__(self):
            self.skipped, self.ratio_max, self.ratio_min = [], [], []

        def on_rollout_end(self, trainer, experiences):
            self.skipped.append(all(e.action_log_probs is None for e in experiences))

        def on_step_end(self, trainer, metrics):
            self.ratio_max.append(metrics["train/ratio_max"])
            self.ratio_min.append(metrics["train/ratio_min"])

    short_seen, full_seen = OldLogProbs(), OldLogProbs()
    common = dict(actor_learning_rate=1e-4, train_batch_size=train_batch, micro_train_batch_size=micro_batch)
    short_logs, short = run(task, tmp_path / "short", callbacks=[short_seen], **common)
    full_logs, full = run(task, tmp_path / "full", trainer_cls=FullPath, callbacks=[full_seen], **common)
    steps_per_rollout = 16 // train_batch
    assert short_seen.skipped == [True, True] and full_seen.skipped == [False, False]
    firsts = slice(0, None, steps_per_rollout)
    assert short_seen.ratio_max[firsts] == short_seen.ratio_min[firsts] == [1.0, 1.0]   # exactly on-policy
    assert full_seen.ratio_max[firsts] == pytest.approx([1.0, 1.0], abs=1e-5)          # equal up to rounding
    assert short_seen.ratio_max == pytest.approx(full_seen.ratio_max, abs=1e-5)
    assert short_seen.ratio_min == pytest.approx(full_seen.ratio_min, abs=1e-5)
    if steps_per_rollout > 1:                      # the later step is off-policy, in both paths alike
        assert short_seen.ratio_max[1] != 1.0 and full_seen.ratio_max[1] != 1.0
    assert short_logs["rollout/reward"] == pytest.approx(full_logs["rollout/reward"], abs=1e-6)
    assert short_logs["train/policy_loss"] == pytest.approx(full_logs["train/policy_loss"], abs=1e-5)
    initial = load_file(str(task["model"] / "model.safetensors"))
    moved = max_weight_change(initial, short)
    assert moved > 1e-5 and max_weight_change(short, full) < 0.02 * moved
    # Two epochs over the batch are not on-policy after the first pass: the forward runs.
    two_epochs_seen = OldLogProbs()
    run(task, tmp_path / "epochs", callbacks=[two_epochs_seen], max_epochs=2, max_steps=1, **common)
    assert two_epochs_seen.skipped == [False]


def test_eval_on_startup_logs_the_starting_policy_at_step_0(task, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.e2e.conftest import tensorboard_scalars

    run(task, tmp_path, eval_data=task["eval"], eval_on_startup=True, eval_steps=-1, generate_max_len=4,
        max_steps=1, use_tensorboard=tmp_path / "tb")
    series = dict(tensorboard_scalars(tmp_path / "tb")["eval/reward_greedy"])
    # Independent reference: the initial model's greedy responses scored with the task's reward
    # (share of digits in the response, tests/trainer/ppo_harness.py).
    tokenizer = AutoTokenizer.from_pretrained(task["model"])
    model = AutoModelForCausalLM.from_pretrained(task["model"], dtype=torch.float32).eval()
    shares = []
    with torch.no_grad():
        for row in task["eval_rows"]:
            ids = tokenizer(row["input"], return_tensors="pt")["input_ids"]
            out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
            response = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            shares.append(sum(c.isdigit() for c in response) / max(len(response), 1))
    assert series[0] == pytest.approx(sum(shares) / len(shares), abs=1e-6)


# ---------- a step's collectives: each one waits for the slowest rank ----------

def test_a_grpo_step_waits_for_three_all_reduces_and_leaves_the_collector_frozen_while_it_trains(task, tmp_path):
    # Two optimizer steps per rollout under ZeRO-0. Waited for: one gradient all-reduce per optimizer
    # step (no second one for the gradient norm) and the pass's metrics with the preemption flag.
    # In flight while the rank works: the loss normalisers (during the old-log-prob forward), the
    # rollout's totals (during training) and the metrics' extremes (beside the pass's metrics).
    import gc

    import torch.distributed as dist

    from lightrft.trainer.callbacks import TrainerCallback

    calls = {"waited": 0, "in flight": 0}
    original = dist.all_reduce

    def counted(*args, **kwargs):
        calls["in flight" if kwargs.get("async_op") else "waited"] += 1
        return original(*args, **kwargs)

    class Spans(TrainerCallback):
        """All-reduces from one rollout's end to the next: a step's training, its end and the
        next rollout."""
        def __init__(self):
            self.counts, self.frozen = [], []

        def on_rollout_end(self, trainer, experiences):
            self.counts.append(dict(calls))
            calls.update(dict.fromkeys(calls, 0))
            self.frozen.append(gc.get_freeze_count())

    spans = Spans()
    dist.all_reduce = counted
    try:
        logs, _ = run(task, tmp_path, callbacks=[spans], zero_stage=0, train_batch_size=8, micro_train_batch_size=4,
                      max_steps=3)
    finally:
        dist.all_reduce = original
    assert spans.counts[1:] == [{"waited": 3, "in flight": 3}] * 2
    assert min(spans.frozen) > 1000 and gc.get_freeze_count() == 0   # frozen during the run, not after
    # The step's totals carry the reward file's counters: 3 rollouts of 16 samples, no failure.
    assert logs["rollout/reward_source0_samples"] == 48.0
    assert logs["rollout/reward_source0_errors_rate"] == logs["rollout/reward_source0_timeouts_rate"] == 0.0


def test_the_metrics_of_a_pass_are_reduced_per_optimizer_step_in_one_waited_all_reduce():
    from lightrft.trainer.ppo_trainer import PPOTrainer

    reduced = []
    nan = float("nan")

    class Recording(OneRank):
        def _reduce(self, tensor, op, wait):
            reduced.append((tuple(tensor.shape), op, wait))
            return DeepspeedStrategy._reduce(self, tensor, op, wait)

    class TwoRanks(Recording):
        """A second rank that logged the same means, other extremes, and was asked to stop."""
        world_size = 2

        def _reduce(self, tensor, op, wait):
            if op == "max":             # its ratio_max / -ratio_min per optimizer step
                return Recording._reduce(self, torch.maximum(tensor, torch.tensor([[1.375, -0.75], [2.0, -0.5]],
                                                                                  dtype=tensor.dtype)), op, wait)
            both = tensor * 2           # the other rank's means equal this rank's
            both[-1] += 1               # the preemption flag travels last; the other rank's is 1
            return Recording._reduce(self, both, op, wait)

    def same(got, want):
        return got.keys() == want.keys() and all(
            (math.isnan(got[k]) and math.isnan(want[k])) or got[k] == want[k] for k in want)

    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.strategy = Recording()
    t = torch.tensor
    # Two optimizer steps of two micro-batches. A micro-batch with nothing to train on reports NaN
    # extremes; in the second step neither micro-batch trains on anything on this rank.
    steps = [[{"a": t(1.0), "b": t(2.0), "ratio_max": t(1.25), "ratio_min": t(0.875)},
              {"a": t(3.0), "b": t(6.0), "ratio_max": t(nan), "ratio_min": t(nan)}],
             [{"a": t(5.0), "b": t(0.0), "ratio_max": t(nan), "ratio_min": t(nan)},
              {"a": t(7.0), "b": t(1.0), "ratio_max": t(nan), "ratio_min": t(nan)}]]
    one_rank = [{"a": 2.0, "b": 4.0, "ratio_max": 1.25, "ratio_min": 0.875},
                {"a": 6.0, "b": 0.5, "ratio_max": nan, "ratio_min": nan}]
    for preempted in (False, True):
        metrics, stop = trainer.reduce_pass_metrics(steps, preempted=preempted)
        assert stop is preempted and all(same(g, w) for g, w in zip(metrics, one_rank)) and len(metrics) == 2
    # The extremes go first, in flight (a max over the ranks, *_min negated); then the 2x4 metrics
    # and the preemption flag together, waited: one waited collective per pass.
    assert reduced == [((2, 2), "max", False), ((9,), "sum", True)] * 2
    trainer.strategy = TwoRanks()      # this rank was not asked to stop, the other one was
    metrics, stop = trainer.reduce_pass_metrics(steps)
    assert stop is True
    assert same(metrics[0], {"a": 2.0, "b": 4.0, "ratio_max": 1.375, "ratio_min": 0.75})
    assert same(metrics[1], {"a": 6.0, "b": 0.5, "ratio_max": 2.0, "ratio_min": 0.5})
    # A pass without optimizer steps still says whether to stop.
    trainer.strategy = Recording()
    assert trainer.reduce_pass_metrics([], preempted=True) == ([], True)


def test_metrics_combine_as_means_and_extremes():
    from lightrft.trainer.ppo_trainer import combine_metric

    nan = float("nan")
    assert combine_metric("train/policy_loss", [1.0, 2.0, 6.0]) == 3.0
    assert combine_metric("train/ratio_max", [1.25, nan, 1.5, 0.75]) == 1.5     # not the mean of maxima
    assert combine_metric("train/ratio_min", [1.25, nan, 1.5, 0.75]) == 0.75
    assert math.isnan(combine_metric("train/ratio_max", [nan, nan]))
    assert math.isnan(combine_metric("train/ratio_min", []))
    # The form the max all-reduce takes: *_min negated, -inf for nothing.
    assert combine_metric("train/ratio_min", [1.25, 0.75], signed=True) == -0.75
    assert combine_metric("train/ratio_max", [nan], signed=True) == float("-inf")
    assert combine_metric("train/ratio_min", [nan], signed=True) == float("-inf")


def test_reward_source_failure_rates_are_per_call():
    from lightrft.trainer.metrics import reward_source_metrics

    totals = {"rollout/reward_source0_calls": 4.0, "rollout/reward_source0_timeouts": 1.0,
              "rollout/reward_source0_errors": 2.0, "rollout/reward_source1_requests": 3.0,
              "rollout/reward_source1_failures": 1.0}
    assert reward_source_metrics(totals) == {**totals, "rollout/reward_source0_timeouts_rate": 0.25,
                                             "rollout/reward_source0_errors_rate": 0.5}


def test_responses_decode_in_one_batch_as_row_by_row():
    # The per-row formula decode used before: each row's masked tokens through tokenizer.decode.
    from lightrft.rollout.base import RolloutOutput
    from lightrft.experience.scorer import Scorer

    tokenizer = build_char_tokenizer_with_bos()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 4, 6, 2, 6, 3]                       # 6 = the full width, cut without an EOS
    responses = torch.full((len(lengths), 6), pad)
    for row, length in enumerate(lengths):
        responses[row, :length] = torch.tensor(digits)[torch.randint(0, 10, (length,), generator=generator)]
        if length < 6:
            responses[row, length - 1] = eos           # an ended response keeps its EOS (a special token)
    prompts_ids = torch.tensor(digits[:3]).repeat(len(lengths), 1)
    action_mask = torch.arange(6) < torch.tensor(lengths).unsqueeze(1)
    rollout = RolloutOutput(sequences=torch.cat([prompts_ids, responses], dim=1),
                            attention_mask=torch.cat([torch.ones_like(prompts_ids), action_mask.long()], dim=1),
                            action_mask=action_mask, rollout_log_probs=torch.zeros(len(lengths), 6), prompt_len=3)
    scorer = Scorer(tokenizer, reward_sources=["a source"])
    queries, prompts = scorer.decode(rollout, ["a+b=", "c+d=", "e+f="], n=2)
    row_by_row = [tokenizer.decode(row[mask].tolist(), skip_special_tokens=True)
                  for row, mask in zip(responses, action_mask)]
    assert prompts == ["a+b=", "a+b=", "c+d=", "c+d=", "e+f=", "e+f="]
    assert queries == [p + r for p, r in zip(prompts, row_by_row)]
    assert [len(r) for r in row_by_row] == [0, 3, 6, 1, 6, 2]        # EOS dropped, digits kept
