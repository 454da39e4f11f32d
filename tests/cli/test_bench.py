"""bench: every checkpoint of a run scored on held-out prompts, written as a table and a plot.

The reference scores are computed here from the checkpoints themselves: greedy responses from
transformers' own `generate` (one prompt at a time, no padding), and the k samples from the
rollout engine with the evaluation seeds, both scored with the reward file's formula."""

import csv
import os
from pathlib import Path

import pytest
import torch
from matplotlib.image import imread
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightrft.cli.bench import find_checkpoints, main
from lightrft.rollout.base import SamplingParams
from lightrft.rollout.hf_engine import HFEngine
from lightrft.rollout.seeds import request_seeds
from lightrft.utils.tiny import save_tiny_model
from lightrft.utils.toy import arithmetic_splits, write_jsonl
from tests.trainer.ppo_harness import LAUNCH_ENV, REWARD_FILE

STEPS = (2, 10, 5)       # written out of order: the table must follow the step, not the folder name
MAX_NEW = 6
K = 2
SEED = 11


def digit_share(response: str) -> float:
    return sum(c.isdigit() for c in response) / max(len(response), 1)


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A --ckpt_path with three exports (tiny models of different seeds), a DeepSpeed checkpoint
    folder without an export, eight eval prompts and the digit-share reward file."""
    root = tmp_path_factory.mktemp("bench")
    ckpt = root / "ckpt"
    for i, step in enumerate(STEPS):
        save_tiny_model(ckpt / f"global_step{step}_hf", seed=i)
    (ckpt / "_actor" / "global_step7").mkdir(parents=True)
    _, eval_rows = arithmetic_splits(n_train=4, n_eval=8, seed=1, max_operand=9)
    reward = root / "digits.py"
    reward.write_text(REWARD_FILE)
    return {"ckpt": ckpt, "eval": write_jsonl(eval_rows, root / "eval.jsonl"),
            "prompts": [r["input"] for r in eval_rows], "reward": reward, "root": root}


def reference_scores(path: Path, prompts: list[str]) -> dict[str, float]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    greedy = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")
            out = model.generate(**ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
            greedy.append(digit_share(tokenizer.decode(out[0, ids["input_ids"].size(1):], skip_special_tokens=True)))
    # Evaluation call 1 is the greedy pass, call 2 the k samples of the same (only) batch.
    engine = HFEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    rollout = engine.generate(ids, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, n=K),
                              seeds=request_seeds(SEED, 2, 0, len(prompts), "eval"))
    samples = [digit_share(tokenizer.decode(row[mask], skip_special_tokens=True))
               for row, mask in zip(rollout.responses, rollout.action_mask)]
    per_prompt = torch.tensor(samples).view(len(prompts), K)
    return {"eval/reward_greedy": sum(greedy) / len(greedy),
            f"eval/pass@{K}": (per_prompt > 0).any(dim=1).float().mean().item(),
            "eval/reward_mean": per_prompt.mean().item()}


def test_bench_writes_table_and_plot_for_three_checkpoints(run_folder, capsys):
    out = run_folder["root"] / "report"
    for key in LAUNCH_ENV:
        os.environ.pop(key, None)
    rows = main(["--ckpt_path", str(run_folder["ckpt"]), "--eval_data", str(run_folder["eval"]),
                 "--input_key", "input", "--label_key", "label", "--remote_rm_url", str(run_folder["reward"]),
                 "--eval_n_samples", str(K), "--generate_max_len", str(MAX_NEW), "--micro_rollout_batch_size", "8",
                 "--seed", str(SEED), "--output_dir", str(out)])
    for key in LAUNCH_ENV:
        os.environ.pop(key, None)
    assert "skipping" in capsys.readouterr().out      # the DeepSpeed-only checkpoint is named, not evaluated

    with open(out / "bench.csv") as f:
        table = list(csv.DictReader(f))
    assert [int(r["step"]) for r in table] == sorted(STEPS)
    assert [r["step"] for r in rows] == sorted(STEPS)
    metrics = ["eval/reward_greedy", f"eval/pass@{K}", "eval/reward_mean"]
    for row in table:
        expected = reference_scores(Path(row["checkpoint"]), run_folder["prompts"])
        assert {m: float(row[m]) for m in metrics} == pytest.approx(expected, abs=1e-6)
    # The checkpoints are different models: their curves are not flat.
    assert len({round(float(r["eval/reward_mean"]), 6) for r in table}) > 1

    markdown = (out / "bench.md").read_text().splitlines()
    assert markdown[0] == "| step | checkpoint | " + " | ".join(metrics) + " |"
    assert len(markdown) == 2 + len(STEPS)
    image = imread(out / "bench.png")
    assert image.shape[:2] == (400, 600)          # figsize 6 x 4 inches at 100 dpi
    assert image[..., :3].std() > 0.05           # something is drawn


def test_find_checkpoints_orders_by_step_and_adds_pretrain(run_folder):
    checkpoints, without_export = find_checkpoints(run_folder["ckpt"], pretrain="/models/base")
    assert [c.step for c in checkpoints] == [0, *sorted(STEPS)]
    assert checkpoints[0].path == Path("/models/base")
    assert [p.name for p in without_export] == ["global_step7"]


def test_bench_without_exports_says_how_to_get_them(tmp_path, run_folder, capsys):
    (tmp_path / "_actor" / "global_step3").mkdir(parents=True)
    with pytest.raises(SystemExit):
        main(["--ckpt_path", str(tmp_path), "--eval_data", str(run_folder["eval"]), "--remote_rm_url", "math"])
    assert "--save_hf_ckpt" in capsys.readouterr().err
