"""Writes docs/configuration.md, the reference of every command-line flag, from the CLIs' own parsers.

    python tools/gen_config_docs.py            # rewrite docs/configuration.md
    python tools/gen_config_docs.py --check    # exit 1 if docs/configuration.md is out of date

Each CLI module exposes `build_parser()`, which builds the full parser without heavy imports; this
script renders one section per CLI and one table per argument group (flag, value, default, help),
so the page changes exactly when a flag, default or help text does. tests/docs/test_config_docs.py
runs the check.
"""

import argparse
import importlib
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
OUTPUT = REPO_ROOT / "docs" / "configuration.md"
CLI_MODULES = ("train_ppo", "train_sft", "train_rm", "serve_rm", "doctor", "serve", "bench")
REGENERATE = "python tools/gen_config_docs.py"

INTRO = f"""# Configuration reference

Every flag of the lightrft command lines, grouped as `--help` groups them. This page is generated
from the parsers by `{REGENERATE}`; do not edit it by hand (a test fails when it
is out of date).

Flags follow OpenRLHF's names where OpenRLHF has the flag, so its recipes port. Batch sizes count
as in OpenRLHF: `--rollout_batch_size` prompts per rollout over all ranks, `--train_batch_size`
samples per optimizer step over all ranks, `--micro_*_batch_size` samples per rank per forward;
gradient accumulation is derived (see [recipes](recipes.md) for worked arithmetic). The formulas
behind the algorithm flags are in [algorithms](algorithms.md).

## One typed config, three ways to set it

Every flag is a field of a frozen dataclass in `lightrft.config` (`PPORunConfig`, `SFTRunConfig`,
`RMRunConfig`, made of the sections below: `distributed`, `model`, `rollout`, `algorithm`,
`optim`, `data`, `rewards`, `logging`, `checkpoint`). The parsers are generated from those
fields, so a default lives in one place, and the same checks run for a command line, a file and
Python code (an impossible combination is refused at start-up with the flags named).

- **Flags**: `--temperature 0.7`.
- **A YAML file**: `--config run.yaml` reads option values, flat by flag name or nested by
  section; flags on the command line override it. A mistyped key or a value of the wrong type
  names the file and the key.

  ```yaml
  pretrain: ./models/qwen2.5-0.5b
  rollout:
    temperature: 0.7
    generate_max_len: 512
  algorithm:
    advantage_estimator: group_norm
    n_samples_per_prompt: 8
  ```

- **Python**: `PPORunConfig(model=PPOModelConfig(pretrain=...), ...)`, or `parse_args(argv)`; see
  [extending](extending.md). `train(config)` runs it, and
  `PPOTrainer.from_config(strategy, models, config, ...)` builds a trainer from it.

Each run prints the options that differ from the defaults at start-up and writes the whole
resolved config to `<ckpt_path>/run_config.yaml` (nested by section), which `--config` reads back
to repeat the run; every PPO checkpoint also carries it in its client state.
"""


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _value(action: argparse.Action) -> str:
    """What the flag takes: nothing (a switch), a choice, or a typed value with its arity."""
    if action.nargs == 0:
        return "switch"
    if action.choices is not None:
        value = " \\| ".join(f"`{c}`" for c in action.choices)
    elif action.metavar is not None and isinstance(action.metavar, tuple):
        value = " ".join(action.metavar)
    else:
        value = getattr(action.type, "__name__", None) or "str"
    if action.nargs == "?":
        return f"optional {value}"
    if action.nargs == "*":
        return f"{value} ..."
    if action.nargs == "+":
        return f"{value} [...]"
    if isinstance(action.nargs, int) and action.nargs > 1 and not isinstance(action.metavar, tuple):
        return " ".join([value] * action.nargs)
    return value


def _default(action: argparse.Action) -> str:
    if action.required:
        return "**required**"
    if action.nargs == 0:
        return "off" if action.default in (False, None) else "on"
    if action.default is None:
        return "none"
    if isinstance(action.default, (list, tuple)):
        return "`" + " ".join(str(v) for v in action.default) + "`"
    return f"`{action.default}`"


def _help(action: argparse.Action, prog: str) -> str:
    """The help text as `--help` prints it: `%(default)s`-style fields filled in, `%%` as `%`."""
    params = {k: v for k, v in dict(vars(action), prog=prog).items() if v is not argparse.SUPPRESS}
    params = {k: getattr(v, "__name__", v) for k, v in params.items()}
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    text = (action.help or "") % params
    if action.nargs == "?" and action.const is not None:
        text += f" (bare flag: `{action.const}`)"
    return _cell(text)


# Commands that take every train_ppo flag: only their own flags are listed.
EXTENDS_TRAIN_PPO = ("doctor",)


def render_cli(name: str, parser: argparse.ArgumentParser, inherited: frozenset = frozenset()) -> str:
    lines = [f"## {name}", "", f"`{parser.prog} [flags]`", ""]
    description = (parser.description or "").strip().split("\n\n")[0]
    if description:
        lines += [" ".join(description.split()), ""]
    if inherited:
        lines += ["Takes every [train_ppo](#train_ppo) flag, and these:", ""]
    # argparse keeps its groups in `_action_groups`; there is no public accessor.
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.help != argparse.SUPPRESS
                   and not isinstance(a, argparse._HelpAction) and a.dest not in inherited]
        if not actions:
            continue
        title = group.title if group.title not in ("options", "optional arguments") else "other"
        lines += [f"### {name}: {title}", ""]
        if group.description:
            lines += [_cell(group.description), ""]
        lines += ["| flag | value | default | description |", "|---|---|---|---|"]
        for action in actions:
            flags = ", ".join(f"`{s}`" for s in action.option_strings)
            lines.append(f"| {flags} | {_value(action)} | {_default(action)} | {_help(action, parser.prog)} |")
        lines.append("")
    return "\n".join(lines)


def render() -> str:
    """The whole page, for the CLI modules present in this checkout (missing ones are named on stderr)."""
    sys.path.insert(0, str(REPO_ROOT))
    sections, contents = [], []
    for name in CLI_MODULES:
        try:
            module = importlib.import_module(f"lightrft.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"lightrft.cli.{name}":
                raise
            print(f"gen_config_docs: lightrft.cli.{name} is not in this checkout; its section is left out",
                  file=sys.stderr)
            continue
        contents.append(f"- [{name}](#{name})")
        inherited = frozenset()
        if name in EXTENDS_TRAIN_PPO:
            from lightrft.cli import train_ppo

            inherited = frozenset(a.dest for a in train_ppo.build_parser()._actions)
        sections.append(render_cli(name, module.build_parser(), inherited))
    return "\n".join([INTRO, *contents, "", *sections]).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="where the page goes")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date with the CLI parsers; regenerate it with `{REGENERATE}`",
                  file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
