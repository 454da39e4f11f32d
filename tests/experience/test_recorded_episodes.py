"""Served multi-turn chats train as one episode: `RecordedExperienceDataset` joins the records of a
chat (each request holds the whole conversation so far) into one sample whose loss mask has holes on
the tokens between turns, with per-turn feedback as token rewards; turns whose round trip through
text did not keep the token ids stay separate and are counted; single-turn records build the same
rollout as before."""

import logging
import os
import threading
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import torch
from openai import OpenAI
from transformers import AutoTokenizer

from lightrft.algorithms.kl import FixedKLController
from lightrft.cli.train_ppo import parse_args, train
from lightrft.experience.maker import ExperienceBuilder
from lightrft.experience.recorded import RecordedExperienceDataset, recorded_rollout
from lightrft.models import ActorLanguage
from lightrft.models.tokenizer import build_tokenizer, stop_token_ids
from lightrft.rewards.batch import RewardBatch
from lightrft.rollout.base import RolloutOutput
from lightrft.serving.http import HTTPSettings, longest_token_chars
from lightrft.serving.openai_api import OpenAIServer, ServeLimits, build_server
from lightrft.serving.policy import ServedPolicy
from lightrft.serving.records import ExperienceRecord, ExperienceRecorder, read_records, tokenizer_fingerprint
from lightrft.utils.tiny import build_char_tokenizer, save_tiny_model
from tests.conftest import to_flags
from tests.trainer.ppo_harness import LAUNCH_ENV

EOS = 2
# The tiny template, ending each assistant message with the EOS token as ChatML ends it with
# <|im_end|>: an answer that ended with EOS is re-rendered with the same ids.
EOS_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                "{{ '</s>' if m['role'] == 'assistant' else '' }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")


def chat_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = EOS_TEMPLATE
    return tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_record(tokenizer, rid: str, messages: list, response_ids: list[int], index: int = 0,
                version: int = 0) -> ExperienceRecord:
    """A chat record as the server writes it: the prompt rendered by the chat template, the text
    decoded without special tokens; log-probs -0.1, -0.2, ..."""
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return ExperienceRecord(
        id=rid, index=index, prompt_token_ids=encode(tokenizer, prompt), response_token_ids=response_ids,
        log_probs=[-0.1 * (k + 1) for k in range(len(response_ids))], policy_version=version,
        tokenizer=tokenizer_fingerprint(tokenizer), prompt=prompt,
        response=tokenizer.decode(response_ids, skip_special_tokens=True), messages=messages,
        sampling={"seed": 0}, finish_reason="stop", time=0.0)


def write(folder: Path, records: list[ExperienceRecord], feedback: dict) -> None:
    with ExperienceRecorder(folder) as recorder:
        for record in records:
            recorder.record(record)
        for (rid, index), reward in feedback.items():
            recorder.add_feedback(rid, reward, index)


# ------------------------------------------------------------------------------ a real server
def test_a_served_three_turn_chat_trains_as_one_episode(tmp_path):
    model = save_tiny_model(tmp_path / "model", seed=0)
    saved = AutoTokenizer.from_pretrained(model)
    saved.chat_template = EOS_TEMPLATE
    saved.save_pretrained(model)
    tokenizer = build_tokenizer(str(model), False)
    policy = ServedPolicy(model, tokenizer, stop_token_ids(tokenizer, str(model)))
    limits = ServeLimits(6, 4096, context_len=policy.context_len, token_chars=longest_token_chars(tokenizer))
    record = tmp_path / "record"
    recorder = ExperienceRecorder(record)
    server = build_server(OpenAIServer(policy, limits, "tiny", seed=1, recorder=recorder), "127.0.0.1", 0,
                          HTTPSettings())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="x", max_retries=0)
        # A three-turn chat: each request sends the conversation so far, the answers as returned.
        messages, replies = [], []
        for question in ["hi", "2+2=", "thanks"]:
            messages.append({"role": "user", "content": question})
            reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
            replies.append(reply)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        # Another chat, never rewarded: not trained on.
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "bye"}], max_tokens=6)
        # Feedback on the last answer and the first; none on the second.
        recorder.add_feedback(replies[2].id, 1.0)
        recorder.add_feedback(replies[0].id, -0.5)
    finally:
        server.shutdown()
        server.server_close()
        recorder.close()

    turns = {r.id: r for r, _ in read_records(record)[0]}
    first, second, third = (turns[reply.id] for reply in replies)
    # Visible characters (and EOS at the end) only: their text round trip keeps the ids. (The tiny
    # tokenizer reloaded from its folder drops spaces and newlines when encoding; special tokens
    # vanish from the decoded text.)
    for turn in (first, second, third):
        assert all(3 < t < 98 for t in turn.response_token_ids[:-1])
        assert 3 < turn.response_token_ids[-1] < 98 or turn.response_token_ids[-1] == EOS
    # The tokens between two answers: the template's end of the answer (its EOS when the answer
    # was cut at max_tokens without one), the next user message and the assistant header.
    def between(answer: ExperienceRecord, question: str) -> list[int]:
        end = "" if answer.response_token_ids[-1] == EOS else "</s>"
        return encode(tokenizer, f"{end}\nuser: {question}\nassistant: ")

    gap1, gap2 = between(first, "2+2="), between(second, "thanks")
    dataset = RecordedExperienceDataset(record, tokenizer)
    assert len(dataset) == 1 and dataset.unrewarded == 1 and dataset.unjoined_turns == 0
    [sample] = dataset.samples
    a, b, c = first.response_token_ids, second.response_token_ids, third.response_token_ids
    assert sample.prompt_token_ids == first.prompt_token_ids == encode(tokenizer, "user: hi\nassistant: ")
    assert sample.response_token_ids == a + gap1 + b + gap2 + c
    assert sample.prompt_token_ids + sample.response_token_ids[:-len(c)] == third.prompt_token_ids
    assert sample.loss_mask == [True] * len(a) + [False] * len(gap1) + [True] * len(b) + [False] * len(gap2) + \
        [True] * len(c)
    assert sample.log_probs == first.log_probs + [0.0] * len(gap1) + second.log_probs + [0.0] * len(gap2) + \
        third.log_probs
    assert (sample.reward, sample.turns, sample.id) == (1.0, 3, third.id)
    assert sample.turn_rewards == [(len(a) - 1, -0.5)]        # the first answer's last token

    rollout, rewards = recorded_rollout(dataset.samples, tokenizer.pad_token_id, [EOS])
    width = len(sample.response_token_ids)
    assert rollout.action_mask.tolist() == [sample.loss_mask]
    assert rollout.attention_mask[0, -width:].tolist() == [1] * width     # the gaps are attended to
    expected = torch.zeros(1, width)
    expected[0, len(a) - 1] = -0.5
    assert torch.equal(rewards.token_rewards, expected)
    assert rewards.scores.tolist() == [1.0] and rewards.info["turns"].tolist() == [3.0]

    # One REINFORCE step on the episode.
    for key in LAUNCH_ENV:
        os.environ.pop(key, None)
    try:
        logs = train(parse_args(to_flags({
            "pretrain": model, "recorded_data": record, "advantage_estimator": "reinforce",
            "rollout_batch_size": 1, "train_batch_size": 1, "micro_train_batch_size": 1,
            "micro_rollout_batch_size": 1, "init_kl_coef": 0, "actor_learning_rate": 1e-2, "max_steps": 1,
            "zero_stage": 2, "seed": 3, "disable_ds_ckpt": True, "ckpt_path": tmp_path / "ckpt",
            "save_path": tmp_path / "out"})))
    finally:
        for key in LAUNCH_ENV:
            os.environ.pop(key, None)
    assert logs["rollout/turns"] == 3.0 and logs["rollout/reward"] == 1.0
    assert logs["rollout/response_length"] == len(a) + len(b) + len(c)      # trained tokens only


# --------------------------------------------------------------------------- written records
def test_a_turn_whose_text_round_trip_lost_ids_stays_separate_and_is_counted(tmp_path, caplog):
    tokenizer = chat_tokenizer()
    # The answer holds <unk> (id 3), which the decoded text drops: the next prompt re-renders "ok".
    answer = encode(tokenizer, "o") + [3] + encode(tokenizer, "k") + [EOS]
    first = [{"role": "user", "content": "hi"}]
    a = chat_record(tokenizer, "a", first, answer)
    assert a.response == "ok"
    b = chat_record(tokenizer, "b", first + [{"role": "assistant", "content": "ok"},
                                             {"role": "user", "content": "more"}], encode(tokenizer, "yes") + [EOS])
    write(tmp_path, [a, b], {("a", 0): 0.5, ("b", 0): 1.0})
    with caplog.at_level(logging.WARNING, logger="lightrft.experience.recorded"):
        dataset = RecordedExperienceDataset(tmp_path, tokenizer)
    assert [(s.id, s.turns, s.reward) for s in dataset.samples] == [("a", 1, 0.5), ("b", 1, 1.0)]
    assert dataset.unjoined_turns == 1
    assert dataset.samples[1].prompt_token_ids == b.prompt_token_ids
    warnings = [r.getMessage() for r in caplog.records if "token ids" in r.getMessage()]
    assert len(warnings) == 1 and "1 chat turn" in warnings[0] and str(tmp_path) in warnings[0]


def test_choices_forks_and_rewards_of_joined_turns(tmp_path):
    tokenizer = chat_tokenizer()
    hi = [{"role": "user", "content": "hi"}]

    def follow(answer: str, question: str) -> list:
        return hi + [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]

    records = [
        # Two choices of one request (n=2); the chat continues choice 1.
        chat_record(tokenizer, "a", hi, encode(tokenizer, "xy") + [EOS], index=0, version=2),
        chat_record(tokenizer, "a", hi, encode(tokenizer, "zw") + [EOS], index=1, version=1),
        chat_record(tokenizer, "b", follow("zw", "go"), encode(tokenizer, "ok") + [EOS], version=3),
        # A chat rewarded on its first turn only; and a chat with no feedback at all.
        chat_record(tokenizer, "c", [{"role": "user", "content": "q"}], encode(tokenizer, "r") + [EOS]),
        chat_record(tokenizer, "d", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"},
                                     {"role": "user", "content": "s"}], encode(tokenizer, "t") + [EOS]),
        chat_record(tokenizer, "e", [{"role": "user", "content": "u"}], encode(tokenizer, "v") + [EOS]),
        chat_record(tokenizer, "f", [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"},
                                     {"role": "user", "content": "w"}], encode(tokenizer, "x") + [EOS]),
        # The same request sent again (a regenerated answer): a sibling, not a continuation.
        chat_record(tokenizer, "g", hi, encode(tokenizer, "xy") + [EOS]),
    ]
    write(tmp_path, records, {("a", 0): 0.25, ("a", 1): 0.5, ("b", 0): 2.0, ("c", 0): 3.0, ("g", 0): 1.0})
    dataset = RecordedExperienceDataset(tmp_path, tokenizer)
    assert [(s.id, s.turns) for s in dataset.samples] == [("a", 1), ("b", 2), ("d", 2), ("g", 1)]
    assert dataset.unrewarded == 1 and dataset.unjoined_turns == 0
    alone, chat, first_only, again = dataset.samples
    assert alone.response_token_ids == encode(tokenizer, "xy") + [EOS] and alone.reward == 0.25
    # b continues choice 1 ("zw"), whose feedback is a turn reward on its EOS (position 2).
    gap = encode(tokenizer, "\nuser: go\nassistant: ")
    assert chat.response_token_ids == encode(tokenizer, "zw") + [EOS] + gap + encode(tokenizer, "ok") + [EOS]
    assert chat.turn_rewards == [(2, 0.5)] and chat.reward == 2.0 and chat.last_turn_start == 3 + len(gap)
    assert chat.policy_version == 1                 # the oldest weights that served a turn
    # Feedback on the first turn only: the episode's reward is 0, the turn's reward is on its EOS.
    assert first_only.reward == 0.0 and first_only.turn_rewards == [(1, 3.0)]
    assert again.reward == 1.0 and again.prompt_token_ids == alone.prompt_token_ids
    assert [s.id for s in RecordedExperienceDataset(tmp_path, tokenizer, max_samples=2).samples] == ["a", "b"]

    # Per-turn rewards are token rewards on those positions; every row carries `turns`.
    rollout, rewards = recorded_rollout(dataset.samples, tokenizer.pad_token_id, [EOS])
    assert rewards.token_rewards.nonzero().tolist() == [[1, 2], [2, 1]]
    assert rewards.token_rewards[1, 2] == 0.5 and rewards.token_rewards[2, 1] == 3.0
    assert rewards.info["turns"].tolist() == [1.0, 2.0, 2.0, 1.0]
    assert rewards.scores.tolist() == [0.25, 2.0, 0.0, 1.0]
    assert rollout.truncated.tolist() == [False] * 4


def test_single_turn_rows_build_the_rollout_they_built_before(tmp_path):
    """Before episodes, a batch of records became `RolloutOutput.from_token_lists`, which cuts a
    response after its first EOS and flags one without EOS as truncated."""
    tokenizer = chat_tokenizer()
    responses = [encode(tokenizer, "abc") + [EOS],
                 encode(tokenizer, "d") + [EOS] + encode(tokenizer, "ef") + [EOS],   # EOS inside: cut there
                 encode(tokenizer, "ghij")]                                             # cut at max_tokens
    records = [chat_record(tokenizer, f"r{i}", [{"role": "user", "content": "q" * (i + 1)}], ids)
               for i, ids in enumerate(responses)]
    write(tmp_path, records, {(f"r{i}", 0): float(i) for i in range(3)})
    samples = RecordedExperienceDataset(tmp_path, tokenizer).samples
    eos_ids = [EOS, 5]
    rollout, rewards = recorded_rollout(samples, tokenizer.pad_token_id, eos_ids)
    before = RolloutOutput.from_token_lists([r.prompt_token_ids for r in records],
                                            [r.response_token_ids for r in records],
                                            [r.log_probs for r in records], tokenizer.pad_token_id, eos_ids)
    for name in ("sequences", "attention_mask", "action_mask", "rollout_log_probs", "truncated"):
        assert torch.equal(getattr(rollout, name), getattr(before, name)), name
    assert rollout.prompt_len == before.prompt_len and rollout.truncated.tolist() == [False, False, True]
    assert rewards.token_rewards is None and rewards.scores.tolist() == [0.0, 1.0, 2.0]
    assert rewards.info["turns"].tolist() == [1.0, 1.0, 1.0] and rewards.valid.all()

    # The experiences are the same, bit for bit, with `turns` logged besides.
    builder = ExperienceBuilder(ActorLanguage(str(save_tiny_model(tmp_path / "model"))), None, None,
                                FixedKLController(0.0), SimpleNamespace(device="cpu"),
                                advantage_estimator="reinforce", eos_token_ids=eos_ids)
    [new] = builder.experience_from_rollout(rollout, rewards, 1)
    [old] = builder.experience_from_rollout(before, RewardBatch(scores=torch.tensor([0.0, 1.0, 2.0]),
                                                                valid=torch.ones(3, dtype=torch.bool)), 1)
    for field in fields(new):
        if isinstance(getattr(old, field.name), torch.Tensor):
            assert torch.equal(getattr(new, field.name), getattr(old, field.name)), field.name
    assert set(new.info) == set(old.info) | {"turns"}
    assert all(torch.equal(new.info[key], old.info[key]) for key in old.info)
