"""Delta against full weight syncs on the real SmolLM2-135M-Instruct in bf16, after real Adam steps.

The trainer side is what DeepSpeed's bf16 mode holds: float32 master weights stepped by AdamW
(betas 0.9/0.95, as `DeepspeedStrategy.create_optimizer`), and the bf16 module the weights are
gathered from (the masters rounded to bf16 after each step). The loss is the language-model loss
of a few chat sequences. After every step, at lr 1e-6 and at 1e-5 (a fresh model for each):

- vLLM (the colocated engine, bf16): `RolloutManager.sync_weights` with delta sync (only the
  decoder layers where a bit changed are reloaded), then a full sync of the same weights; bytes
  handed to vLLM, seconds, layers skipped;
- explorers (`--explorer_ranks`, broadcast): `WeightPublisher` with and without deltas to a
  `WeightSubscriber` over an in-process channel, which rebuilds the plain Hugging Face weights;
  bytes on the channel, seconds from publishing to the rebuilt version;
- the fraction of bf16 elements that changed since the previous step.

Figures: the first step's sync apart (Adam's first step moves every weight by the full lr), then
the mean and spread (min-max) over the later `--steps` - 1 steps per learning rate. Also the speed of the
two ways to tell changed tensors apart (a bitwise compare with a kept copy, a BLAKE2 hash).

    python benchmarks/delta_sync.py [--steps 4 --lrs 1e-6 1e-5 --threads 2 --json out.json]

Figures in docs/benchmarks.md ("Delta weight sync").
"""

import argparse
import copy
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout without installing
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.expanduser("~/.cache/lightrft/inductor"))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from lightrft.explorers.roles import LocalChannel  # noqa: E402
from lightrft.explorers.weights import WeightPublisher, WeightSubscriber  # noqa: E402
from lightrft.rollout import RolloutManager  # noqa: E402
from lightrft.rollout.delta import changed_indices  # noqa: E402
from lightrft.strategy import DeepspeedStrategy, StrategyConfig  # noqa: E402
from lightrft.utils.pretrained import smollm2_folder  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Explain photosynthesis in one sentence.",
             "Write a haiku about the sea.", "What is 12 times 7?"]
ANSWERS = ["The capital of France is Paris.", "Plants turn light, water and carbon dioxide into sugar and oxygen.",
           "Waves fold on the shore / salt wind carries gull voices / the tide keeps its time", "12 times 7 is 84."]


def chat_batch(tokenizer) -> torch.Tensor:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                           tokenize=False) for q, a in zip(QUESTIONS, ANSWERS)]
    return tokenizer(texts, return_tensors="pt", padding=True)


class Trainer:
    """float32 masters, AdamW, and the bf16 module the syncs read (DeepSpeed's bf16 layout)."""

    def __init__(self, master, lr: float, batch):
        self.master, self.batch = master, batch
        self.bf16 = copy.deepcopy(master).to(torch.bfloat16).eval()
        self.optimizer = torch.optim.AdamW(master.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    def step(self) -> None:
        labels = self.batch["input_ids"].masked_fill(self.batch["attention_mask"] == 0, -100)
        loss = self.master(**self.batch, labels=labels).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        with torch.no_grad():
            for low, high in zip(self.bf16.parameters(), self.master.parameters()):
                low.copy_(high)

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, param.detach()) for name, param in self.bf16.named_parameters()]


def vllm_syncs(trainer: Trainer) -> tuple[dict, dict]:
    """(delta, full) figures of syncing the trainer's current weights into the engine: a delta
    sync, then a full one of the same weights (which also refreshes the manager's record)."""
    manager = trainer.vllm_manager
    figures = []
    for full in (False, True):
        if full:
            manager.forget_sent_weights()
        manager.sync_weights()
        figures.append({"bytes": manager.last_sync_bytes, "seconds": manager.last_sync_seconds,
                        "skipped_layers": manager.last_sync_skipped})
    return figures[0], figures[1]


def explorer_publish(publisher, subscriber, version: int, named) -> dict:
    started = time.perf_counter()
    publisher.publish(version, named, start_batch=0)
    subscriber.wait(lambda: subscriber.newest() >= version)
    seconds = time.perf_counter() - started
    subscriber.take(version)                                  # older versions are dropped, as an explorer does
    return {"bytes": publisher.sent_bytes[-1], "seconds": seconds}


def summary(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def compare_vs_hash(named) -> dict:
    """Seconds per GB to tell changed tensors from a kept copy (`torch.equal` on the bits, what
    the vLLM path does), to find the changed elements (`changed_indices`, the explorer path), and
    to hash the tensors instead (BLAKE2b, what a copy-free record would need)."""
    copies = [t.clone() for _, t in named]
    total = sum(t.numel() * t.element_size() for _, t in named) / 1e9

    def timed(fn) -> float:
        started = time.perf_counter()
        for (_, t), old in zip(named, copies):
            fn(t, old)
        return (time.perf_counter() - started) / total

    timed(lambda t, old: torch.equal(t.view(torch.int16), old.view(torch.int16)))     # warm-up: first touch
    return {"equal_s_per_gb": timed(lambda t, old: torch.equal(t.view(torch.int16), old.view(torch.int16))),
            "changed_indices_s_per_gb": timed(changed_indices),
            "blake2b_s_per_gb": timed(lambda t, old: hashlib.blake2b(
                t.contiguous().view(torch.uint8).numpy().data, digest_size=16).digest())}


def run_lr(lr: float, steps: int, folder, tokenizer, engine) -> dict:
    master = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = Trainer(master, lr, chat_batch(tokenizer))
    strategy = DeepspeedStrategy(StrategyConfig())
    trainer.vllm_manager = (RolloutManager(engine, lambda: strategy.iter_parameter_buckets(trainer.bf16, 512),
                                           weight_sync="delta")
                            if engine is not None else None)
    channels = {mode: LocalChannel() for mode in ("delta", "full")}
    publishers = {mode: WeightPublisher(channels[mode], delta=mode == "delta") for mode in channels}
    subscribers = {mode: WeightSubscriber(channels[mode], 0) for mode in channels}
    rows = []
    if engine is not None:
        trainer.vllm_manager.sync_weights()                  # the first sync is full: the baseline to delta from
    for mode in publishers:
        explorer_publish(publishers[mode], subscribers[mode], 0, trainer.named())
    for step in range(1, steps + 1):
        before = [t.clone() for _, t in trainer.named()]
        trainer.step()
        named = trainer.named()
        changed = sum(changed_indices(t, old).numel() for (_, t), old in zip(named, before))
        row = {"step": step, "changed_fraction": changed / sum(t.numel() for _, t in named)}
        if engine is not None:
            row["vllm_delta"], row["vllm_full"] = vllm_syncs(trainer)
        for mode in publishers:
            row[f"explorer_{mode}"] = explorer_publish(publishers[mode], subscribers[mode], step, named)
        got, want = dict(subscribers["delta"].versions[step]), dict(subscribers["full"].versions[step])
        row["explorer_bit_identical"] = all(torch.equal(got[n].view(torch.int16), want[n].view(torch.int16))
                                            for n in want)
        rows.append(row)
        print(f"lr {lr:g} step {step}: {json.dumps(row)}", flush=True)
    for publisher in publishers.values():
        publisher.close(10)
    # Adam's first step moves every weight by the full lr (m / sqrt(v) = sign(g)), later ones less:
    # the first sync after the start is reported apart from the steady state.
    result = {"lr": lr, "steps": rows}
    for part, part_rows in (("first", rows[:1]), ("later", rows[1:] or rows[:1])):
        result[part] = {"changed_fraction": summary([r["changed_fraction"] for r in part_rows])}
        for key in [k for k in rows[0] if k.startswith(("vllm_", "explorer_")) and isinstance(rows[0][k], dict)]:
            result[part][key] = {field: summary([r[key][field] for r in part_rows]) for field in rows[0][key]}
    return result


def print_table(results: list[dict], hashing: dict) -> None:
    print("\nDelta vs full weight sync, SmolLM2-135M-Instruct bf16: the first step's sync, then the mean "
          "(min-max) of the later steps' syncs")
    print(f"{'lr':>6} {'steps':<6} {'path':<9} {'mode':<6} {'MB per sync':>24} {'share':>7} "
          f"{'seconds per sync':>22} {'skipped layers':>15}")
    for result in results:
        for part in ("first", "later"):
            figures = result[part]
            for path in ("vllm", "explorer"):
                if f"{path}_full" not in figures:
                    continue
                full_mb = figures[f"{path}_full"]["bytes"]["mean"] / 1e6
                for mode in ("delta", "full"):
                    mb, sec = figures[f"{path}_{mode}"]["bytes"], figures[f"{path}_{mode}"]["seconds"]
                    skipped = figures[f"{path}_{mode}"].get("skipped_layers", {}).get("mean", float("nan"))
                    print(f"{result['lr']:>6g} {part:<6} {path:<9} {mode:<6} "
                          f"{mb['mean'] / 1e6:>8.2f} ({mb['min'] / 1e6:.2f}-{mb['max'] / 1e6:.2f}) "
                          f"{mb['mean'] / 1e6 / full_mb:>7.1%} "
                          f"{sec['mean']:>8.3f} ({sec['min']:.3f}-{sec['max']:.3f}) {skipped:>15.1f}")
            frac = figures["changed_fraction"]
            print(f"{result['lr']:>6g} {part:<6} bf16 elements changed by the step: {frac['mean']:.3%} "
                  f"({frac['min']:.3%}-{frac['max']:.3%})")
    print(f"telling changes apart: torch.equal with a kept copy {hashing['equal_s_per_gb']:.3f} s/GB, "
          f"changed_indices {hashing['changed_indices_s_per_gb']:.3f} s/GB, "
          f"BLAKE2b hash {hashing['blake2b_s_per_gb']:.3f} s/GB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (syncs measured) per learning rate")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no_vllm", action="store_true", help="explorer path only")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = None
    if not args.no_vllm:
        from lightrft.rollout import VLLMEngine

        engine = VLLMEngine(str(folder), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=0, dtype="bfloat16",
                            kv_cache_gb=0.25, max_model_len=128, enforce_eager=True)
    try:
        results = [run_lr(lr, args.steps, folder, tokenizer, engine) for lr in args.lrs]
    finally:
        if engine is not None:
            engine.shutdown()
    named = [(n, p.detach()) for n, p in
             AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).named_parameters()]
    hashing = compare_vs_hash(named)
    print_table(results, hashing)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "hashing": hashing}, indent=1))


if __name__ == "__main__":
    main()
