"""benchmarks/vs_trl.py's real-model workload (`--workload smollm2`): the prompts both trainers read
are SmolLM2's chat template rendered once, and the held-out reward scores the final number of a
chat answer ("12 + 12 = 24") with the `math` rule where the toy workload wants the bare answer."""


import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import REPO_ROOT, load_file_module

TEMPLATED_17_25 = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                   "<|im_start|>user\nWhat is 17+25? Answer with the number only.<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def vs_trl():
    """The benchmark's module (importing it runs nothing; it puts benchmarks/ on sys.path)."""
    return load_file_module(REPO_ROOT / "benchmarks" / "vs_trl.py")


def test_chat_rows_render_each_question_once_through_smollm2s_template(vs_trl, smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    rows = [{"input": "17+25=", "output": "42", "label": "42"}]
    rendered = vs_trl.grpo_step.chat_rows(rows, tokenizer)
    assert rendered == [{"input": TEMPLATED_17_25, "output": "42", "label": "42"}]
    assert rows[0]["input"] == "17+25="                       # the caller's rows are left alone
    # The text already holds its special tokens: tokenizing it adds none (what both trainers do).
    ids = tokenizer(TEMPLATED_17_25, add_special_tokens=False)["input_ids"]
    assert ids == tokenizer(TEMPLATED_17_25)["input_ids"] and ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_heldout_reward_scores_the_final_number_of_a_chat_answer(vs_trl, smollm2):
    """SmolLM2 answers these two as "12 + 12 = 24" and "16 + 0 = 16" (greedy, float32): right by
    the `math` rule, wrong by the toy workload's exact match."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).train()   # as a trainer holds it
    rows = vs_trl.grpo_step.chat_rows([{"input": "12+12=", "output": "24", "label": "24"},
                                       {"input": "16+0=", "output": "16", "label": "16"}], tokenizer)
    assert vs_trl.heldout_accuracy(model, tokenizer, rows, max_new_tokens=12, score="math") == 1.0
    assert vs_trl.heldout_accuracy(model, tokenizer, rows, max_new_tokens=12) == 0.0
    assert model.training                          # the live model is handed back in the mode it came in
