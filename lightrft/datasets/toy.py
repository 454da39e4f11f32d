"""A toy task with an exact answer, for the quickstart, the end-to-end tests and benchmarks.

Small-number addition ("23+5=" -> "28"). Exact answers make learning measurable: greedy accuracy
on held-out prompts is the fraction of exactly right responses, and the builtin `math` reward
scores a response 1.0 when its final number equals the label.
"""

import json
import random
from pathlib import Path
from lightrft.utils.hf_api import LOAD_OPTIONS


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
    from transformers import AutoModelForCausalLM

    from lightrft.models.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(str(model_path), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, **LOAD_OPTIONS).eval()
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


def sft_warm_start(output_dir: str | Path, rows: list[dict], steps: int, lr: float = 3e-3, seed: int = 0,
                   hidden_size: int = 64, num_layers: int = 2) -> Path:
    """A tiny Qwen2 model trained on `rows` for `steps` plain-PyTorch SFT steps (batches of 32,
    loss on the response and EOS only), saved with its tokenizer. Few steps leave it partly right,
    so RL has room to improve."""
    import torch

    from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm

    tokenizer = build_char_tokenizer()
    heads = max(4, hidden_size // 64)
    model = build_tiny_causal_lm(tokenizer, hidden_size=hidden_size, num_layers=num_layers, num_heads=heads,
                                 num_kv_heads=heads // 2, seed=seed)
    encoded = [(tokenizer(r["input"], add_special_tokens=False)["input_ids"],
                tokenizer(r["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]) for r in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = [encoded[i] for i in torch.randint(0, len(encoded), (32,), generator=generator)]
        width = max(len(p) + len(o) for p, o in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (p, o) in enumerate(batch):
            ids[i, :len(p) + len(o)] = torch.tensor(p + o)
            mask[i, :len(p) + len(o)] = 1
            labels[i, len(p):len(p) + len(o)] = torch.tensor(o)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir
