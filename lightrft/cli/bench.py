"""Evaluate every saved checkpoint of a run on held-out prompts: a table and a plot of the curve.

    python -m lightrft.cli.bench --ckpt_path ./ckpt/checkpoints --pretrain ./base-model \
        --eval_data eval.jsonl --input_key input --label_key label --remote_rm_url math --eval_n_samples 4

Checkpoints, one per step:
- the Hugging Face exports train_ppo writes with --save_hf_ckpt (`<ckpt_path>/global_stepN_hf`);
- the resumable DeepSpeed checkpoints every run with --save_steps writes
  (`<ckpt_path>/_actor/global_stepN`, ZeRO-0 to 3, LoRA merged): only the weights are read, into
  the model of --pretrain (the base model folder: config and tokenizer; default: the pretrain of
  the run's run_config.yaml); see `lightrft.serving.checkpoint_weights`. A step with both is
  evaluated once, from its export (the weights serving uses, no consolidation needed).
`--pretrain MODEL` also adds the starting model as step 0. A checkpoint that cannot be read
(incomplete, torn, another model) is named with the reason and skipped; bench fails only when no
checkpoint could be evaluated.

Each checkpoint is scored with the evaluation train_ppo runs (`lightrft.trainer.evaluation`):
`eval/reward_greedy`, the mean task reward of greedy decoding, and with --eval_n_samples k > 1,
`eval/pass@k` (share of prompts with a positive reward among k samples) and `eval/reward_mean`.
Sampling seeds depend on the --seed and the prompt, not on the checkpoint, so checkpoints are
compared on the same draws. Writes bench.csv, bench.md and bench.png (x: step; the plot needs
matplotlib: `pip install "lightrft[plot]"`) to --output_dir (default: --ckpt_path). Runs on one
process, or on several under torchrun (prompts are split).
"""

import argparse
import csv
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from lightrft.utils.program import run_program

_EXPORT = re.compile(r"^global_step(\d+)_hf$")
_DS_CKPT = re.compile(r"^global_step(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    kind: str = "hf"            # "hf": a Hugging Face folder; "deepspeed": a save_ckpt folder (_actor/global_stepN)


def find_checkpoints(ckpt_path: str | Path, pretrain: str | None = None) -> tuple[list[Checkpoint], list[Path]]:
    """The checkpoints under `ckpt_path` in step order, one per step (with `pretrain` as step 0):
    the Hugging Face exports, and the DeepSpeed checkpoints of the steps without one. Also returns
    the DeepSpeed checkpoints left out because their step has an export."""
    root = Path(ckpt_path)
    if not root.is_dir():
        raise FileNotFoundError(f"--ckpt_path {root} is not a folder; give the --ckpt_path of a train_ppo run")
    found = [Checkpoint(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := _EXPORT.match(p.name)) and (p / "config.json").exists()]
    exported = {c.step for c in found}
    shadowed = []
    if (root / "_actor").is_dir():
        for p in (root / "_actor").iterdir():
            if not (p.is_dir() and (m := _DS_CKPT.match(p.name))):
                continue
            if int(m.group(1)) in exported:
                shadowed.append(p)
            else:
                found.append(Checkpoint(int(m.group(1)), p, "deepspeed"))
    if pretrain is not None:
        found.append(Checkpoint(0, Path(pretrain)))
    return sorted(found, key=lambda c: c.step), sorted(shadowed, key=lambda p: int(_DS_CKPT.match(p.name).group(1)))


def run_pretrain(ckpt_path: str | Path) -> str | None:
    """The --pretrain recorded in `<ckpt_path>/run_config.yaml` (nested or flat), None without one."""
    import yaml

    try:
        config = yaml.safe_load((Path(ckpt_path) / "run_config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    section = config.get("model") if isinstance(config.get("model"), dict) else config
    pretrain = section.get("pretrain")
    return str(pretrain) if pretrain else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightrft.cli.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt_path", required=True,
                        help="train_ppo's --ckpt_path (global_stepN_hf exports and/or _actor/global_stepN DeepSpeed "
                             "checkpoints in it)")
    parser.add_argument("--eval_data", required=True, help="held-out prompts: .jsonl/.json/.parquet/.csv or a "
                                                           "saved datasets folder")
    parser.add_argument("--pretrain", default=None,
                        help="the base model folder: evaluated as step 0, and the config and tokenizer of the "
                             "DeepSpeed checkpoints (default for those: the run's run_config.yaml pretrain)")
    parser.add_argument("--output_dir", default=None, help="where bench.csv/.md/.png go (default: --ckpt_path)")
    parser.add_argument("--input_key", default="input", help="field holding the prompt")
    parser.add_argument("--label_key", default=None, help="field holding the reference answer")
    parser.add_argument("--apply_chat_template", action="store_true", help="render prompts with the chat template")
    parser.add_argument("--prompt_max_len", type=int, default=1024, help="most prompt tokens")
    parser.add_argument("--truncate_long_prompts", action="store_true",
                        help="keep the last --prompt_max_len tokens of longer prompts instead of rejecting the row")
    parser.add_argument("--remote_rm_url", default=None,
                        help="comma-separated reward sources: http(s) URLs, .py reward files, builtin rules (math, "
                             "format)")
    parser.add_argument("--reward_pretrain", default=None, help="reward model folder(s), comma-separated")
    parser.add_argument("--value_head_prefix", default="score", help="attribute name of the value head")
    parser.add_argument("--normalize_reward", action="store_true", help="normalise reward-model scores")
    parser.add_argument("--reward_timeout", type=float, default=30.0, help="seconds per reward request")
    parser.add_argument("--reward_retries", type=int, default=3, help="retries per reward request")
    parser.add_argument("--eval_n_samples", type=int, default=1, help="k of pass@k (1: greedy reward only)")
    parser.add_argument("--generate_max_len", type=int, default=1024, help="most new tokens per response")
    parser.add_argument("--temperature", type=float, default=1.0, help="temperature of the pass@k samples")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass of the pass@k samples")
    parser.add_argument("--top_k", type=int, default=0, help="top-k of the pass@k samples (0: all)")
    parser.add_argument("--micro_rollout_batch_size", type=int, default=8, help="prompts per generate call")
    parser.add_argument("--seed", type=int, default=42, help="seeds the pass@k samples")
    parser.add_argument("--bf16", action="store_true", help="load models in bfloat16")
    parser.add_argument("--trust_remote_code", action="store_true", help="allow model code shipped in the folders")
    return parser


class Evaluator:
    """Loads one checkpoint at a time and scores it with `evaluate_policy` (shared with train_ppo)."""

    def __init__(self, args: argparse.Namespace, strategy):
        from lightrft.experience.generation import rollout_generate_kwargs
        from lightrft.models import RewardModel
        from lightrft.rewards import make_reward_source

        self.args = args
        self.strategy = strategy
        self.reward_models = [RewardModel(p.strip(), value_head_prefix=args.value_head_prefix,
                                          normalize_reward=args.normalize_reward, bf16=args.bf16).eval()
                              for p in (args.reward_pretrain or "").split(",") if p.strip()]
        self.reward_sources = [make_reward_source(spec, timeout=args.reward_timeout, max_retries=args.reward_retries)
                               for spec in (args.remote_rm_url or "").split(",") if spec.strip()]
        self.generate_kwargs = rollout_generate_kwargs(args)      # the flags of a run's rollout section

    def load(self, checkpoint: Checkpoint):
        """(model, tokenizer, folder of its tokenizer and generation config) of one checkpoint;
        CheckpointReadError when a DeepSpeed checkpoint cannot be read or has no base model."""
        import torch

        from lightrft.models.families import load_model
        from lightrft.models.tokenizer import build_tokenizer
        from lightrft.serving.checkpoint_weights import CheckpointReadError, load_deepspeed_policy, require_complete

        args = self.args
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        if checkpoint.kind == "deepspeed":
            require_complete(checkpoint.path)
            base = args.pretrain or run_pretrain(args.ckpt_path)
            if base is None or not Path(base).is_dir():
                raise CheckpointReadError(f"{checkpoint.path}: a DeepSpeed checkpoint holds weights only; pass "
                                          f"--pretrain BASE_MODEL_FOLDER (the model the run started from, for its "
                                          f"config and tokenizer)" + (f"; the run's {base} is not a folder here"
                                                                      if base else ""))
            model = load_deepspeed_policy(checkpoint.path, base, dtype=dtype, trust_remote_code=args.trust_remote_code)
            source = str(base)
        else:
            source = str(checkpoint.path)
            try:
                model = load_model(source, dtype=dtype, trust_remote_code=args.trust_remote_code)
            except Exception as err:  # a torn or foreign folder raises many types (OSError, safetensors, ...)
                raise CheckpointReadError(f"{source}: not a loadable Hugging Face model ({type(err).__name__}: "
                                          f"{err})") from err
        return model, build_tokenizer(source, args.trust_remote_code, padding_side="left"), source

    def evaluate(self, checkpoint: Checkpoint) -> dict[str, float]:
        """Loads `checkpoint` and scores it (see `score`)."""
        return self.score(*self.load(checkpoint))

    def score(self, model, tokenizer, source: str) -> dict[str, float]:
        """The evaluation metrics of `model` on --eval_data; `source` is the folder of its
        tokenizer and generation config (for the stop tokens)."""
        from lightrft.datasets import PromptDataset
        from lightrft.models.tokenizer import stop_token_ids
        from lightrft.models.vocabulary import check_vocabulary, ids_in_data, vocabulary_rows
        from lightrft.models.families import family_of
        from lightrft.rollout.hf_engine import hf_engine_for
        from lightrft.serving.checkpoint_weights import CheckpointReadError
        from lightrft.rollout.manager import RolloutManager
        from lightrft.trainer.evaluation import evaluate_policy
        from lightrft.experience.services import build_rollout_services

        args = self.args
        model = model.to(self.strategy.device).eval()
        eos = stop_token_ids(tokenizer, source)
        # --micro_rollout_batch_size counts prompts here, each sampled --eval_n_samples times.
        engine = hf_engine_for(model, tokenizer, eos,
                               micro_batch_size=args.micro_rollout_batch_size * args.eval_n_samples,
                               family=family_of(model))
        # Generation and scoring alone (no experience is built); every evaluation seeds alike.
        services = build_rollout_services(
            RolloutManager(engine), tokenizer, self.strategy, prompt_max_len=args.prompt_max_len,
            micro_rollout_batch_size=args.micro_rollout_batch_size, apply_chat_template=args.apply_chat_template,
            reward_models=self.reward_models, reward_sources=self.reward_sources, eos_token_ids=eos, seed=args.seed)
        prompts = PromptDataset(args.eval_data, tokenizer, input_key=args.input_key, label_key=args.label_key,
                                apply_chat_template=args.apply_chat_template, prompt_max_len=args.prompt_max_len,
                                truncate_long_prompts=args.truncate_long_prompts)
        fed = None
        if len(tokenizer) > vocabulary_rows(model):
            fed = ids_in_data(prompts.token_ids(),
                              f"--eval_data {args.eval_data}")
        try:
            check_vocabulary(model, tokenizer, source, chat_template=args.apply_chat_template, fed=fed)
        except ValueError as err:
            raise CheckpointReadError(str(err)) from err
        dataloader = self.strategy.setup_dataloader(prompts, args.micro_rollout_batch_size, shuffle=False,
                                                    collate_fn=prompts.collate_fn, drop_last=False)
        return evaluate_policy(services, self.strategy, dataloader, self.generate_kwargs, k=args.eval_n_samples)


def write_results(rows: list[dict], output_dir: Path) -> list[Path]:
    """bench.csv, bench.md (a markdown table) and, where matplotlib imports, bench.png (each
    metric against the step). The tables are written first, so the results are kept when the plot
    cannot be drawn."""
    from lightrft.utils.trackers import markdown_table

    output_dir.mkdir(parents=True, exist_ok=True)
    columns = list(rows[0])
    with open(output_dir / "bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    (output_dir / "bench.md").write_text(markdown_table(columns, [list(r.values()) for r in rows]) + "\n")
    written = [output_dir / "bench.csv", output_dir / "bench.md"]
    try:
        import matplotlib
    except ImportError:
        print(f"bench: matplotlib is not installed, so no plot ({output_dir / 'bench.png'}); "
              'pip install "lightrft[plot]" to get it', file=sys.stderr, flush=True)
        return written
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [c for c in columns if c.startswith("eval/")]
    figure, axis = plt.subplots(figsize=(6, 4), dpi=100)
    steps = [r["step"] for r in rows]
    for name in metrics:
        axis.plot(steps, [r[name] for r in rows], marker="o", label=name)
    axis.set_xlabel("step")
    axis.set_ylabel("score")
    axis.set_title("evaluation per checkpoint")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(output_dir / "bench.png")
    plt.close(figure)
    return [*written, output_dir / "bench.png"]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("eval_n_samples", "generate_max_len", "micro_rollout_batch_size", "prompt_max_len"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    if not args.remote_rm_url and not args.reward_pretrain:
        parser.error("no reward source: pass --remote_rm_url (a rule such as math, a .py reward file or a reward "
                     "server URL) and/or --reward_pretrain")
    try:
        checkpoints, shadowed = find_checkpoints(args.ckpt_path, args.pretrain)
    except FileNotFoundError as err:
        parser.error(str(err))
    if not checkpoints:
        parser.error(f"--ckpt_path {args.ckpt_path} holds no checkpoint (no global_stepN_hf export, no "
                     "_actor/global_stepN DeepSpeed checkpoint): train with --save_steps N, or pass --pretrain "
                     "to evaluate one model")

    from lightrft.serving.checkpoint_weights import CheckpointReadError
    from lightrft.strategy import DeepspeedStrategy
    from lightrft.strategy.config import StrategyConfig

    strategy = DeepspeedStrategy(StrategyConfig(seed=args.seed, bf16=args.bf16))
    strategy.setup_distributed()
    for path in shadowed:
        strategy.print(f"bench: step {path.name.removeprefix('global_step')}: evaluating its Hugging Face export, "
                       f"not the DeepSpeed checkpoint {path}")
    evaluator = Evaluator(args, strategy)
    rows, skipped = [], []
    for checkpoint in checkpoints:
        # Every rank reads the same files, so a checkpoint fails to load on all ranks alike.
        try:
            logs = evaluator.score(*evaluator.load(checkpoint))
        except CheckpointReadError as err:
            skipped.append(str(err))
            strategy.print(f"bench: skipping step {checkpoint.step}: {err}")
            continue
        rows.append({"step": checkpoint.step, "checkpoint": str(checkpoint.path), **logs})
        strategy.print(f"bench: step {checkpoint.step} ({checkpoint.path}): "
                       + ", ".join(f"{k} {v:.4f}" for k, v in logs.items()))
    if not rows:
        strategy.close()
        raise SystemExit("bench: no checkpoint could be evaluated:\n  " + "\n  ".join(skipped))
    if strategy.is_rank_0():
        written = write_results(rows, Path(args.output_dir or args.ckpt_path))
        print((Path(args.output_dir or args.ckpt_path) / "bench.md").read_text(), end="")
        print("bench: wrote " + ", ".join(str(p) for p in written), flush=True)
    strategy.close()
    return rows


if __name__ == "__main__":
    run_program(main, sys.argv[1:])
