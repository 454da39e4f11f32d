"""A toy task with an exact answer, for the quickstart, the end-to-end tests and benchmarks.

Small-number addition ("23+5=" -> "28"). Exact answers make learning measurable: greedy accuracy
on held-out prompts is the fraction of exactly right responses, and the builtin `math` reward
scores a response 1.0 when its final number equals the label.
"""

import json
import random
from pathlib import Path


def arithmetic_rows(n: int, seed: int, max_operand: int = 20, exclude: set | None = None) -> list[dict]:
    """`n` distinct rows {"input": "a+b=", "output": "c", "label": "c"} with 0 <= a, b < max_operand,
    drawn without replacement, skipping prompts in `exclude`."""
    pairs = [(a, b) for a in range(max_operand) for b in range(max_operand)
             if exclude is None or f"{a}+{b}=" not in exclude]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    if n > len(pairs):
        raise ValueError(f"asked for {n} rows but only {len(pairs)} distinct prompts exist with "
                         f"max_operand={max_operand}")
    return [{"input": f"{a}+{b}=", "output": str(a + b), "label": str(a + b)} for a, b in pairs[:n]]


def arithmetic_splits(n_train: int, n_eval: int, seed: int = 0, max_operand: int = 20) -> tuple[list, list]:
    """Disjoint train and held-out splits."""
    train = arithmetic_rows(n_train, seed, max_operand)
    held_out = arithmetic_rows(n_eval, seed + 1, max_operand, exclude={row["input"] for row in train})
    return train, held_out


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def greedy_accuracy(model_path: str | Path, rows: list[dict], max_new_tokens: int = 4, batch_size: int = 64) -> float:
    """Fraction of `rows` whose greedy response, stripped, equals row["output"] exactly, for a
    Hugging Face folder holding a causal LM and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            enc = tokenizer([row["input"] for row in chunk], return_tensors="pt", padding=True,
                            add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            correct += sum(text.strip() == row["output"] for text, row in zip(texts, chunk))
    return correct / len(rows)
