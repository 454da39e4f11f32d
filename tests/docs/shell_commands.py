"""Reads lightrft commands out of shell text (recipes in scripts/, bash blocks in docs/) and checks
them against the command-line parsers, without running anything.

The shell subset understood is what the recipes and docs use: `NAME=value` assignments (optionally
`export`ed), `${NAME:-default}` / `${NAME-default}` / `${NAME}` / `$NAME` expansions, `"$@"`,
backslash line continuations, comments, quoting, and pipes/redirections/`&`/`&&` that end a
command. Anything else that would change the words of a command (command substitution, arithmetic
expansion) raises `ShellSyntaxError`, so a recipe cannot silently be checked wrongly.
"""

import argparse
import contextlib
import importlib
import io
import re
import shlex
from dataclasses import dataclass, field

CLI_PACKAGE = "lightrft.cli."
ELISION = "..."  # a word standing for flags left out of an example
_ASSIGNMENT = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")


class ShellSyntaxError(ValueError):
    """Shell text this reader does not understand; the message names the line."""


class CliCheckError(ValueError):
    """A parser error raised instead of argparse's print-and-exit."""


@dataclass
class CliCommand:
    module: str  # "lightrft.cli.train_ppo"
    argv: list[str]  # the words after `-m module`
    launcher: list[str]  # the words before `-m` (torchrun / python and their options)
    line: int  # 1-based line where the command starts in the source text
    env: dict[str, str] = field(default_factory=dict)  # shell variables in effect at that line

    @property
    def cli_name(self) -> str:
        return self.module[len(CLI_PACKAGE):]

    def launcher_option(self, name: str, default: str | None = None) -> str | None:
        """The value of `--name V` or `--name=V` among the launcher words."""
        for i, word in enumerate(self.launcher):
            if word == name and i + 1 < len(self.launcher):
                return self.launcher[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
        return default

    @property
    def world_size(self) -> int:
        """Ranks the launcher starts: nnodes x nproc_per_node for torchrun, 1 for plain python."""
        if not any(word.endswith("torchrun") or word == "torch.distributed.run" for word in self.launcher):
            return 1
        nnodes = self.launcher_option("--nnodes", "1")
        nproc = self.launcher_option("--nproc_per_node", "1")
        try:
            return int(nnodes) * int(nproc)
        except ValueError:
            raise ShellSyntaxError(f"line {self.line}: torchrun --nnodes {nnodes!r} --nproc_per_node {nproc!r} "
                                   "must be whole numbers (a fixed or elastic range is not supported here)") from None


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each logical line: backslash-newline continuations joined,
    whole-line comments, blank lines and here-document bodies (`<<'EOF'` ... `EOF`) dropped."""
    result, pending, start, heredoc_end = [], "", 0, None
    for number, line in enumerate(text.splitlines(), start=1):
        if heredoc_end is not None:
            if line.strip() == heredoc_end:
                heredoc_end = None
            continue
        if not pending:
            start = number
            if line.lstrip().startswith("#"):
                continue
        if line.endswith("\\") and not line.endswith("\\\\"):
            pending += line[:-1] + " "
            continue
        joined = pending + line
        pending = ""
        if joined.strip():
            result.append((start, joined))
            heredoc = _HEREDOC.search(joined)
            if heredoc:
                heredoc_end = heredoc.group(2)
    if pending.strip():
        result.append((start, pending))
    return result


def expand(text: str, env: dict[str, str], line: int = 0, unset: str | None = None) -> str:
    """Expands variables outside single quotes, as bash would for the subset described above.
    An unset variable without a default is an error (the recipes set every variable they use),
    or, when `unset` is given, becomes `unset.format(name=NAME)` (docs may use `$MODEL` freely)."""
    # "$@" (the script's own arguments) is no words at all when the script is read without any.
    text = re.sub(r'"\$[@*]"', "", text)
    out, i, quote = [], 0, None
    while i < len(text):
        ch = text[i]
        if quote == "'":
            out.append(ch)
            quote = None if ch == "'" else quote
            i += 1
            continue
        if ch == "\\" and i + 1 < len(text):
            out.append(text[i:i + 2])
            i += 2
            continue
        if ch in "'\"":
            if quote is None:
                quote = ch
            elif quote == ch:
                quote = None
            out.append(ch)
            i += 1
            continue
        if ch == "`":
            raise ShellSyntaxError(f"line {line}: command substitution with backquotes is not supported: {text!r}")
        if ch != "$":
            out.append(ch)
            i += 1
            continue
        value, i = _expand_dollar(text, i, env, line, unset)
        out.append(value)
    return "".join(out)


def _expand_dollar(text: str, i: int, env: dict[str, str], line: int, unset: str | None) -> tuple[str, int]:
    """Expands the `$...` starting at text[i]; returns (value, index after it)."""
    rest = text[i + 1:]
    if rest.startswith("(("):
        raise ShellSyntaxError(f"line {line}: arithmetic expansion $((...)) is not supported; write the number: "
                               f"{text!r}")
    if rest.startswith("("):
        raise ShellSyntaxError(f"line {line}: command substitution $(...) is not supported: {text!r}")
    if rest[:1] in ("@", "*"):
        return "", i + 2
    if rest.startswith("{"):
        end = rest.find("}")
        if end < 0:
            raise ShellSyntaxError(f"line {line}: unclosed ${{ in {text!r}")
        body = rest[1:end]
        match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)(.*))?", body)
        if match is None:
            raise ShellSyntaxError(f"line {line}: unsupported expansion ${{{body}}}; use ${{NAME}} or ${{NAME:-default}}")
        name, op, default = match.groups()
        value = env.get(name)
        if op == ":-" and not value:
            value = expand(default, env, line, unset)
        elif op == "-" and value is None:
            value = expand(default, env, line, unset)
        if value is None and unset is not None:
            value = unset.format(name=name)
        if value is None:
            raise ShellSyntaxError(f"line {line}: ${name} is not set and has no default")
        return value, i + 2 + end
    match = _NAME.match(rest)
    if match is None:
        return "$", i + 1
    name = match.group(0)
    if name not in env and unset is not None:
        return unset.format(name=name), i + 1 + len(name)
    if name not in env:
        raise ShellSyntaxError(f"line {line}: ${name} is not set and has no default")
    return env[name], i + 1 + len(name)


def split_words(text: str) -> list[str]:
    """Shell words with quotes removed; operators (| & ; < > and their pairs) are separate words."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return list(lexer)


def _is_operator(word: str) -> bool:
    return bool(word) and all(ch in "|&;<>()" for ch in word)


def extract_cli_commands(text: str, env: dict[str, str] | None = None, unset: str | None = None) -> list[CliCommand]:
    """Every `... -m lightrft.cli.NAME args` command in `text`, with variables expanded.

    `env` holds variables set before the text runs (the caller's environment): `NAME=${NAME:-x}`
    keeps a value given there, as in bash. `unset` is the stand-in for unset variables (see
    `expand`); without it they are an error."""
    env = dict(env or {})
    commands = []
    for line, raw in logical_lines(text):
        expanded = expand(raw, env, line, unset)
        words = split_words(expanded)
        assignment = _ASSIGNMENT.match(expanded.strip())
        if assignment and len(words) == 1 + expanded.strip().startswith("export "):
            env[assignment.group(1)] = words[-1].split("=", 1)[1]
            continue
        commands += _commands_in_words(words, line, env)
    return commands


def _commands_in_words(words: list[str], line: int, env: dict[str, str]) -> list[CliCommand]:
    commands, start = [], 0
    for i, word in enumerate(words):
        if _is_operator(word):
            start = i + 1
            continue
        if word == "-m" and i + 1 < len(words) and words[i + 1].startswith(CLI_PACKAGE):
            argv = []
            for j in range(i + 2, len(words)):
                if _is_operator(words[j]):
                    break
                # `2>&1`: the file-descriptor number belongs to the redirection, not to the command.
                if words[j].isdigit() and j + 1 < len(words) and words[j + 1][:1] in ("<", ">"):
                    break
                argv.append(words[j])
            commands.append(CliCommand(words[i + 1], argv, words[start:i], line, dict(env)))
    return commands


@dataclass
class RecipeRun:
    script: str  # "scripts/grpo_qwen2.5_7b.sh", as written
    env: dict[str, str]  # NAME=value words before `bash`
    args: list[str]  # the words after the script: extra flags for its command
    line: int


_RECIPE = re.compile(r"^scripts/[\w.+-]+\.sh$")


def extract_recipe_runs(text: str, unset: str | None = None) -> list[RecipeRun]:
    """Every `[NAME=value ...] bash scripts/X.sh [args]` in `text`."""
    runs = []
    for line, raw in logical_lines(text):
        words = split_words(expand(raw, {}, line, unset))
        for i, word in enumerate(words):
            if not _RECIPE.match(word) or i == 0 or words[i - 1] != "bash":
                continue
            start = i - 1
            while start > 0 and _ASSIGNMENT.match(words[start - 1]) and not _is_operator(words[start - 1]):
                start -= 1
            env = dict(w.split("=", 1) for w in words[start:i - 1])
            args = []
            for extra in words[i + 1:]:
                if _is_operator(extra):
                    break
                args.append(extra)
            runs.append(RecipeRun(word, env, args, line))
    return runs


def load_cli_parser(module_name: str) -> tuple[object, argparse.ArgumentParser]:
    """The CLI module and a fresh parser from its `build_parser()`, set to raise `CliCheckError`
    instead of exiting, and to accept only exact flag names (no abbreviations)."""
    module = importlib.import_module(module_name)
    if not hasattr(module, "build_parser"):
        raise CliCheckError(f"{module_name} has no build_parser(); every lightrft CLI must expose one")
    parser = module.build_parser()
    parser.allow_abbrev = False

    def error(message: str):
        raise CliCheckError(message)

    parser.error = error
    return module, parser


def check_cli_command(command: CliCommand, validate: bool = True) -> list[str]:
    """Problems with `command` as its CLI would see them: a flag the parser does not have, a value
    it rejects, or a combination its `validate_args` (and, for torchrun launches, its world-size
    and gradient-accumulation checks) refuses. An empty list means the command is accepted.
    A command with a `...` word is an elided example: only its flags and their values are checked."""
    where = f"line {command.line}: python -m {command.module}"
    try:
        module, parser = load_cli_parser(command.module)
    except ModuleNotFoundError as err:
        return [f"{where}: no such CLI module ({err})"]
    argv = command.argv
    if ELISION in argv:
        # An elided example (`train_ppo ... --remote_rm_url URL`): the flags shown must exist and
        # take the values shown; the missing ones cannot be judged, so neither can the combination.
        argv = [word for word in argv if word != ELISION]
        for action in parser._actions:  # argparse has no public way to relax `required`
            action.required = False
        validate = False
    try:
        args, unknown = parser.parse_known_args(argv)
    except CliCheckError as err:
        return [f"{where}: {err}"]
    if unknown:
        return [f"{where}: unknown flag(s) {' '.join(unknown)}; see `python -m {command.module} --help`"]
    if not validate:
        return []
    problems = []
    try:
        if hasattr(module, "validate_args"):
            module.validate_args(parser, args)
        elif hasattr(module, "parse_args"):
            _run_parse_args(module, command.argv)
        if hasattr(module, "check_world_size"):
            module.check_world_size(args.rollout_batch_size, command.world_size)
        if hasattr(args, "train_batch_size") and hasattr(args, "micro_train_batch_size"):
            from lightrft.strategy.ds_config import gradient_accumulation_steps

            gradient_accumulation_steps(args.train_batch_size, args.micro_train_batch_size, command.world_size)
    except (CliCheckError, ValueError) as err:
        problems.append(f"{where} ({command.world_size} ranks): {err}")
    return problems


def _run_parse_args(module, argv: list[str]) -> None:
    """Runs a CLI's own `parse_args(argv)` (parsing plus its start-up checks), turning its
    print-and-exit on a bad combination into `CliCheckError` with the printed message."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            module.parse_args(argv)
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            message = stderr.getvalue().strip().splitlines()
            raise CliCheckError(message[-1] if message else f"parse_args exited with {exit_.code}") from None


def parse_cli_command(command: CliCommand) -> argparse.Namespace:
    """The namespace the CLI's parser makes of `command` (raises `CliCheckError` on a bad flag)."""
    _, parser = load_cli_parser(command.module)
    return parser.parse_args(command.argv)
