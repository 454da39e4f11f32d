"""Secrets in a run's options, and the one redaction applied wherever options become text or files.

An option holds a secret by its kind, marked on its config field (`option(..., secret=KIND)`,
lightrft.config.options) or, for the serving flags, in `SERVING_SECRET_FLAGS`:

- "key": the whole value is a secret (`--use_wandb KEY`, `--api_key KEY`), except the plain words
  the flag also takes (`--use_wandb offline`);
- "urls": the value may hold URLs with credentials (`--remote_rm_url http://user:KEY@host/...,
  judge:https://host/v1?api_key=KEY`): their user info and query values are replaced.

Every writer of options goes through here: the `options:` line and `run_config.yaml`
(`redact_options`), the checkpoint's pinned options, the tracker's config (W&B, TensorBoard), and
the command line a lock file records (`redact_argv`). A redacted value is written as `***`;
`--config` refuses a file whose secret option still holds one, naming the flag to pass again.
"""

import re
import urllib.parse
from collections.abc import Mapping, Sequence

REDACTED = "***"
# The flags of `serve` and `serve_rm` (plain argparse, not a run config) that hold secrets.
SERVING_SECRET_FLAGS = {"api_key": "key"}
# Values of a "key" flag that are not secrets.
PLAIN_WORDS = {"use_wandb": {"offline", "online"}}
KINDS = ("key", "urls")

# A URL runs to white space or a comma (the separator of URL lists). Quotes may be in a password
# (`http://rm:s3'cret@host`), so they do not end one: in a quoted repr the closing quote joins the
# path, which is harmless; ending there would have left the password after it.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s,]+")
_FLAG = re.compile(r"--?(?P<name>[A-Za-z0-9_-]+)(?:=(?P<value>.*))?$", re.DOTALL)


def redact_url(url: str) -> str:
    """The URL with its user info and every query value replaced by `***`, and no fragment. The
    user info is everything before the last "@" after the scheme, so a password holding "/",
    "?" or "#" unescaped (which would end the host for a URL parser) is redacted whole too."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        url = scheme + sep + REDACTED + "@" + rest.rsplit("@", 1)[1]
    parts = urllib.parse.urlsplit(url)
    query = "&".join(f"{key}={REDACTED}" for key, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, query, ""))


def redact_text(value):
    """`value` with every URL in it redacted (`redact_url`); values that are not text pass."""
    if not isinstance(value, str):
        return value
    return _URL.sub(lambda match: redact_url(match.group(0)), value)


_SECRET_FLAGS: dict[str, str] = dict(SERVING_SECRET_FLAGS)


def register_secret_flags(section: type) -> None:
    """Records the fields of a config section whose `option` has a `secret` kind (the run
    configs' sections call this as they are defined, lightrft.config.sections)."""
    import dataclasses

    for f in dataclasses.fields(section):
        if f.metadata.get("secret"):
            _SECRET_FLAGS[f.name] = f.metadata["secret"]


def secret_flags() -> dict[str, str]:
    """Flag name -> secret kind: the registered config fields and `SERVING_SECRET_FLAGS`."""
    return dict(_SECRET_FLAGS)


def secret_flag(spelling: str) -> str | None:
    """The secret flag a command line's flag spelling stands for: its name, or an abbreviation
    argparse accepts (`--use_wan` for --use_wandb, `--api_ke` for --api_key); None for none. A
    spelling that abbreviates a secret flag counts as it (a "key" flag first where it abbreviates
    several) even where the parser would read another flag by it: a value redacted once too often
    is harmless, one written out is not."""
    name = spelling.replace("-", "_")
    if name in _SECRET_FLAGS:
        return name
    matches = sorted((kind != "key", flag) for flag, kind in _SECRET_FLAGS.items()
                     if len(name) >= 2 and flag.startswith(name))
    return matches[0][1] if matches else None


def redact_value(flag: str, value):
    """The value of `--flag` as it may be written: by the flag's secret kind, and with URL
    credentials removed from any text (a secret in an option that is not marked is still caught
    when it is a URL's)."""
    kind = secret_flags().get(flag)
    if isinstance(value, (list, tuple)):
        return [redact_value(flag, v) for v in value]
    if kind == "key" and value is not None and value is not False and str(value) not in PLAIN_WORDS.get(flag, ()):
        return REDACTED
    return redact_text(value)


def redact_options(options: Mapping) -> dict:
    """A copy of flat options (flag name -> value), or of options nested by section, that is safe
    to print and write."""
    return {key: redact_options(value) if isinstance(value, Mapping) else redact_value(str(key), value)
            for key, value in options.items()}


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A command line that is safe to record: the value after (or `=` in) a secret flag is
    redacted by its kind, and URL credentials anywhere."""
    out, pending = [], None
    for arg in argv:
        if pending is not None:
            out.append(redact_value(pending, arg))
            pending = None
            continue
        match = _FLAG.match(arg)
        name = secret_flag(match.group("name")) if match else None     # an abbreviation too
        if name is not None:
            if match.group("value") is None:
                out.append(arg)
                pending = name
            else:
                out.append(arg[: match.start("value")] + str(redact_value(name, match.group("value"))))
            continue
        out.append(redact_text(arg))
    return out


def holds_redacted(value) -> bool:
    """Whether a value read back (from a saved run_config.yaml) still holds a redaction."""
    if isinstance(value, (list, tuple)):
        return any(holds_redacted(v) for v in value)
    return isinstance(value, str) and REDACTED in value
