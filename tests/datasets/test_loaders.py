"""load_rows on real files of every supported format."""

import json

import datasets as hf_datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightrft.datasets import DatasetRowError, load_rows

ROWS = [
    {"input": "What is 1+1?", "label": "2"},
    {"input": "Say \"hi\", please", "label": "hi"},
    {"input": "line one\nline two", "label": "x,y"},
]


def write(path, rows):
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows, indent=2))
    elif suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif suffix == ".csv":
        hf_datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
    return path


@pytest.mark.parametrize("name", ["data.jsonl", "data.json", "data.parquet", "data.csv"])
def test_each_file_format_round_trips(tmp_path, name):
    assert load_rows(write(tmp_path / name, ROWS)) == ROWS


def test_uppercase_extension_and_json_lines_under_json_name(tmp_path):
    path = tmp_path / "DATA.JSON"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert load_rows(path) == ROWS


def test_jsonl_blank_lines_are_not_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n   \n" + json.dumps(ROWS[1]) + "\n")
    assert load_rows(path) == ROWS[:2]


def test_saved_dataset_folder(tmp_path):
    hf_datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    assert load_rows(tmp_path / "single") == ROWS


def test_saved_dataset_dict_picks_train_or_the_named_split(tmp_path):
    folder = tmp_path / "dict"
    hf_datasets.DatasetDict({"train": hf_datasets.Dataset.from_list(ROWS[:2]),
                             "test": hf_datasets.Dataset.from_list(ROWS[2:])}).save_to_disk(str(folder))
    assert load_rows(folder) == ROWS[:2]
    assert load_rows(folder, split="test") == ROWS[2:]
    with pytest.raises(ValueError, match=r"has splits \['test', 'train'\]; choose one of them \(asked for 'dev'\)"):
        load_rows(folder, split="dev")


def test_missing_path_names_the_path_and_flag(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=rf"--eval_dataset {missing}: no such file or folder"):
        load_rows(missing, flag="--eval_dataset")


def test_unknown_extension_lists_the_supported_formats(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("hello")
    with pytest.raises(ValueError) as info:
        load_rows(path)
    message = str(info.value)
    assert f"--dataset {path}: unsupported format '.txt'" in message
    for fmt in (".jsonl", ".json", ".parquet", ".csv", "save_to_disk"):
        assert fmt in message


def test_plain_folder_is_not_a_dataset(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps(ROWS[0]))
    with pytest.raises(ValueError, match="not one written by datasets' save_to_disk"):
        load_rows(tmp_path)


def test_empty_file_and_wrong_json_shapes(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="the dataset has no rows"):
        load_rows(empty)
    obj = tmp_path / "obj.json"
    obj.write_text(json.dumps({"data": ROWS}))
    with pytest.raises(ValueError, match=r"top level is an object with keys \['data'\]"):
        load_rows(obj)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"input": "x"},')
    with pytest.raises(ValueError, match=r"broken.json: not valid JSON"):
        load_rows(broken)


def test_corrupt_jsonl_line_reports_row_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n{\"input\": oops}\n")
    with pytest.raises(DatasetRowError) as info:
        load_rows(path)
    assert (info.value.row, info.value.field) == (1, "<json>")
    assert "line 3 is not valid JSON" in str(info.value)


def test_in_memory_datasets_dataset_and_max_samples():
    from lightrft.datasets.loaders import resolve_rows

    rows, source = resolve_rows(hf_datasets.Dataset.from_list(ROWS), max_samples=2)
    assert (rows, source) == (ROWS[:2], "<rows>")


@pytest.mark.parametrize("name", ["data.jsonl", "data.json", "data.csv"])
def test_non_utf8_bytes_name_the_file_line_and_column(tmp_path, name):
    # Before: "'utf-8' codec can't decode byte 0xe9 in position 71", with no file or line.
    path = write(tmp_path / name, ROWS)
    text = path.read_bytes()
    at = text.index(b"line two")       # "line two" is on line 3 of every format written above
    line = text[:at].count(b"\n") + 1
    column = at - (text.rfind(b"\n", 0, at) + 1) + 1
    path.write_bytes(text[:at] + b"caf\xe9 " + text[at:])     # a Latin-1 e-acute
    with pytest.raises(ValueError) as info:
        load_rows(path, flag="--prompt_data")
    assert str(info.value).startswith(f"--prompt_data {path}: line {line}, column {column + 3}: byte 0xe9 is not "
                                      "UTF-8")
    assert "re-save the file as UTF-8" in str(info.value)


def test_missing_prompt_data_names_the_flag_train_ppo_takes(tmp_path):
    # Before: `train_ppo --prompt_data nope.jsonl` failed with "--dataset nope.jsonl: no such file".
    from lightrft.builders.datasets import build_prompt_dataset
    from lightrft.config import PPODataConfig

    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=rf"^--prompt_data {missing}: no such file or folder"):
        build_prompt_dataset(PPODataConfig(prompt_data=str(missing)), tokenizer=None)


def test_each_dataset_names_its_own_flag(tmp_path):
    from lightrft.datasets import PreferenceDataset, PromptDataset, SFTDataset
    from lightrft.utils.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for dataset, flag in ((PromptDataset, "--prompt_data"), (SFTDataset, "--dataset"),
                          (PreferenceDataset, "--dataset")):
        with pytest.raises(ValueError, match=rf"^{flag} {empty}: the dataset has no rows"):
            dataset(empty, tokenizer)
        with pytest.raises(ValueError, match=rf"^--eval_data {empty}: the dataset has no rows"):
            dataset(empty, tokenizer, flag="--eval_data")


@pytest.mark.parametrize("hostile, words", [("[" * 50_000 + "]" * 50_000, "nested too deep to read"),
                                            ('{"input": ' + "7" * 5000 + "}", "a number Python will not convert")])
def test_unreadable_json_names_the_file_and_line_in_both_formats(tmp_path, hostile, words):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(json.dumps(ROWS[0]) + "\n" + hostile + "\n")
    with pytest.raises(DatasetRowError, match=f"line 2 cannot be read: its values are|line 2 cannot be read: it holds"
                       ) as info:
        load_rows(jsonl)
    assert words in str(info.value) and str(jsonl) in str(info.value)
    single = tmp_path / "d.json"
    single.write_text("[" + hostile + "]")
    with pytest.raises(ValueError, match=f"{single}: cannot be read: .*{words}"):
        load_rows(single)


def test_a_damaged_saved_dataset_names_its_folder_and_metadata(tmp_path):
    folder = tmp_path / "dict"
    hf_datasets.DatasetDict({"train": hf_datasets.Dataset.from_list(ROWS)}).save_to_disk(str(folder))
    (folder / "dataset_dict.json").write_text('{"splits": ["train", "missing"]')       # cut short
    with pytest.raises(ValueError, match=f"--prompt_data {folder}: the saved dataset cannot be loaded .*check "
                                         f"{folder / 'dataset_dict.json'}"):
        load_rows(folder, flag="--prompt_data")
