"""Row validation: every bad row is reported with its file, row index and field.

A dataset builder runs each row through `process_rows`. A row that fails raises `DatasetRowError`;
with `on_bad_row="error"` (the default) that stops the run, with `"skip"` the row is dropped and
counted in a `SkipReport`, whose summary is logged (on rank 0) once per dataset.
"""

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, TypeVar

from lightrft.utils.distributed import is_rank_0

logger = logging.getLogger(__name__)

ON_BAD_ROW = ("error", "skip")
FIELD_KINDS = ("text", "messages", "text_or_messages", "number", "any")

T = TypeVar("T")


class DatasetRowError(ValueError):
    """A row of a dataset that cannot be used. The message names the file (or source), the 0-based
    row index and the field, then the problem and the fix."""

    def __init__(self, source: str, row: int, field: str, reason: str, hint: str | None = None,
                 kind: str = "invalid"):
        self.source = source
        self.row = row
        self.field = field
        self.reason = reason
        self.kind = kind  # short category for skip summaries: missing, empty, wrong type, over-long ...
        message = f"{source}: row {row}, field {field!r}: {reason}"
        if hint:
            message += f"; {hint}"
        super().__init__(message)


@dataclass
class SkipReport:
    """What `process_rows` dropped in skip mode: one `DatasetRowError` per skipped row."""

    source: str
    total: int = 0
    errors: list[DatasetRowError] = field(default_factory=list)

    @property
    def skipped(self) -> int:
        return len(self.errors)

    def summary(self) -> str:
        """One line: how many rows were skipped and why, grouped by field and reason."""
        if not self.errors:
            return f"{self.source}: all {self.total} rows are valid"
        # 'input[1].content' counts under 'input', so nested message problems group together.
        counts = Counter((e.field.split("[")[0], e.kind) for e in self.errors)
        parts = [f"{n} x {f!r} {kind}" for (f, kind), n in counts.most_common()]
        rows = ", ".join(str(e.row) for e in self.errors[:10]) + (" ..." if self.skipped > 10 else "")
        return (f"{self.source}: skipped {self.skipped} of {self.total} rows (--on_bad_row skip): "
                f"{'; '.join(parts)}; rows {rows}")


def check_on_bad_row(on_bad_row: str) -> None:
    if on_bad_row not in ON_BAD_ROW:
        raise ValueError(f"--on_bad_row must be one of {list(ON_BAD_ROW)}, got {on_bad_row!r}")


def process_rows(rows: Iterable[Any], fn: Callable[[int, Any], T], source: str,
                 on_bad_row: str = "error") -> tuple[list[T], list[int], SkipReport]:
    """Applies `fn(row_index, row)` to every row. A `DatasetRowError` from `fn` is raised
    (`on_bad_row="error"`) or recorded and the row dropped (`"skip"`).

    Returns (outputs of the kept rows, their row indices, the skip report)."""
    check_on_bad_row(on_bad_row)
    outputs, kept = [], []
    report = SkipReport(source)
    for index, row in enumerate(rows):
        report.total += 1
        try:
            outputs.append(fn(index, row))
        except DatasetRowError as error:
            if on_bad_row == "error":
                raise
            report.errors.append(error)
            continue
        kept.append(index)
    if report.skipped and is_rank_0():  # every rank builds the dataset; one summary is enough
        logger.warning(report.summary())
    if not outputs:
        raise ValueError(f"{source}: no usable rows ({report.skipped} of {report.total} were skipped); first "
                         f"problem: {report.errors[0] if report.errors else 'the dataset is empty'}")
    return outputs, kept, report


def check_field(row: Any, key: str, kind: str, source: str, index: int) -> Any:
    """Returns `row[key]` if it has the expected kind, else raises `DatasetRowError`.

    Kinds: "text" (a non-blank string), "messages" (a non-empty list of {"role", "content"} dicts
    with string values), "text_or_messages", "number" (a finite int/float, or a numeric string as CSV
    gives; returned as float), "any" (present and not null)."""
    if kind not in FIELD_KINDS:
        raise ValueError(f"unknown field kind {kind!r}; choose one of {list(FIELD_KINDS)}")
    if not isinstance(row, Mapping):
        raise DatasetRowError(source, index, key, f"the row is a {type(row).__name__}, not an object with fields",
                              "every row must be a JSON object / table record", kind="not an object")
    if key not in row:
        present = ", ".join(repr(k) for k in list(row)[:8])
        raise DatasetRowError(source, index, key, f"missing (the row has {present or 'no fields'})",
                              "add the field, or point the key flag at the field that holds it", kind="missing")
    value = row[key]
    if value is None:
        raise DatasetRowError(source, index, key, "is null", "give it a value or drop the row", kind="null")
    if kind == "text" or (kind == "text_or_messages" and not isinstance(value, list)):
        if not isinstance(value, str):
            expected = "a string" if kind == "text" else "a string or a list of chat messages"
            raise DatasetRowError(source, index, key, f"expected {expected}, got {_describe(value)}",
                                  kind="wrong type")
        if not value.strip():
            raise DatasetRowError(source, index, key, "is empty", "give it text or drop the row", kind="empty")
    elif kind in ("messages", "text_or_messages"):
        check_messages(value, key, source, index)
    elif kind == "number":
        try:
            number = float(value) if not isinstance(value, bool) else None
        except (TypeError, ValueError):
            number = None
        if number is None:
            raise DatasetRowError(source, index, key, f"expected a number, got {_describe(value)}",
                                  kind="wrong type")
        if not math.isfinite(number):
            raise DatasetRowError(source, index, key, f"expected a finite number, got {_describe(value)}",
                                  "give it a finite value or drop the row", kind="not finite")
        value = number
    return value


def check_messages(value: Any, key: str, source: str, index: int) -> list[dict]:
    """Checks a chat conversation: a non-empty list of {"role": str, "content": str} objects."""
    if not isinstance(value, list):
        raise DatasetRowError(source, index, key, f"expected a list of chat messages, got {_describe(value)}",
                              kind="wrong type")
    if not value:
        raise DatasetRowError(source, index, key, "is an empty list of chat messages", kind="empty")
    for i, message in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(message, Mapping):
            raise DatasetRowError(source, index, where, "a chat message must be an object with 'role' and "
                                  f"'content', got {_describe(message)}", kind="bad chat message")
        for part in ("role", "content"):
            if part not in message:
                raise DatasetRowError(source, index, f"{where}.{part}", "missing from the chat message",
                                      "each message needs 'role' and 'content'", kind="bad chat message")
            if not isinstance(message[part], str):
                raise DatasetRowError(source, index, f"{where}.{part}",
                                      f"expected a string, got {_describe(message[part])}", kind="bad chat message")
        if not message["role"].strip():
            raise DatasetRowError(source, index, f"{where}.role", "is empty", kind="bad chat message")
    return value


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def validate_rows(rows: Iterable[Any], required: Mapping[str, str], source: str,
                  on_bad_row: str = "error") -> tuple[list[Any], SkipReport]:
    """Checks that every row has each `required` field with its kind (see `check_field`).

    Returns (the valid rows, the skip report); raises on the first bad row in error mode."""
    def check(index, row):
        for key, kind in required.items():
            check_field(row, key, kind, source, index)
        return row

    valid, _, report = process_rows(rows, check, source, on_bad_row)
    return valid, report
