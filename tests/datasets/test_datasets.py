"""PromptDataset, SFTDataset and PreferenceDataset on the character tokenizer, where token i of a
text is character i, so expected ids and labels can be written out by hand."""

import json

import pytest
import torch
from torch.utils.data import DataLoader

from lightrft.datasets import (
    IGNORE_INDEX,
    PreferenceDataset,
    PromptDataset,
    SFTDataset,
    split_train_eval,
    validate_rows,
)
from lightrft.utils.distributed_sampler import DistributedSampler
from lightrft.utils.tiny import build_char_tokenizer

EOS = 2
PAD = 0


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ids(tok, text):
    return [tok.convert_tokens_to_ids(c) for c in text]


def trained_text(tok, sample):
    return tok.decode(sample.input_ids[sample.labels != IGNORE_INDEX])


# ---------------------------------------------------------------- SFT


def test_sft_pair_without_template_labels_only_the_response(tok):
    (sample,) = SFTDataset([{"input": "Q:", "output": "ab"}], tok)
    # "Q:" "ab" then EOS: 5 tokens; the two prompt tokens are ignored.
    assert sample.input_ids.tolist() == ids(tok, "Q:ab") + [EOS]
    assert sample.labels.tolist() == [IGNORE_INDEX, IGNORE_INDEX] + ids(tok, "ab") + [EOS]


def test_sft_input_template(tok):
    (sample,) = SFTDataset([{"q": "2+2", "a": "4"}], tok, input_key="q", output_key="a",
                           input_template="Question: {}\nAnswer: ")
    assert tok.decode(sample.input_ids) == "Question: 2+2\nAnswer: 4</s>"
    assert trained_text(tok, sample) == "4</s>"


def test_sft_pair_with_chat_template(tok):
    (sample,) = SFTDataset([{"input": "hi", "output": "yo"}], tok, apply_chat_template=True)
    # Template: "user: hi\nassistant: " is the prompt (20 chars); "yo\n" and EOS are trained.
    assert tok.decode(sample.input_ids) == "user: hi\nassistant: yo\n</s>"
    assert sample.labels[:20].eq(IGNORE_INDEX).all()
    assert sample.labels[20:].tolist() == ids(tok, "yo\n") + [EOS]


def test_sft_conversation_trains_every_assistant_turn(tok):
    row = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
                        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                        {"role": "assistant", "content": "a2"}]}
    (sample,) = SFTDataset([row], tok, input_key="messages", output_key=None, apply_chat_template=True)
    text = "system: S\nuser: q1\nassistant: a1\nuser: q2\nassistant: a2\n"
    assert tok.decode(sample.input_ids) == text + "</s>"
    trained = (sample.labels != IGNORE_INDEX).nonzero().flatten().tolist()
    first = text.index("a1")
    second = text.index("a2")
    assert trained == [first, first + 1, first + 2, second, second + 1, second + 2, len(text)]


def test_sft_output_messages_after_a_multi_turn_prompt(tok):
    row = {"input": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                     {"role": "user", "content": "q2"}],
           "output": [{"role": "assistant", "content": "a2"}]}
    (sample,) = SFTDataset([row], tok, apply_chat_template=True)
    # The earlier assistant turn is part of the prompt: only a2 is trained.
    assert trained_text(tok, sample) == "a2\n</s>"


def test_sft_does_not_double_eos_and_truncates_on_the_right(tok):
    (sample,) = SFTDataset([{"input": "Q:", "output": "ab</s>"}], tok)
    assert sample.input_ids.tolist() == ids(tok, "Q:ab") + [EOS]
    (cut,) = SFTDataset([{"input": "Q:", "output": "abcdefgh"}], tok, max_len=6)
    assert cut.input_ids.tolist() == ids(tok, "Q:abcd")
    assert cut.labels.tolist() == [IGNORE_INDEX] * 2 + ids(tok, "abcd")


def test_sft_padded_and_packed_batches_train_the_same_tokens(tok):
    rows = [{"input": "Q:", "output": "abc"}, {"input": "Longer:", "output": "x"}, {"input": "R", "output": "yz"}]
    dataset = SFTDataset(rows, tok)
    samples = [dataset[i] for i in range(3)]
    padded = dataset.collate_fn(samples)
    packed = dataset.packing_collate_fn(samples)
    lengths = [6, 9, 4]  # prompt + response + EOS
    assert padded.input_ids.shape == (3, 9) and padded.num_actions == 8
    assert padded.attention_mask.sum(1).tolist() == lengths
    assert padded.input_ids[0, 6:].eq(PAD).all() and padded.labels[0, 6:].eq(IGNORE_INDEX).all()
    assert packed.input_ids.shape == (1, 19) and packed.packed_seq_lens == lengths
    assert packed.num_actions == [5, 8, 3] and packed.loss_mask.shape == (3, 8)
    # Target tokens of the trained positions, read through each layout.
    padded_targets = padded.input_ids[:, 1:][padded.loss_mask].tolist()
    pieces = packed.input_ids[0].split(lengths)
    shifted = torch.stack([torch.nn.functional.pad(p[1:], (0, 8 - len(p) + 1)) for p in pieces])
    packed_targets = shifted[packed.loss_mask].tolist()
    assert padded_targets == packed_targets == ids(tok, "abc") + [EOS] + ids(tok, "x") + [EOS] + ids(tok, "yz") + [EOS]
    # The packed labels never cross a border: each sample's first token is unlabelled.
    starts = [0, 6, 15]
    assert packed.labels[0, starts].eq(IGNORE_INDEX).all()


def test_sft_conversation_needs_chat_template(tok):
    with pytest.raises(ValueError, match="no --output_key.* needs --apply_chat_template"):
        SFTDataset([{"input": "x"}], tok, output_key=None)


# ---------------------------------------------------------------- preference


def test_preference_pairs_with_prompt_key_and_margins(tok):
    rows = [{"p": "2+2=", "good": "4", "bad": "five", "m": 1.5}, {"p": "1+1=", "good": "2", "bad": "3", "m": "0.5"}]
    dataset = PreferenceDataset(rows, tok, prompt_key="p", chosen_key="good", rejected_key="bad", margin_key="m")
    assert dataset[0].chosen_ids.tolist() == ids(tok, "2+2=4") + [EOS]
    assert dataset[0].rejected_ids.tolist() == ids(tok, "2+2=five") + [EOS]
    batch = dataset.collate_fn([dataset[0], dataset[1]])
    # Both sides share the widest length, 9 ("2+2=five" + EOS).
    assert batch.chosen_ids.shape == batch.rejected_ids.shape == (2, 9)
    assert batch.chosen_mask.sum(1).tolist() == [6, 6] and batch.rejected_mask.sum(1).tolist() == [9, 6]
    assert batch.chosen_ids[0, 6:].eq(PAD).all()
    assert batch.margins.tolist() == [1.5, 0.5]


def test_preference_chat_template_forms(tok):
    prompted = PreferenceDataset([{"prompt": "hi", "chosen": "hello", "rejected": "go"}], tok, prompt_key="prompt",
                                 apply_chat_template=True)
    assert tok.decode(prompted[0].chosen_ids) == "user: hi\nassistant: hello\n</s>"
    conversation = [{"role": "user", "content": "hi"}]
    whole = PreferenceDataset([{"chosen": conversation + [{"role": "assistant", "content": "hello"}],
                                "rejected": conversation + [{"role": "assistant", "content": "go"}]}],
                              tok, apply_chat_template=True)
    assert whole[0].chosen_ids.tolist() == prompted[0].chosen_ids.tolist()
    assert tok.decode(whole[0].rejected_ids) == "user: hi\nassistant: go\n</s>"


def test_preference_over_long_side_is_a_bad_row(tok):
    rows = [{"chosen": "short", "rejected": "much too long"}, {"chosen": "ok", "rejected": "no"}]
    with pytest.raises(ValueError, match=r"row 0, field 'rejected': the text is 14 tokens with EOS, over --max_len 8"):
        PreferenceDataset(rows, tok, max_len=8)
    assert len(PreferenceDataset(rows, tok, max_len=8, on_bad_row="skip")) == 1


# ---------------------------------------------------------------- prompts


def test_prompt_items_and_collate(tok):
    rows = [{"q": "2+2", "answer": "4"}, {"q": "3+3", "answer": 6}]
    plain = PromptDataset(rows, tok, input_key="q", input_template="Q: {} A:")
    assert [(p.text, label) for p, label in plain] == [("Q: 2+2 A:", None), ("Q: 3+3 A:", None)]
    # Each prompt is encoded once, when the dataset is built, as rollouts encode raw text.
    assert [p.token_ids for p, _ in plain] == [tuple(tok("Q: 2+2 A:")["input_ids"]), tuple(tok("Q: 3+3 A:")["input_ids"])]
    labelled = PromptDataset(rows, tok, input_key="q", label_key="answer", apply_chat_template=True)
    prompt, label = labelled[1]
    assert (prompt.text, label) == ("user: 3+3\nassistant: ", 6)
    # templated text holds its special tokens: none added around it
    assert prompt.token_ids == tuple(tok("user: 3+3\nassistant: ", add_special_tokens=False)["input_ids"])
    loader = DataLoader(labelled, batch_size=2, collate_fn=PromptDataset.collate_fn)
    prompts, labels = next(iter(loader))
    assert [p.text for p in prompts] == ["user: 2+2\nassistant: ", "user: 3+3\nassistant: "] and labels == ["4", 6]
    assert prompts[1] == prompt and labelled.texts() == [p.text for p in prompts]


def test_prompt_message_list_keeps_system_prompt(tok):
    rows = [{"input": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}]
    ((prompt, label),) = PromptDataset(rows, tok, apply_chat_template=True)
    assert (prompt.text, label) == ("system: be brief\nuser: hi\nassistant: ", None)


def test_bad_input_template_is_rejected(tok):
    for dataset in (PromptDataset, SFTDataset):
        with pytest.raises(ValueError, match="--input_template 'Question:' has 0 placeholders"):
            dataset([{"input": "x", "output": "y"}], tok, input_template="Question:")
        # Before: KeyError('x') from str.format on the first row.
        with pytest.raises(ValueError, match="--input_template 'Q: {} {x}' has a named field {x}"):
            dataset([{"input": "x", "output": "y"}], tok, input_template="Q: {} {x}")


# ---------------------------------------------------------------- files, determinism, sampling, splits


def test_datasets_are_deterministic_and_shard_with_the_distributed_sampler(tmp_path, tok):
    path = tmp_path / "sft.jsonl"
    rows = [{"input": f"Q{i}:", "output": "a" * (i % 5 + 1)} for i in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second = SFTDataset(path, tok), SFTDataset(path, tok)
    assert all(torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
               for a, b in zip(first, second))
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(first, num_replicas=2, rank=rank, shuffle=True, seed=3)
        loader = DataLoader(first, batch_size=5, sampler=sampler, collate_fn=first.collate_fn)
        (batch,) = list(loader)
        # Each sample "Q<i>:" + response: the digit at position 1 identifies the row.
        seen += [int(tok.decode(row[1:2])) for row in batch.input_ids]
    assert sorted(seen) == list(range(10))


def test_split_train_eval_is_a_seeded_partition(tok):
    dataset = PromptDataset([{"input": str(i)} for i in range(20)], tok)
    train, evaluation = split_train_eval(dataset, 0.25, seed=1)
    assert (len(train), len(evaluation)) == (15, 5)
    assert sorted(train.indices + evaluation.indices) == list(range(20))
    again, _ = split_train_eval(dataset, 0.25, seed=1)
    other, _ = split_train_eval(dataset, 0.25, seed=2)
    assert again.indices == train.indices and other.indices != train.indices
    with pytest.raises(ValueError, match="--eval_split must be a fraction strictly between 0 and 1, got 1.5"):
        split_train_eval(dataset, 1.5)


def test_validate_rows_returns_valid_rows_and_report():
    rows = [{"input": "a", "label": 1}, {"input": "b"}, {"input": "", "label": 2}, {"input": "c", "label": None}]
    valid, report = validate_rows(rows, {"input": "text", "label": "any"}, "inline", on_bad_row="skip")
    assert valid == [rows[0]]
    assert [(e.row, e.field, e.kind) for e in report.errors] == [(1, "label", "missing"), (2, "input", "empty"),
                                                                  (3, "label", "null")]


def test_max_samples_keeps_the_first_rows(tok):
    rows = [{"input": str(i)} for i in range(5)]
    assert [p.text for p, _ in PromptDataset(rows, tok, max_samples=2)] == ["0", "1"]
    with pytest.raises(ValueError, match="--max_samples must be positive, got 0"):
        SFTDataset([{"input": "a", "output": "b"}], tok, max_samples=0)


def test_preference_margins_must_be_finite_numbers(tok):
    # Before: NaN and inf margins (JSON NaN/Infinity, CSV "nan") passed and made the pairwise loss NaN.
    for margin, message in ((float("inf"), "expected a finite number, got float inf"),
                            ("nan", "expected a finite number, got str 'nan'"),
                            ("-Infinity", "expected a finite number, got str '-Infinity'"),
                            (True, "expected a number, got bool True")):
        rows = [{"chosen": "a", "rejected": "b", "m": 1}, {"chosen": "a", "rejected": "b", "m": margin}]
        with pytest.raises(ValueError, match=rf"row 1, field 'm': {message}"):
            PreferenceDataset(rows, tok, margin_key="m")
    rows = [{"chosen": "a", "rejected": "b", "m": "-2.5"}, {"chosen": "a", "rejected": "b", "m": 0}]
    assert [pair.margin for pair in PreferenceDataset(rows, tok, margin_key="m")] == [-2.5, 0.0]
