"""What every lightrft command line shares: reading `--config FILE.yaml` under the flags, saving
the resolved config, the learning-rate schedule, the tracker, the closing summary line, and
`run_command` (user errors as messages, the launcher lifeline and the checkpoint-folder lock).
The flags themselves are generated from the typed run config (`lightrft.config`).
"""

import argparse
import json
import os
import sys

from lightrft.config.run import CONFIG_SECTIONS
from lightrft.utils import json_out


def parse_command_line(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parses `argv` on top of the `--config` file, if one is given: the file's values replace the
    defaults (so a required flag may come from the file), and flags on the command line win.
    Unknown keys and values of the wrong type are errors naming the file and the key."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=str, default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        parser.set_defaults(**_config_defaults(parser, known.config))
    return parser.parse_args(argv)


def parse_run_config(config_cls, parser: argparse.ArgumentParser, argv=None):
    """`config_cls` (a `lightrft.config.RunConfig`) of a command line, `--config FILE.yaml` first
    and flags over it; a bad option or combination exits through `parser.error`, naming it."""
    namespace = parse_command_line(parser, argv)
    try:
        return config_cls.from_namespace(namespace)
    except ValueError as err:
        parser.error(str(err))


def _config_defaults(parser: argparse.ArgumentParser, path: str) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.load(f, Loader=_yaml_loader()) or {}
    except OSError as err:
        parser.error(f"--config {path}: cannot read it ({err.strerror})")
    except UnicodeDecodeError as err:
        parser.error(f"--config {path}: byte {err.start} (0x{err.object[err.start]:02x}) is not UTF-8 text; save "
                     "the file as UTF-8")
    except yaml.YAMLError as err:
        parser.error(f"--config {path}: not valid YAML ({err})")
    if not isinstance(values, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values, got {type(values).__name__}")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    # Options may be flat (flag names) or nested under their section names (run_config.yaml).
    sections = parser.get_default(CONFIG_SECTIONS)
    items = []
    for key, value in values.items():
        if isinstance(value, dict) and str(key) not in actions:
            if sections is not None and str(key) not in sections:
                parser.error(f"--config {path}: {key!r} is no section of the options (sections: {', '.join(sections)}); "
                             "nest options under one of them, or write them flat by flag name")
            items.extend(value.items())
        else:
            items.append((key, value))
    defaults = {}
    for key, value in items:
        dest = str(key).lstrip("-").replace("-", "_")
        if dest in defaults:
            parser.error(f"--config {path}: --{dest} is given twice (flat and in a section, or in two sections); "
                         "keep one")
        action = actions.get(dest)
        if action is None:
            close = [d for d in actions if d.split("_")[0] == dest.split("_")[0]][:3]
            hint = f" (did you mean {', '.join('--' + d for d in close)}?)" if close else ""
            parser.error(f"--config {path}: unknown key {key!r}{hint}; keys are flag names without the leading --")
        try:
            defaults[dest] = _config_value(action, value)
        except (TypeError, ValueError):
            parser.error(f"--config {path}: key {key!r} has the value {value!r}, but --{dest} takes "
                         f"{_takes(action)} ({(action.help or '').replace('%%', '%')})")
        if _redacted_secret(dest, defaults[dest]):
            parser.error(f"--config {path}: key {key!r} holds a value lightrft redacted when it saved the run "
                         f"({value!r}): secrets are never written; pass --{dest} on the command line (or its "
                         "environment variable) with the real value")
        if action.choices is not None and defaults[dest] is not None and defaults[dest] not in action.choices:
            parser.error(f"--config {path}: key {key!r} must be one of {sorted(action.choices)}, got {value!r}")
        action.required = False       # the file provides it
    return defaults


def _yaml_loader():
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        """YAML's safe loader, refusing a mapping that repeats a key (YAML itself keeps the last
        one silently: an option written twice would take whichever came later)."""

        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} appears twice (lines {seen[key] + 1} and "
                                    f"{key_node.start_mark.line + 1}); keep one", key_node.start_mark)
                seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _redacted_secret(dest: str, value) -> bool:
    from lightrft.utils.secrets import holds_redacted, secret_flags

    return dest in secret_flags() and holds_redacted(value)


def _config_value(action: argparse.Action, value):
    """A YAML value as the flag would take it from the command line, after checking it against the
    flag's type: YAML values come typed, and converting them blindly would turn 2.9 and true into
    the integers 2 and 1, and a mapping into its text. Raises TypeError or ValueError for a value
    of the wrong type (`_takes` says what the flag takes)."""
    if value is None:
        if action.default is not None:       # null only where the option's default is null
            raise TypeError(value)
        return None
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise TypeError(value)
        return value
    if isinstance(action.nargs, int) or action.nargs in ("*", "+"):
        if not isinstance(value, (list, tuple)):
            if isinstance(action.nargs, int):
                raise TypeError(value)
            value = [value]          # one item of a list flag may be written without the list
        if isinstance(action.nargs, int) and len(value) != action.nargs:
            raise ValueError(value)
        return [_config_scalar(action.type, v) for v in value]
    return _config_scalar(action.type, value)


def _config_scalar(convert, value):
    """One YAML scalar for a flag of type `convert` (int, float, str or another text parser)."""
    if isinstance(value, (bool, dict, list, tuple)) or value is None:
        raise TypeError(value)
    if convert is int and isinstance(value, float):
        if not value.is_integer():
            raise ValueError(value)
        return int(value)
    if convert in (None, str):
        return str(value)
    if convert in (int, float):
        if not isinstance(value, (int, float, str)):
            raise TypeError(value)
        return convert(value)         # int("8"), float("2e-6") as on the command line; float(1)
    return convert(str(value))        # another parser of command-line text


def _takes(action: argparse.Action) -> str:
    """What a flag takes, in words: 'an integer', 'a list of 2 numbers' ..."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "true or false"
    one, many = {int: ("an integer", "integers"), float: ("a number", "numbers")}.get(
        action.type, ("a string", "strings"))
    if action.choices is not None:
        one = f"one of {sorted(action.choices)}"
    if isinstance(action.nargs, int):
        return f"a list of {action.nargs} {many}"
    if action.nargs in ("*", "+"):
        return f"a list of {many}"
    return one


def resolved_config(args) -> dict:
    """Every option of the run as plain YAML-able values (tuples as lists), flat by flag name."""
    from lightrft.config.run import plain_options

    return plain_options(args)


def announce_config(parser: argparse.ArgumentParser, args, strategy, ckpt_path: str | None) -> None:
    """Prints the options that differ from the defaults on rank 0 and writes the whole resolved
    config to `<ckpt_path>/run_config.yaml`, which `--config` reads back to repeat the run."""
    import yaml

    if not strategy.is_rank_0():
        return
    from lightrft.utils.secrets import redact_options

    config = resolved_config(args)
    changed = {k: v for k, v in config.items() if k != "config" and v != _plain(parser.get_default(k))}
    print("options: " + json.dumps(redact_options(changed), default=str, sort_keys=True), flush=True)
    if ckpt_path:
        # A refused resume must not rewrite the file: it would describe a run that never trained.
        from lightrft.trainer.run_services import check_resume_before_start

        check_resume_before_start(ckpt_path, args)
        os.makedirs(ckpt_path, exist_ok=True)
        target = os.path.join(ckpt_path, "run_config.yaml")
        tmp = target + ".tmp"
        nested = args.to_nested() if hasattr(args, "to_nested") else {k: v for k, v in config.items() if k != "config"}
        nested = redact_options(nested)      # secrets are never written; --config asks for them again
        with open(tmp, "w") as f:
            yaml.safe_dump(nested, f, sort_keys=False)
        os.replace(tmp, target)


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def print_summary(strategy, stop_reason, step: int, save_path: str, logs: dict, digits: int = 6,
                  extra: dict | None = None) -> None:
    """The one JSON line a training command ends with on rank 0: why it stopped, the step, where the
    model went, the last logged metrics, and `extra` (the health monitors' actions)."""
    if strategy.is_rank_0():
        summary = {k: round(v, digits) for k, v in logs.items() if isinstance(v, float)}
        print(json_out.dumps({"stop_reason": stop_reason or "finished", "step": step,
                          "save_path": os.path.abspath(save_path), **summary, **(extra or {})}), flush=True)


def run_command(prog: str, train_fn, args) -> None:
    """Runs a training command and turns the errors a user can fix (bad flags, paths, rows, reward
    sources) into one message on stderr and exit code 1, without a traceback from deep inside.
    `LIGHTRFT_TRACEBACK=1` shows the traceback too.

    Two run services start here, for every command: under torchrun a lifeline stops the rank when
    the launcher dies (`lightrft.utils.lifeline`), and rank 0 holds the lock on `--ckpt_path` for the
    whole run, so a second run writing into the same folder is refused (`lightrft.utils.run_lock`)."""
    from lightrft.agents.runner import WorkflowFailed
    from lightrft.models.hf_utils import ModelLoadError
    from lightrft.rewards.base import RewardSourceError
    from lightrft.rollout.checks import EngineSyncError
    from lightrft.utils.lifeline import lifeline_for_launcher
    from lightrft.utils.run_lock import RunLockError, checkpoint_folder_lock

    lifeline = lifeline_for_launcher(getattr(args, "preemption_grace", 600.0))
    try:
        with checkpoint_folder_lock(getattr(args, "ckpt_path", None), rank=int(os.environ.get("RANK", "0"))):
            train_fn(args)
    except (ValueError, FileNotFoundError, ModelLoadError, RewardSourceError, RunLockError, EngineSyncError,
            WorkflowFailed) as err:
        if os.environ.get("LIGHTRFT_TRACEBACK"):
            raise
        rank = os.environ.get("RANK")
        where = f"[rank {rank}] " if rank not in (None, "0") else ""
        print(f"{where}{prog}: error: {err}\n(set LIGHTRFT_TRACEBACK=1 to see where it was raised)",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        if lifeline is not None:
            lifeline.uninstall()
