"""Reading dataset rows from local files and saved `datasets` folders.

Every loader returns a plain `list[dict]` in file order, so row `i` of an error message is the
`i`-th record of the file (0-based; for JSON lines files, blank lines are not rows). Nothing is
downloaded: a path that does not exist is an error naming the path and the flag it came from.
"""

import csv
import io
import json
from pathlib import Path
from typing import Sequence

from lightrft.datasets.validation import DatasetRowError

SUPPORTED_FORMATS = (".jsonl", ".json", ".parquet", ".csv", "a folder written by datasets' save_to_disk")


def load_rows(path: str | Path, flag: str = "--dataset", split: str | None = None) -> list[dict]:
    """Loads every row of a .jsonl/.json/.parquet/.csv file or a saved `datasets` folder.

    `flag` names the command-line flag the path came from, for error messages. `split` picks a split
    of a saved `DatasetDict` folder (default "train" when it has one, or its only split)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{flag} {path}: no such file or folder (relative paths are resolved from "
                                f"{Path.cwd()}); pass an existing .jsonl/.json/.parquet/.csv file or a "
                                "folder written by datasets' save_to_disk")
    if path.is_dir():
        rows = _load_saved_dataset(path, flag, split)
    else:
        suffix = path.suffix.lower()
        readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet, ".csv": _read_csv}
        if suffix not in readers:
            raise ValueError(f"{flag} {path}: unsupported format {suffix or '(no extension)'!r}; supported: "
                             + ", ".join(SUPPORTED_FORMATS))
        try:
            rows = readers[suffix](path)
        except UnicodeDecodeError as err:
            raise ValueError(f"{flag} {path}: {_decode_error_position(err)}: byte 0x{err.object[err.start]:02x} is "
                             "not UTF-8 text; re-save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)") from None
    if not rows:
        raise ValueError(f"{flag} {path}: the dataset has no rows")
    return rows


def resolve_rows(rows_or_path: str | Path | Sequence[dict], source_name: str | None = None,
                 max_samples: int | None = None, flag: str = "--dataset") -> tuple[Sequence[dict], str]:
    """The rows of a dataset argument (a path for `load_rows`, read as the value of `flag`, or rows
    already in memory: a list of dicts or a `datasets.Dataset`) and the source name used in error
    messages, cut to the first `max_samples` rows when given."""
    if max_samples is not None and max_samples <= 0:
        raise ValueError(f"--max_samples must be positive, got {max_samples}")
    if isinstance(rows_or_path, (str, Path)):
        rows, source = load_rows(rows_or_path, flag), source_name or str(rows_or_path)
    else:
        # list() also turns a `datasets.Dataset` into its rows (slicing one would give columns).
        rows, source = list(rows_or_path), source_name or "<rows>"
    return (rows if max_samples is None else rows[:max_samples]), source


def _decode_error_position(err: UnicodeDecodeError) -> str:
    """'line L, column C' (1-based, C in characters) of the byte a UTF-8 decoding failed at, in the
    bytes it decoded (`_read_text` decodes a whole file)."""
    data = err.object
    line = data.count(b"\n", 0, err.start) + 1
    line_start = data.rfind(b"\n", 0, err.start) + 1
    column = len(data[line_start:err.start].decode("utf-8", errors="replace")) + 1
    return f"line {line}, column {column}"


def _read_text(path: Path) -> str:
    """The file decoded as UTF-8 in one piece, so a decoding error's offset is from its start."""
    return path.read_bytes().decode("utf-8")


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    # Universal newlines as a text-mode file reads them, on text decoded in one piece.
    with io.StringIO(_read_text(path), newline=None) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DatasetRowError(str(path), len(rows), "<json>",
                                      f"line {line_no} is not valid JSON ({e.msg} at column {e.colno})",
                                      "fix or delete that line", kind="bad JSON") from None
            except (ValueError, RecursionError) as e:
                raise DatasetRowError(str(path), len(rows), "<json>", f"line {line_no} cannot be read: "
                                      f"{_unreadable_json(e)}", "fix or delete that line", kind="bad JSON") from None
    return rows


def _unreadable_json(err: Exception) -> str:
    """What makes valid-looking JSON unreadable: nesting past Python's recursion limit, or an
    integer longer than Python converts (4,300 digits by default)."""
    if isinstance(err, RecursionError):
        return "its values are nested too deep to read"
    return f"it holds a number Python will not convert ({err})"


def _read_json(path: Path) -> list[dict]:
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":
            # One object per line saved under a .json name: read it as JSON lines.
            return _read_jsonl(path)
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: cannot be read: {_unreadable_json(e)}") from None
    if isinstance(data, dict):
        raise ValueError(f"{path}: the top level is an object with keys {sorted(data)[:5]}; a .json dataset "
                         "must be a list of row objects (or one object per line)")
    if not isinstance(data, list):
        raise ValueError(f"{path}: the top level is a {type(data).__name__}; a .json dataset must be a list "
                         "of row objects")
    return data


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _read_csv(path: Path) -> list[dict]:
    with io.StringIO(_read_text(path), newline="") as f:
        return list(csv.DictReader(f))


def _load_saved_dataset(path: Path, flag: str, split: str | None) -> list[dict]:
    if not ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        raise ValueError(f"{flag} {path}: a folder, but not one written by datasets' save_to_disk (it has no "
                         "dataset_dict.json or state.json); pass a data file or a saved dataset folder")
    import datasets as hf_datasets      # half a second to import; only saved folders need it

    try:
        loaded = hf_datasets.load_from_disk(str(path))
    except Exception as err:  # datasets raises many types for a damaged folder; all are this user error
        metadata = next((name for name in ("dataset_dict.json", "state.json", "dataset_info.json")
                         if (path / name).exists()), "its metadata")
        raise ValueError(f"{flag} {path}: the saved dataset cannot be loaded ({type(err).__name__}: "
                         f"{str(err)[:200]}); check {path / metadata} and the files it lists, or save the "
                         "dataset again with save_to_disk") from None
    if isinstance(loaded, hf_datasets.DatasetDict):
        names = sorted(loaded)
        if split is None:
            split = "train" if "train" in loaded else (names[0] if len(names) == 1 else None)
        if split not in loaded:
            raise ValueError(f"{flag} {path}: the saved dataset has splits {names}; choose one of them "
                             f"(asked for {split!r})")
        loaded = loaded[split]
    elif split is not None and split != "train":
        raise ValueError(f"{flag} {path}: a single saved dataset has no split {split!r}; drop the split")
    return loaded.to_list()
