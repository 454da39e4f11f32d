"""train_rm end to end on two ranks under ZeRO-3: a tiny reward model learns a preference that is
learnable (chosen answers contain a '#'), the export loads as a RewardModel whose config holds the
reward mean and std over the training set."""

import json
import random

import pytest
import torch

from lightrft.cli.train_rm import parse_args
from lightrft.datasets import PreferenceDataset
from lightrft.datasets.toy import write_jsonl
from lightrft.models import RewardModel
from lightrft.models.tokenizer import build_tokenizer
from lightrft.utils.tiny import save_tiny_model
from tests.conftest import run_torchrun

pytestmark = pytest.mark.dist


def marker_pairs(n: int, seed: int) -> list[dict]:
    """Pairs of random answers of equal length over 'a'-'h'; the chosen one has a '#' somewhere."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = rng.randint(4, 8)
        chosen = [rng.choice("abcdefgh") for _ in range(length)]
        rejected = [rng.choice("abcdefgh") for _ in range(length)]
        chosen[rng.randrange(length)] = "#"
        rows.append({"prompt": f"Q{rng.randint(0, 9)}: ", "chosen": "".join(chosen), "rejected": "".join(rejected)})
    return rows


def scores(model_dir, rows, **kwargs):
    """(chosen scores, rejected scores) of `rows` from the exported folder, in one plain process."""
    tokenizer = build_tokenizer(str(model_dir))     # as train_rm loads it
    model = RewardModel(model_dir, **kwargs).eval()
    dataset = PreferenceDataset(rows, tokenizer, prompt_key="prompt", max_len=32)
    batch = dataset.collate_fn(list(dataset))
    with torch.no_grad():
        return (model(batch.chosen_ids, attention_mask=batch.chosen_mask),
                model(batch.rejected_ids, attention_mask=batch.rejected_mask))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_rm")
    base = save_tiny_model(root / "base", seed=0)
    train_rows, eval_rows = marker_pairs(256, seed=0), marker_pairs(64, seed=1)
    proc = run_torchrun([
        "-m", "lightrft.cli.train_rm", "--pretrain", base, "--dataset", write_jsonl(train_rows, root / "train.jsonl"),
        "--eval_dataset", write_jsonl(eval_rows, root / "eval.jsonl"), "--prompt_key", "prompt",
        "--max_len", 32, "--zero_stage", 3, "--max_epochs", 2, "--train_batch_size", 32,
        "--micro_train_batch_size", 8, "--learning_rate", 3e-3, "--lr_warmup_ratio", 0,
        "--save_path", root / "rm", "--ckpt_path", root / "ckpt"])
    reported = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    return {"root": root, "reported": reported, "train": train_rows, "eval": eval_rows}


def test_pair_accuracy_is_well_above_chance(run):
    assert run["reported"]["step"] == 16
    assert run["reported"]["eval/acc"] >= 0.9  # chance is 0.5
    chosen, rejected = scores(run["root"] / "rm", run["eval"])
    accuracy = (chosen > rejected).float().mean().item()
    assert accuracy == pytest.approx(run["reported"]["eval/acc"])
    loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean().item()
    assert loss == pytest.approx(run["reported"]["eval/loss"], abs=1e-4)


def test_export_stores_training_reward_statistics(run):
    rm_dir = run["root"] / "rm"
    config = json.loads((rm_dir / "config.json").read_text())
    chosen, rejected = scores(rm_dir, run["train"])
    every = torch.cat([chosen, rejected])
    assert config["value_head_prefix"] == "score"
    assert config["mean"] == pytest.approx(every.mean().item(), abs=1e-4)
    assert config["std"] == pytest.approx(every.std(unbiased=False).item(), rel=1e-4)
    assert (config["mean"], config["std"]) == pytest.approx((run["reported"]["reward/mean"],
                                                             run["reported"]["reward/std"]), abs=1e-5)
    # With normalisation on, the loaded model standardises with those statistics.
    normalized, _ = scores(rm_dir, run["train"][:4], normalize_reward=True)
    assert normalized.tolist() == pytest.approx(((chosen[:4] - config["mean"]) / config["std"]).tolist(), abs=1e-5)


def test_flag_errors(capsys):
    base = ["--pretrain", "m", "--dataset", "d.jsonl"]
    for extra, message in ((["--lora_rank", "8"], "--lora_rank is not supported by train_rm"),
                           (["--packing_samples"], "--packing_samples is not supported by train_rm"),
                           (["--max_norm", "inf"], "--max_norm must be a finite number, got inf"),
                           (["--ckpt_path", ""], "--ckpt_path is empty")):
        with pytest.raises(SystemExit):
            parse_args([*base, *extra])
        assert message in capsys.readouterr().err
    assert parse_args(base).learning_rate == 9e-6


def test_a_missing_eval_dataset_names_its_own_flag(tmp_path):
    # Before: the error said "--dataset <eval path>", the flag of the training pairs.
    from lightrft.cli.train_rm import build_datasets
    from lightrft.utils.tiny import build_char_tokenizer

    train = write_jsonl([{"chosen": "a", "rejected": "b"}], tmp_path / "train.jsonl")
    missing = tmp_path / "nope.jsonl"
    args = parse_args(["--pretrain", "m", "--dataset", str(train), "--eval_dataset", str(missing)])
    with pytest.raises(FileNotFoundError, match=rf"^--eval_dataset {missing}: no such file"):
        build_datasets(args, build_char_tokenizer())
