"""Data check: rows read and rejected (with reasons), prompt lengths, and the share that
`--prompt_max_len` cuts (`--truncate_long_prompts`) or rejects.

Reads every row with the run's own dataset code (`PromptDataset`, skip mode, no length limit), so
a row is rejected here exactly when the run would reject it, and measures each prompt by the ids
the dataset encoded it to (those rollouts take)."""

from collections import Counter

from lightrft.config.run import PPORunConfig
from lightrft.config.sections import PPODataConfig
from lightrft.datasets import PromptDataset
from lightrft.doctor.report import CheckResult, percentile

NO_LIMIT = 2**62


def dataset_figures(path: str, flag: str, tokenizer, data: PPODataConfig) -> dict:
    """Rows read, rows rejected by field checks with reasons, and prompt token lengths."""
    dataset = PromptDataset(path, tokenizer, input_key=data.input_key, label_key=data.label_key,
                            apply_chat_template=data.apply_chat_template, prompt_max_len=NO_LIMIT,
                            on_bad_row="skip", max_samples=data.max_samples)
    report = dataset.skip_report
    lengths = [len(ids) for ids in dataset.token_ids()]
    over = [row for row, n in zip(dataset.row_indices, lengths) if n > data.prompt_max_len]
    reasons = Counter(f"{e.field.split('[')[0]!r} {e.kind}" for e in report.errors)
    return {"flag": flag, "path": str(path), "rows": report.total, "rejected": report.skipped,
            "reasons": dict(reasons.most_common()), "first_error": str(report.errors[0]) if report.errors else None,
            "over_long": len(over), "over_long_rows": over[:10],
            "over_long_share": len(over) / max(len(lengths), 1),
            "usable": len(lengths) - (0 if data.truncate_long_prompts else len(over)),
            "p50": percentile(lengths, 50), "p90": percentile(lengths, 90), "p99": percentile(lengths, 99),
            "max": max(lengths, default=0)}


def check_data(config: PPORunConfig, tokenizer) -> CheckResult:
    data = config.data
    result = CheckResult("data", "rows read and rejected, prompt lengths in tokens, --prompt_max_len cuts")
    cut = "cut" if data.truncate_long_prompts else "rejected"
    result.rows.append(("data", "rows", "rejected", "usable", "p50", "p90", "p99", "max",
                        f"> {data.prompt_max_len} ({cut})"))
    sources = [("--prompt_data", data.prompt_data), ("--eval_data", data.eval_data)]
    for flag, path in [(f, p) for f, p in sources if p]:
        try:
            figures = dataset_figures(path, flag, tokenizer, data)
        except (ValueError, FileNotFoundError) as err:
            result.add("FAIL", f"{flag} {path}: {err}")
            continue
        result.figures[flag.lstrip("-")] = figures
        result.rows.append((flag, figures["rows"], figures["rejected"], figures["usable"],
                            *(f"{figures[k]:.0f}" for k in ("p50", "p90", "p99", "max")),
                            f"{figures['over_long']} ({figures['over_long_share']:.1%})"))
        judge_dataset(result, figures, data, config.rollout.rollout_batch_size)
    if not result.findings:
        result.add("PASS", "every row is usable and every prompt fits --prompt_max_len")
    return result


def judge_dataset(result: CheckResult, f: dict, data: PPODataConfig, rollout_batch_size: int) -> None:
    where = f"{f['flag']} {f['path']}"
    if f["rejected"]:
        reasons = "; ".join(f"{n} x {reason}" for reason, n in f["reasons"].items())
        if data.on_bad_row == "error":
            result.add("FAIL", f"{where}: {f['rejected']} of {f['rows']} rows are bad ({reasons}); the run stops at "
                               f"the first: {f['first_error']}")
        else:
            result.add("WARN", f"{where}: {f['rejected']} of {f['rows']} rows will be skipped ({reasons})")
    if f["over_long"]:
        rows = ", ".join(map(str, f["over_long_rows"])) + (" ..." if f["over_long"] > 10 else "")
        fix = f"--prompt_max_len {int(f['max'])} fits them all"
        if data.truncate_long_prompts:
            result.add("WARN", f"{where}: {f['over_long']} prompts ({f['over_long_share']:.1%}) are longer than "
                               f"--prompt_max_len {data.prompt_max_len} and lose their first tokens "
                               f"(--truncate_long_prompts; rows {rows}); {fix}")
        elif data.on_bad_row == "error":
            result.add("FAIL", f"{where}: {f['over_long']} prompts are longer than --prompt_max_len "
                               f"{data.prompt_max_len} (rows {rows}) and stop the run; {fix}, or keep their last "
                               "tokens with --truncate_long_prompts, or skip them with --on_bad_row skip")
        else:
            result.add("WARN", f"{where}: {f['over_long']} prompts ({f['over_long_share']:.1%}) are longer than "
                               f"--prompt_max_len {data.prompt_max_len} and will be skipped (rows {rows}); {fix}")
    if f["flag"] == "--prompt_data" and f["usable"] < rollout_batch_size:
        result.add("FAIL", f"{where}: {f['usable']} usable rows, fewer than --rollout_batch_size "
                           f"{rollout_batch_size}: not one rollout batch")
