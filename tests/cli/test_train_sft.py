"""train_sft end to end on two ranks (ZeRO-2, packed samples): a tiny model learns a toy addition
task (held-out loss falls), the export is a Hugging Face folder, and a run resumed mid-epoch from a
checkpoint ends with exactly the weights of the uninterrupted run."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightrft.cli.train_sft import parse_args
from lightrft.datasets import SFTDataset
from lightrft.datasets.toy import arithmetic_splits, write_jsonl
from lightrft.utils.tiny import save_tiny_model
from tests.conftest import run_torchrun

pytestmark = pytest.mark.dist


def held_out_loss(model_dir, eval_file) -> float:
    """Token-mean NLL of the response tokens of `eval_file` under the model in `model_dir`, in one
    plain process (no DeepSpeed): the number the run's eval/loss must match."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    dataset = SFTDataset(eval_file, tokenizer, max_len=16)
    batch = dataset.collate_fn(list(dataset))
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    log_probs = logits[:, :-1].log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    return (-(log_probs * batch.loss_mask).sum() / batch.loss_mask.sum()).item()


def summary(proc) -> dict:
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_sft")
    base = save_tiny_model(root / "base", seed=0)
    train_rows, eval_rows = arithmetic_splits(n_train=160, n_eval=40, seed=0)
    train_file, eval_file = write_jsonl(train_rows, root / "train.jsonl"), write_jsonl(eval_rows, root / "eval.jsonl")

    def flags(save, ckpt):
        # 160 rows / 32 per step = 5 steps per epoch, 10 in all; 2 ranks x micro 8 x GAS 2.
        return ["-m", "lightrft.cli.train_sft", "--pretrain", base, "--dataset", train_file,
                "--eval_dataset", eval_file, "--input_key", "input", "--output_key", "output", "--max_len", 16,
                "--packing_samples", "--zero_stage", 2, "--max_epochs", 2, "--train_batch_size", 32,
                "--micro_train_batch_size", 8, "--learning_rate", 5e-3, "--lr_warmup_ratio", 0, "--seed", 1,
                "--save_path", save, "--ckpt_path", ckpt, "--save_steps", 3, "--max_ckpt_num", 3]

    full = run_torchrun([*flags(root / "model", root / "ckpt"), "--use_tensorboard", root / "tb"])
    # Resume from step 6 (one step into the second epoch), as if the run had died after saving it.
    shutil.copytree(root / "ckpt", root / "ckpt_resume")
    for later in ("global_step9", "global_step10"):
        shutil.rmtree(root / "ckpt_resume" / later)
    resumed = run_torchrun([*flags(root / "model_resumed", root / "ckpt_resume"), "--load_checkpoint"])
    return {"root": root, "base": base, "eval_file": eval_file, "full": full, "resumed": resumed}


def test_held_out_loss_falls_and_matches_the_reported_eval_loss(runs):
    before = held_out_loss(runs["base"], runs["eval_file"])
    after = held_out_loss(runs["root"] / "model", runs["eval_file"])
    assert after < 0.75 * before, (before, after)
    reported = summary(runs["full"])
    assert reported["step"] == 10 and reported["stop_reason"] == "finished"
    assert reported["eval/loss"] == pytest.approx(after, abs=1e-4)


def test_checkpoints_are_rotated_and_metrics_logged(runs):
    root = runs["root"]
    assert sorted(p.name for p in (root / "ckpt").glob("global_step*")) == ["global_step10", "global_step6",
                                                                            "global_step9"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "tb"))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert len(losses) == 10 and losses[-1] < losses[0]
    assert [e.step for e in events.Scalars("eval/loss")] == [10]


def test_resumed_run_ends_with_the_same_weights(runs):
    assert "resumed from" in runs["resumed"].stdout and "step 6, 192 samples consumed" in runs["resumed"].stdout
    assert summary(runs["resumed"])["step"] == 10
    full = load_file(runs["root"] / "model" / "model.safetensors")
    resumed = load_file(runs["root"] / "model_resumed" / "model.safetensors")
    assert full.keys() == resumed.keys()
    for name in full:
        torch.testing.assert_close(resumed[name], full[name], rtol=0, atol=1e-6, msg=name)


def test_flag_errors(capsys):
    base = ["--pretrain", "m", "--dataset", "d.jsonl"]
    for extra, message in ((["--multiturn"], "--multiturn needs --apply_chat_template"),
                           (["--eval_split", "0.1", "--eval_dataset", "e.jsonl"],
                            "pass either --eval_dataset or --eval_split, not both"),
                           (["--max_len", "0"], "--max_len must be positive, got 0"),
                           # Before: parsed, then KeyError: 'x' on the first row.
                           (["--input_template", "Q: {} {x}"], "--input_template 'Q: {} {x}' has a named field {x}"),
                           (["--input_template", "Q: {} A: {}"], "--input_template 'Q: {} A: {}' has 2 placeholders"),
                           (["--lr_warmup_ratio", "nan"], "--lr_warmup_ratio must be a finite number, got nan"),
                           (["--learning_rate", "nan"], "--learning_rate must be positive, got nan")):
        with pytest.raises(SystemExit):
            parse_args([*base, *extra])
        assert message in capsys.readouterr().err
    args = parse_args([*base, "--multiturn", "--apply_chat_template", "--eval_split", "0.1"])
    assert (args.multiturn, args.eval_split, args.output_key) == (True, 0.1, "output")


def test_a_missing_eval_dataset_names_its_own_flag(tmp_path):
    # Before: the error said "--dataset <eval path>", the flag of the training rows.
    from lightrft.cli.train_sft import build_datasets
    from lightrft.utils.tiny import build_char_tokenizer

    train = tmp_path / "train.jsonl"
    write_jsonl([{"input": "1+1=", "output": "2"}], train)
    missing = tmp_path / "nope.jsonl"
    args = parse_args(["--pretrain", "m", "--dataset", str(train), "--eval_dataset", str(missing)])
    with pytest.raises(FileNotFoundError, match=rf"^--eval_dataset {missing}: no such file"):
        build_datasets(args, build_char_tokenizer())


def test_a_missing_model_folder_is_named_with_its_flag_not_a_hub_download(tmp_path):
    """The tokenizer is the first thing loaded from --pretrain: a folder name that does not exist
    (and is no org/name Hub id) is named with its flag, instead of a Hub download traceback."""
    from lightrft.models.tokenizer import build_tokenizer

    with pytest.raises(FileNotFoundError, match="^--pretrain 'my_model': no such model folder"):
        build_tokenizer("my_model")
    with pytest.raises(FileNotFoundError, match="^--teacher_pretrain 'my_model'"):
        build_tokenizer("my_model", flag="--teacher_pretrain")
