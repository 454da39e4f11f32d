"""`ServedPolicy` generates concurrent requests together: one engine call for the requests with
the same sampling options that wait while another generation runs, each prompt with its own seed,
so a request's samples are those it gets alone."""

import threading

import pytest

from lightrft.models.tokenizer import build_tokenizer, stop_token_ids
from lightrft.rollout import SamplingParams
from lightrft.serving.policy import ServedPolicy
from lightrft.utils.tiny import save_tiny_model

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, n=2)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("batching") / "model", seed=0)
    tokenizer = build_tokenizer(str(model), False)
    return ServedPolicy(model, tokenizer, stop_token_ids(tokenizer, str(model)), max_batch_prompts=4)


def texts(samples) -> list[tuple]:
    return [(tuple(s.token_ids), s.truncated) for s in samples]


def test_waiting_requests_share_engine_calls_and_keep_their_samples(policy):
    prompts = [policy.tokenizer.encode(f"{k}+{10 ** k}=") for k in range(7)]     # 4 to 10 tokens: left padding
    alone = [policy.generate(p, PARAMS, seed=10 + k) for k, p in enumerate(prompts)]
    other = SamplingParams(temperature=1.0, max_new_tokens=3, n=1)
    alone_other = policy.generate(prompts[0], other, seed=99)

    results, errors = {}, []
    gate = threading.Event()
    policy._lock.acquire()               # a generation "runs": everyone below has to queue
    calls_before = policy.batches

    def ask(key, prompt, params, seed):
        try:
            results[key] = policy.generate(prompt, params, seed)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=ask, args=(k, p, PARAMS, 10 + k)) for k, p in enumerate(prompts)]
    threads.append(threading.Thread(target=ask, args=("other", prompts[0], other, 99)))
    for thread in threads:
        thread.start()
    while True:                            # all eight queued
        with policy._queue_lock:
            if len(policy._queue) == 8:
                break
        gate.wait(0.01)
    policy._lock.release()
    for thread in threads:
        thread.join(60)
    assert errors == []
    # 7 requests with one set of options in batches of at most 4 (2 calls), the other options alone.
    assert policy.batches - calls_before == 3
    for k in range(7):
        assert texts(results[k]) == texts(alone[k])
        for batched, single in zip(results[k], alone[k]):
            assert batched.log_probs == pytest.approx(single.log_probs, abs=1e-5)
    assert texts(results["other"]) == texts(alone_other)


def test_a_failed_batch_answers_each_of_its_requests_with_the_error(policy, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(policy.engine, "generate", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        policy.generate(policy.tokenizer.encode("1+1="), PARAMS, seed=1)
    assert policy._queue == []


def test_max_batch_prompts_must_be_positive(tmp_path):
    model = save_tiny_model(tmp_path / "model", seed=0)
    tokenizer = build_tokenizer(str(model), False)
    with pytest.raises(ValueError, match="--max_batch_prompts must be at least 1"):
        ServedPolicy(model, tokenizer, [tokenizer.eos_token_id], max_batch_prompts=0)
