"""bench: every checkpoint of a run scored on held-out prompts, written as a table and a plot.

The reference scores are computed here from the checkpoints themselves: greedy responses from
transformers' own `generate` (one prompt at a time, no padding), and the k samples from the
rollout engine with the evaluation seeds, both scored with the reward file's formula. DeepSpeed
checkpoints come from real short train_ppo runs (ZeRO-2, ZeRO-3, ZeRO-3 with LoRA), checked
against the final Hugging Face export of the same run."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from matplotlib.image import imread
from transformers import AutoModelForCausalLM, AutoTokenizer

from safetensors.torch import load_file

from lightrft.cli.bench import find_checkpoints, main, run_pretrain
from lightrft.datasets.toy import arithmetic_splits, write_jsonl
from lightrft.rollout.base import SamplingParams
from lightrft.rollout.hf_engine import HFEngine
from lightrft.rollout.seeds import request_seeds
from lightrft.serving.checkpoint_weights import CheckpointReadError, load_deepspeed_policy
from lightrft.strategy.checkpoint_io import save_checkpoint_dir
from lightrft.utils.tiny import save_tiny_model
from tests.conftest import REPO_ROOT, subprocess_env
from tests.trainer import ppo_harness
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
    folder of an exported step (5) and an empty one without an export (7, as a crashed save
    leaves), eight eval prompts and the digit-share reward file."""
    root = tmp_path_factory.mktemp("bench")
    ckpt = root / "ckpt"
    for i, step in enumerate(STEPS):
        save_tiny_model(ckpt / f"global_step{step}_hf", seed=i)
    (ckpt / "_actor" / "global_step7").mkdir(parents=True)
    (ckpt / "_actor" / "global_step5").mkdir(parents=True)
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


def run_bench(ckpt: Path, eval_data: Path, reward: Path, out: Path, *extra: str) -> list[dict]:
    for key in LAUNCH_ENV:          # a fresh one-rank group for every run
        os.environ.pop(key, None)
    rows = main(["--ckpt_path", str(ckpt), "--eval_data", str(eval_data), "--input_key", "input",
                 "--label_key", "label", "--remote_rm_url", str(reward), "--eval_n_samples", str(K),
                 "--generate_max_len", str(MAX_NEW), "--micro_rollout_batch_size", "8", "--seed", str(SEED),
                 "--output_dir", str(out), *extra])
    for key in LAUNCH_ENV:
        os.environ.pop(key, None)
    return rows


def test_bench_writes_table_and_plot_for_three_checkpoints(run_folder, capsys):
    out = run_folder["root"] / "report"
    rows = run_bench(run_folder["ckpt"], run_folder["eval"], run_folder["reward"], out)
    printed = capsys.readouterr().out
    # The empty DeepSpeed folder is named with the reason and skipped; the others are evaluated.
    skip = [line for line in printed.splitlines() if line.startswith("bench: skipping")]
    assert len(skip) == 1 and str(run_folder["ckpt"] / "_actor" / "global_step7") in skip[0]
    assert "incomplete" in skip[0]
    # Step 5 has an export and a DeepSpeed checkpoint: the export is evaluated, once.
    assert f"evaluating its Hugging Face export, not the DeepSpeed checkpoint {run_folder['ckpt']}/_actor/" \
           "global_step5" in printed

    with open(out / "bench.csv") as f:
        table = list(csv.DictReader(f))
    assert [int(r["step"]) for r in table] == sorted(STEPS)
    assert [r["step"] for r in rows] == sorted(STEPS)
    metrics = ["eval/reward_greedy", f"eval/pass@{K}", "eval/reward_mean"]
    assert [Path(r["checkpoint"]).name for r in table] == [f"global_step{s}_hf" for s in sorted(STEPS)]
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


# Runs bench in a fresh interpreter where importing matplotlib fails, as after `pip install -e .`.
WITHOUT_MATPLOTLIB = """
import sys

class NoMatplotlib:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoMatplotlib())
from lightrft.cli.bench import main
main(sys.argv[1:])
"""


def test_bench_without_matplotlib_writes_the_tables_and_says_how_to_get_the_plot(tmp_path, run_folder):
    ckpt, out = tmp_path / "ckpt", tmp_path / "report"
    save_tiny_model(ckpt / "global_step3_hf", seed=0)
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_MATPLOTLIB, "--ckpt_path", str(ckpt), "--eval_data", str(run_folder["eval"]),
         "--input_key", "input", "--remote_rm_url", str(run_folder["reward"]), "--generate_max_len", "4",
         "--output_dir", str(out)],
        cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "bench.csv") as f:
        table = list(csv.DictReader(f))
    assert [int(r["step"]) for r in table] == [3]
    assert 0 <= float(table[0]["eval/reward_greedy"]) <= 1
    assert (out / "bench.md").read_text().startswith("| step | checkpoint | eval/reward_greedy |")
    assert not (out / "bench.png").exists()
    assert proc.stderr.count('pip install "lightrft[plot]"') == 1
    assert f"bench: wrote {out / 'bench.csv'}, {out / 'bench.md'}\n" in proc.stdout


def test_find_checkpoints_orders_by_step_and_adds_pretrain(run_folder):
    checkpoints, shadowed = find_checkpoints(run_folder["ckpt"], pretrain="/models/base")
    assert [(c.step, c.kind) for c in checkpoints] == [(0, "hf"), (2, "hf"), (5, "hf"), (7, "deepspeed"), (10, "hf")]
    assert checkpoints[0].path == Path("/models/base")
    assert checkpoints[3].path == run_folder["ckpt"] / "_actor" / "global_step7"
    assert shadowed == [run_folder["ckpt"] / "_actor" / "global_step5"]


def test_bench_fails_when_no_checkpoint_can_be_read(tmp_path, run_folder):
    (tmp_path / "_actor" / "global_step3").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_info:
        run_bench(tmp_path, run_folder["eval"], run_folder["reward"], tmp_path / "report")
    message = str(exit_info.value)
    assert "no checkpoint could be evaluated" in message
    assert f"{tmp_path / '_actor' / 'global_step3'} is incomplete" in message
    assert not (tmp_path / "report" / "bench.csv").exists()


def test_bench_without_checkpoints_says_how_to_get_them(tmp_path, run_folder, capsys):
    with pytest.raises(SystemExit):
        main(["--ckpt_path", str(tmp_path), "--eval_data", str(run_folder["eval"]), "--remote_rm_url", "math"])
    assert "--save_steps" in capsys.readouterr().err


def test_unreadable_deepspeed_checkpoint_names_the_folder_and_reason(tmp_path):
    """A complete checkpoint (valid marker) whose model states file is not a torch file."""
    def write_shard(folder: Path) -> None:
        (folder / "deepspeed").mkdir()
        (folder / "deepspeed" / "mp_rank_00_model_states.pt").write_bytes(b"not a checkpoint")

    folder = save_checkpoint_dir(tmp_path / "_actor", "global_step4", write_shard)
    with pytest.raises(CheckpointReadError, match="DeepSpeed files cannot be read") as err:
        load_deepspeed_policy(folder, save_tiny_model(tmp_path / "base", seed=0))
    assert str(folder) in str(err.value)
    (folder / "deepspeed" / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointReadError, match="incomplete"):
        load_deepspeed_policy(folder, tmp_path / "base")


@pytest.mark.parametrize("zero_stage,lora_rank", [(2, 0), (3, 0), (3, 4)], ids=["zero2", "zero3", "zero3-lora"])
def test_bench_evaluates_deepspeed_checkpoints_of_a_run(tmp_path, zero_stage, lora_rank, capsys):
    """Two GRPO steps saved every step without --save_hf_ckpt: bench evaluates _actor/global_step1
    and 2 (and the base model as step 0); the step-2 weights it loads are exactly the final export."""
    task = ppo_harness.make_task(tmp_path)
    ppo_harness.run(task, tmp_path / "run", zero_stage=zero_stage, save_steps=1, lora_rank=lora_rank or None)
    ckpt, export = tmp_path / "run" / "ckpt", tmp_path / "run" / "model"
    assert not list(ckpt.glob("*_hf"))
    assert run_pretrain(ckpt) == str(task["model"])     # bench's base model when --pretrain is left out

    final = load_file(str(export / "model.safetensors"))
    loaded = {step: load_deepspeed_policy(ckpt / "_actor" / f"global_step{step}", task["model"]).state_dict()
              for step in (1, 2)}
    assert set(loaded[2]) == set(final)
    for name, tensor in final.items():
        assert torch.equal(loaded[2][name], tensor), name
    # Each step moved the weights (the checkpoints are distinct models, not copies of the base).
    base = load_file(str(Path(task["model"]) / "model.safetensors"))
    assert ppo_harness.max_weight_change(loaded[1], base) > 1e-4
    assert ppo_harness.max_weight_change(loaded[2], loaded[1]) > 1e-4

    out = tmp_path / "report"
    # One batch of all 16 eval prompts, as reference_scores draws them.
    rows = run_bench(ckpt, task["eval"], task["reward"], out, "--pretrain", str(task["model"]),
                     "--micro_rollout_batch_size", str(len(task["eval_rows"])))
    with open(out / "bench.csv") as f:
        table = list(csv.DictReader(f))
    assert [int(r["step"]) for r in table] == [r["step"] for r in rows] == [0, 1, 2]
    assert [r["checkpoint"] for r in table] == [str(task["model"]), str(ckpt / "_actor" / "global_step1"),
                                                str(ckpt / "_actor" / "global_step2")]
    prompts = [r["input"] for r in task["eval_rows"]]
    metrics = ["eval/reward_greedy", f"eval/pass@{K}", "eval/reward_mean"]
    # Bench scored step 2 exactly as the exported model scores, and step 0 as the base model.
    for row, reference in ((table[2], export), (table[0], Path(task["model"]))):
        assert {m: float(row[m]) for m in metrics} == pytest.approx(reference_scores(reference, prompts), abs=1e-6)


def test_a_checkpoint_with_fewer_embedding_rows_than_the_tokenizer_is_checked_on_the_data_ids(tmp_path):
    # A tokenizer longer than the model's embedding: the eval prompts' ids (as the dataset encoded
    # them) must fit the rows; a prompt with an id past them names --eval_data.
    from types import SimpleNamespace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightrft.cli.bench import Evaluator, build_parser
    from lightrft.serving.checkpoint_weights import CheckpointReadError
    from lightrft.utils.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()           # 100 ids; ' ' is 98
    rows = len(tokenizer) - 8
    config = Qwen2Config(vocab_size=rows, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Qwen2ForCausalLM(config)
    reward = tmp_path / "reward.py"
    reward.write_text("import torch\n\ndef reward_func(queries, prompts, labels):\n"
                      "    return torch.zeros(len(queries))\n")
    strategy = SimpleNamespace(device="cpu", rank=0, world_size=1, config=SimpleNamespace(seed=0),
                               setup_dataloader=lambda data, size, **kw: torch.utils.data.DataLoader(
                                   data, batch_size=size, collate_fn=kw["collate_fn"]),
                               all_reduce=lambda value, op="mean": value)
    for text, fits in (("1+1=", True), ("1 + 1 =", False)):
        data = tmp_path / f"eval_{fits}.jsonl"
        data.write_text(json.dumps({"input": text, "label": "2"}) + "\n")
        args = build_parser().parse_args(["--ckpt_path", str(tmp_path), "--eval_data", str(data), "--label_key",
                                          "label", "--remote_rm_url", str(reward), "--generate_max_len", "2"])
        evaluator = Evaluator(args, strategy)
        if fits:
            assert "eval/reward_greedy" in evaluator.score(model, tokenizer, str(tmp_path))
        else:
            with pytest.raises(CheckpointReadError, match=f"--eval_data {data}"):
                evaluator.score(model, tokenizer, str(tmp_path))
