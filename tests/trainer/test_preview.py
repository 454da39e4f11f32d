"""Rollout preview: the table of samples a PPO run logs every --preview_steps steps, read back from
TensorBoard's event file (and W&B's offline run folder), checked against the run's own reward."""

import html
import json
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightrft.trainer.preview import PREVIEW_COLUMNS, RolloutPreview
from lightrft.utils.trackers import MetricsTracker, markdown_table
from tests.trainer import ppo_harness


def parse_markdown_table(text: str) -> tuple[list[str], list[list[str]]]:
    """Inverse of `markdown_table`: cells split on unescaped pipes, then unescaped."""
    def cells(line: str) -> list[str]:
        raw = re.split(r"(?<!\\)\|", line.strip()[1:-1])
        return [html.unescape(re.sub(r"\\(.)", r"\1", c.strip().replace("<br>", "\n"))) for c in raw]

    lines = text.split("\n")
    return cells(lines[0]), [cells(line) for line in lines[2:]]


def tensorboard_texts(folder: Path, tag: str) -> list[tuple[int, str]]:
    events = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    events.Reload()
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(f"{tag}/text_summary")]


def digit_share(response: str) -> float:
    """The harness's reward file: the share of digits in the response."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def test_markdown_table_keeps_any_text_in_its_cell():
    rows = [["a|b\nc", 0.25, "<s>\\x"], ["", -1.0, "plain"]]
    table = markdown_table(["x", "y", "z"], rows)
    assert len(table.split("\n")) == 4             # header, rule, one line per row
    columns, parsed = parse_markdown_table(table)
    assert columns == ["x", "y", "z"]
    assert parsed == [["a|b\nc", "0.25", "<s>\\x"], ["", "-1", "plain"]]


def test_log_table_writes_wandb_table_and_tensorboard_text(tmp_path):
    tracker = MetricsTracker(is_rank_0=True, config={"lr": 0.1}, use_wandb="offline", wandb_project="preview-test",
                             wandb_dir=str(tmp_path / "wandb"), use_tensorboard=str(tmp_path / "tb"))
    rows = [[3, "1+1=", "2", 1.0, 2, 1], [3, "2+2=", "5|x", 0.0, 3, 0]]
    tracker.log_table("rollout/preview", PREVIEW_COLUMNS, rows, step=3)
    run_dir = Path(tracker.wandb_run_dir)
    tracker.close()
    tables = list(run_dir.glob("media/table/rollout/preview_*.table.json"))
    assert len(tables) == 1
    saved = json.loads(tables[0].read_text())
    assert saved["columns"] == list(PREVIEW_COLUMNS)
    assert saved["data"] == rows
    [(step, text)] = tensorboard_texts(tmp_path / "tb", "rollout/preview")
    assert step == 3
    columns, parsed = parse_markdown_table(text)
    assert columns == list(PREVIEW_COLUMNS)
    assert parsed == [[str(v) if not isinstance(v, float) else f"{v:g}" for v in r] for r in rows]


def test_preview_rejects_a_non_positive_interval():
    with pytest.raises(ValueError, match="--preview_steps"):
        RolloutPreview(every=0)


def test_train_ppo_preview_table_in_tensorboard(tmp_path):
    """Three GRPO steps with --preview_steps 2: one table, at step 2, whose rows are rollout
    samples of that step: prompts from the data, the reward the reward file gives the response,
    the policy version of the weights (step 1) and staleness 0 (synchronous)."""
    task = ppo_harness.make_task(tmp_path)
    tb = tmp_path / "tb"
    ppo_harness.run(task, tmp_path / "out", preview_steps=2, use_tensorboard=tb, max_steps=3)
    texts = tensorboard_texts(tb, "rollout/preview")
    assert [step for step, _ in texts] == [2]
    columns, rows = parse_markdown_table(texts[0][1])
    assert columns == list(PREVIEW_COLUMNS)
    assert len(rows) == 4
    prompts = {json.loads(line)["input"] for line in Path(task["train"]).read_text().splitlines()}
    for step, prompt, response, reward, version, staleness in rows:
        assert (int(step), int(version), int(staleness)) == (2, 1, 0)
        assert prompt in prompts
        assert float(reward) == pytest.approx(digit_share(response), abs=1e-5)
    # Four samples of one prompt (G = 4): the same prompt, responses drawn from different streams.
    assert len({r[1] for r in rows}) == 1
    assert len({r[2] for r in rows}) > 1
