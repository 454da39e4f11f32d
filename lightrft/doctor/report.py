"""What a doctor check returns and how the report prints.

A check gives a `CheckResult`: a small table of figures (printed), the same figures as numbers
(for the JSON copy and for tests), and findings, each PASS, WARN or FAIL with one line a person
can act on. The report's verdict is the worst finding; the exit code is 1 on any FAIL.
"""

import json
from dataclasses import asdict, dataclass, field

from lightrft.utils import json_out
from lightrft.utils.secrets import redact_options

LEVELS = ("PASS", "WARN", "FAIL")


@dataclass
class Finding:
    level: str      # PASS, WARN or FAIL
    text: str       # what was found and, for WARN/FAIL, what to change


@dataclass
class CheckResult:
    name: str                                                  # data, memory, invariance, engine, rewards
    title: str                                                 # one line: what the check does
    rows: list[tuple[str, ...]] = field(default_factory=list)  # the table, first row the header
    figures: dict = field(default_factory=dict)                # the numbers behind the table
    findings: list[Finding] = field(default_factory=list)

    def add(self, level: str, text: str) -> None:
        if level not in LEVELS:
            raise ValueError(f"finding level must be one of {LEVELS}, got {level!r}")
        self.findings.append(Finding(level, text))

    @property
    def status(self) -> str:
        """The worst finding (PASS when there is none)."""
        return max((f.level for f in self.findings), key=LEVELS.index, default="PASS")


@dataclass
class DoctorReport:
    checks: list[CheckResult]
    config: dict = field(default_factory=dict)   # the flags the run was checked with

    @property
    def verdict(self) -> str:
        return max((c.status for c in self.checks), key=LEVELS.index, default="PASS")

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict == "FAIL" else 0

    def check(self, name: str) -> CheckResult:
        for result in self.checks:
            if result.name == name:
                return result
        raise KeyError(f"no {name!r} check in this report; it has {[c.name for c in self.checks]}")

    def render(self) -> str:
        """The report as text: a table and PASS/WARN/FAIL lines per check, then the verdict."""
        lines = []
        for result in self.checks:
            lines += [f"== {result.name}: {result.title}  [{result.status}]"]
            lines += format_table(result.rows)
            lines += [f"{f.level}: {f.text}" for f in result.findings]
            lines.append("")
        failed = [c.name for c in self.checks if c.status == "FAIL"]
        warned = [c.name for c in self.checks if c.status == "WARN"]
        summary = f"verdict: {self.verdict}"
        if failed:
            summary += f" (failed: {', '.join(failed)})"
        if warned:
            summary += f" (warnings: {', '.join(warned)})"
        return "\n".join(lines + [summary])

    def to_json(self) -> str:
        return json_out.dumps({"verdict": self.verdict, "checks": [
            {**asdict(c), "status": c.status} for c in self.checks], "config": redact_options(self.config)},
            indent=2, default=str, sort_keys=False)


def format_table(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as aligned text columns, the first row a header underlined with dashes."""
    if not rows:
        return []
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells if i < len(row)) for i in range(max(len(r) for r in cells))]

    def line(row):
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    return [line(cells[0]), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between order statistics (numpy's
    default); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
