"""What lightrft prints or serves as JSON parses in strict parsers: a NaN or infinite metric (a
diverged loss, a log-prob of -inf) is written as null, never as the bare words NaN / Infinity."""

import json
import math

from lightrft.cli.common import print_summary
from lightrft.doctor.report import CheckResult, DoctorReport
from lightrft.utils.json_out import dumps, finite


def strict_loads(text: str):
    def refuse(word):
        raise ValueError(f"not JSON: {word}")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_floats_become_null_at_any_depth():
    value = {"loss": math.nan, "r": [1.5, math.inf, (-math.inf, 2)], "n": {"deep": [{"x": math.nan}]}, "ok": 3}
    assert finite(value) == {"loss": None, "r": [1.5, None, [None, 2]], "n": {"deep": [{"x": None}]}, "ok": 3}
    assert strict_loads(dumps(value)) == finite(value)
    assert json.dumps(value).count("NaN") == 2          # what plain json.dumps writes


class Rank0:
    @staticmethod
    def is_rank_0():
        return True


def test_the_closing_summary_line_parses_strictly_with_a_nan_metric(capsys, tmp_path):
    print_summary(Rank0(), "nonfinite", 7, str(tmp_path), {"train/policy_loss": math.nan, "rollout/reward": 0.25})
    summary = strict_loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["train/policy_loss"] is None and summary["rollout/reward"] == 0.25 and summary["step"] == 7


def test_the_doctor_report_parses_strictly_and_holds_no_secret():
    check = CheckResult("memory", "peak memory", rows=[("peak GiB", "nan")], figures={"peak_gib": math.inf})
    report = DoctorReport([check], config={"use_wandb": "SECRETKEY123", "remote_rm_url": "http://u:pw1@h/x"})
    text = report.to_json()
    data = strict_loads(text)
    assert data["checks"][0]["figures"]["peak_gib"] is None
    assert "SECRETKEY123" not in text and "pw1" not in text
