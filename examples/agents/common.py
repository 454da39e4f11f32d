"""What the two agent examples share: a multi-turn SFT warm start on transcripts, the greedy
success rate of a workflow on held-out rows (what `eval/reward_greedy` measures in a run), and a
torchrun launcher that keeps the run's output in a log file.

Transcripts are token-for-token what an episode holds: a prompt rendered by the chat template,
then each assistant turn followed by the end-of-sequence token the policy samples, then the
environment's messages as `lightrft.agents.ChatRenderer` renders them. The character-level tiny
tokenizer encodes text piece by piece, so the concatenated text encodes to the episode's ids.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def transcript(tokenizer, prompt: str, turns: list[tuple[str, list[dict]]],
               context_turns: int = 0) -> tuple[list[int], list[bool]]:
    """One conversation as an episode holds it: token ids and which of them train. `prompt` is
    the user message (rendered with the generation prompt), `turns` are (assistant text,
    environment messages after it); each turn and its EOS train, the rest does not, nor do the
    first `context_turns` turns (they are context for the ones after them)."""
    from lightrft.agents import ChatRenderer

    renderer = ChatRenderer(tokenizer, [tokenizer.eos_token_id])
    context = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                            add_generation_prompt=True)
    ids = tokenizer.encode(context, add_special_tokens=False)
    trains = [False] * len(ids)
    for index, (text, environment) in enumerate(turns):
        turn = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids, trains = ids + turn, trains + [index >= context_turns] * len(turn)
        if environment:
            observed = renderer.environment_ids(environment)
            ids, trains = ids + observed, trains + [False] * len(observed)
    return ids, trains


def warm_start(output_dir, transcripts: list[tuple[list[int], list[bool]]], steps: int, lr: float = 3e-3,
               hidden_size: int = 128, seed: int = 0, batch_size: int = 32, lr_decay: bool = False) -> Path:
    """A tiny Llama-shaped model (character tokenizer, heads of 32: vLLM's CPU attention takes
    them) trained for `steps` plain-PyTorch steps on `transcripts` (`transcript`), the loss on the
    tokens that train; saved with its tokenizer. Few steps leave it partly right, so RL has room.
    `lr_decay` lowers the rate linearly to a tenth of `lr` over 90% of the steps, then holds it.

    Llama rather than Qwen2 because transformers loads a saved Qwen2 folder's tokenizer as
    `Qwen2Tokenizer`, whose byte-level pre-tokenizer drops the character tokenizer's spaces and
    newlines; a Llama folder keeps the tokenizer it was saved with."""
    import torch

    from lightrft.utils.tiny import build_char_tokenizer, build_tiny_causal_lm

    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, arch="llama", hidden_size=hidden_size,
                                 num_heads=hidden_size // 32, num_kv_heads=max(1, hidden_size // 64),
                                 seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rate = (lambda step: max(0.1, 1 - step / steps)) if lr_decay else (lambda step: 1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = [transcripts[i] for i in torch.randint(0, len(transcripts), (batch_size,), generator=generator)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (tokens, trains) in enumerate(batch):       # right padding: positions start at 0
            ids[row, :len(tokens)] = torch.tensor(tokens)
            mask[row, :len(tokens)] = 1
            labels[row, :len(tokens)] = torch.where(torch.tensor(trains), torch.tensor(tokens), -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def greedy_success(model_dir, workflow_file, rows: list[dict], *, max_turns: int, max_new_tokens: int,
                   max_episode_tokens: Optional[int] = None, batch_size: int = 64) -> float:
    """Mean reward of the workflow's episodes on `rows` ({"input", "label"}) with greedy turns
    from the model in `model_dir`, prompts through the chat template: the number a run logs as
    eval/reward_greedy (`--eval_data ... --apply_chat_template`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightrft.builders.agents import build_workflow_runner
    from lightrft.config.sections import AgentConfig
    from lightrft.experience.maker import encode_rollout_prompts
    from lightrft.rollout.base import SamplingParams
    from lightrft.rollout.hf_engine import hf_engine_for

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = hf_engine_for(model, tokenizer)
    agent = AgentConfig(workflow=str(workflow_file), max_turns=max_turns, max_episode_tokens=max_episode_tokens,
                        tool_workers=1)
    runner = build_workflow_runner(agent, tokenizer, [tokenizer.eos_token_id])
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, n=1)
    total = 0.0
    try:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r["input"]}], tokenize=False,
                                                     add_generation_prompt=True) for r in chunk]
            ids = encode_rollout_prompts(tokenizer, prompts, True, 1024)
            batch = runner.run(engine, ids, prompts, [r["label"] for r in chunk], params,
                               seeds=list(range(start, start + len(chunk))))
            total += batch.rewards.scores.sum().item()
    finally:
        runner.close()
    return total / len(rows)


def torchrun(module: str, nproc: int, flags: list, log_path: Path) -> dict:
    """Runs `torchrun --nproc_per_node nproc -m module flags` on 127.0.0.1, keeps its output in
    `log_path`, and returns the JSON summary line train_ppo prints last."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(29500 + os.getpid() % 1000), "-m", module,
           *[str(f) for f in flags]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "WANDB_MODE": "offline", "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    print(f"$ torchrun --nproc_per_node {nproc} -m {module} {' '.join(str(f) for f in flags)}", flush=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{module} failed with exit code {proc.returncode}; full output in {log_path}")
    lines = [line for line in log_path.read_text().splitlines() if line.startswith("{") and "stop_reason" in line]
    return json.loads(lines[-1]) if lines else {}
