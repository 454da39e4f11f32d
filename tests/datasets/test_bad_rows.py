"""The corpus in bad_rows/: each file holds one kind of bad row; cases.json says where it is and what
the error must say. Error mode stops at it naming file, row and field; skip mode drops and counts."""

import json
from pathlib import Path

import pytest

from lightrft.datasets import DatasetRowError, PreferenceDataset, PromptDataset, SFTDataset
from lightrft.utils.tiny import build_char_tokenizer

CORPUS = Path(__file__).parent / "bad_rows"
CASES = json.loads((CORPUS / "cases.json").read_text())
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role ' + m['role']) }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
DATASETS = {"prompt": PromptDataset, "sft": SFTDataset, "preference": PreferenceDataset}


@pytest.fixture(scope="module")
def tokenizers():
    strict = build_char_tokenizer()
    strict.chat_template = STRICT_TEMPLATE
    return {"default": build_char_tokenizer(), "strict": strict}


def build(case, tokenizers, on_bad_row):
    tokenizer = tokenizers[case.get("template", "default")]
    return DATASETS[case["dataset"]](CORPUS / case["file"], tokenizer, on_bad_row=on_bad_row, **case["options"])


def test_corpus_covers_every_file():
    files = {p.name for p in CORPUS.iterdir() if p.name != "cases.json"}
    assert files == {case["file"] for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=[c["file"] for c in CASES])
def test_error_names_file_row_and_field(case, tokenizers):
    with pytest.raises(DatasetRowError) as info:
        build(case, tokenizers, "error")
    error = info.value
    assert (error.row, error.field) == (case["row"], case["field"])
    message = str(error)
    assert message.startswith(f"{CORPUS / case['file']}: row {case['row']}, field '{case['field']}': ")
    assert case["message"] in message


@pytest.mark.parametrize("case", [c for c in CASES if c["skipped"] is not None],
                         ids=[c["file"] for c in CASES if c["skipped"] is not None])
def test_skip_mode_counts_and_keeps_the_rest(case, tokenizers):
    dataset = build(case, tokenizers, "skip")
    assert dataset.skipped == case["skipped"]
    assert len(dataset) == case["kept"]
    assert dataset.skip_report.total == case["skipped"] + case["kept"]
    assert case["row"] in [e.row for e in dataset.skip_report.errors]
    assert case["row"] not in dataset.row_indices
    summary = dataset.skip_report.summary()
    assert f"skipped {case['skipped']} of {case['skipped'] + case['kept']} rows" in summary


def test_load_errors_are_not_skippable(tokenizers):
    # A corrupt JSON line is a broken file, not a bad row: skip mode still stops on it.
    with pytest.raises(DatasetRowError, match="line 4 is not valid JSON"):
        PromptDataset(CORPUS / "broken_json.jsonl", tokenizers["default"], on_bad_row="skip")


def test_skip_summary_groups_reasons(tokenizers):
    dataset = PromptDataset(CORPUS / "bad_chat_messages.jsonl", tokenizers["default"], apply_chat_template=True,
                            on_bad_row="skip")
    # Rows 1-4 are bad: a message without content, a message that is a string, an empty list, and
    # non-string content.
    assert [e.row for e in dataset.skip_report.errors] == [1, 2, 3, 4]
    assert [e.field for e in dataset.skip_report.errors] == ["input[1].content", "input[0]", "input", "input[0].content"]
    assert dataset.skip_report.summary() == (
        f"{CORPUS / 'bad_chat_messages.jsonl'}: skipped 4 of 5 rows (--on_bad_row skip): "
        "3 x 'input' bad chat message; 1 x 'input' empty; rows 1, 2, 3, 4")


def test_unknown_on_bad_row_value(tokenizers):
    with pytest.raises(ValueError, match=r"--on_bad_row must be one of \['error', 'skip'\], got 'ignore'"):
        PromptDataset([{"input": "x"}], tokenizers["default"], on_bad_row="ignore")


def test_all_rows_bad_is_an_error(tokenizers):
    with pytest.raises(ValueError, match=r"<rows>: no usable rows \(2 of 2 were skipped\)"):
        PromptDataset([{"q": "x"}, {"q": "y"}], tokenizers["default"], on_bad_row="skip")


def test_source_name_replaces_rows_placeholder(tokenizers):
    with pytest.raises(DatasetRowError, match=r"^my_prompts: row 0, field 'input': is empty"):
        PromptDataset([{"input": ""}], tokenizers["default"], source_name="my_prompts")


def test_truncate_long_prompts_keeps_the_last_tokens(tokenizers):
    dataset = PromptDataset(CORPUS / "over_long.jsonl", tokenizers["default"], prompt_max_len=20,
                            truncate_long_prompts=True)
    # Char-level tokens, so the prompt keeps its last 20 characters.
    long_prompt = "this prompt is much longer than twenty characters"
    assert [p.text for p, _ in dataset] == ["short prompt", long_prompt[-20:], "tiny"]
    assert dataset.skipped == 0
    # The kept ids are the encoded prompt's last 20, as encoded once (not its text encoded again).
    whole = tokenizers["default"](long_prompt)["input_ids"]
    assert dataset[1][0].token_ids == tuple(whole[-20:]) and len(whole) > 20


def test_chat_template_missing_is_a_config_error(tokenizers):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="--apply_chat_template is set but the tokenizer .* has no chat template"):
        PromptDataset([{"input": "x"}], tokenizer, apply_chat_template=True)


def test_messages_without_chat_template_are_a_row_error(tokenizers):
    rows = [{"input": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(DatasetRowError, match=r"row 0, field 'input': expected a string, got list"):
        PromptDataset(rows, tokenizers["default"])


def test_skip_summary_is_logged_once(tokenizers, caplog):
    with caplog.at_level("WARNING", logger="lightrft.datasets.validation"):
        dataset = PromptDataset(CORPUS / "empty_prompt.jsonl", tokenizers["default"], on_bad_row="skip")
    assert [r.getMessage() for r in caplog.records] == [dataset.skip_report.summary()]
    assert "skipped 1 of 4 rows (--on_bad_row skip): 1 x 'input' empty; rows 2" in caplog.records[0].getMessage()
