"""What the two HTTP servers (`lightrft.cli.serve`, `lightrft.cli.serve_rm`) share apart from the
HTTP stack itself (`lightrft.serving.server`: uvicorn and starlette):

- `HTTPSettings`: the API key, the request deadline, the connection bounds and the body cap, from
  the flags every server takes (`add_http_flags`);
- `parse_json`: strict JSON for request bodies (no NaN/Infinity, integers within 64 bits, no lone
  surrogates, bounded nesting and value counts), each refusal naming the field;
- `prompt_char_limit`: a character cap for texts that are tokenised, checked before tokenising;
- `address_problem`: whether (host, port) can be bound, checked before a model loads.

A request that fails any check is answered with a 4xx naming the header or field
(`RequestError`); the server keeps serving.
"""

import ipaddress
import json
import logging
import math
import os
import re
import socket
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

logger = logging.getLogger("lightrft.serving.http")

API_KEY_ENV = "LIGHTRFT_API_KEY"
MAX_BODY_BYTES = 64 * 1024 * 1024
INT_LIMIT = 2**63          # integers in a request must lie in [-2**63, 2**63)
_SURROGATE = re.compile("[\ud800-\udfff]")
_WHITESPACE = re.compile(r"[ \t\n\r]*")
SHOWN_CHARS = 60           # how much of a client's value an error message repeats
MAX_JSON_ITEMS = 1_000_000  # arrays, objects and commas in one request body (64 MB of `[{},...]`: 42M)
MAX_JSON_DEPTH = 32        # arrays and objects inside each other (an OpenAI request needs 4)
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')  # a JSON string, escapes included


class RequestError(ValueError):
    """A client mistake: answered with `status` and a message naming `param` (a header, or a
    field such as `messages[0].content`), never a server crash."""

    def __init__(self, message: str, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.param = param
        self.status = status


def shown(value: Any) -> str:
    """`repr(value)`, cut to a few dozen characters: error messages never echo a whole request."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


# ------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class HTTPSettings:
    """How a server treats its clients (flags `--api_key`, `--request_timeout`, `--max_connections`,
    `--max_connections_per_client`)."""

    api_key: str | None = None        # None: every client is served
    request_timeout: float = 30.0     # seconds to send a request's headers and body; also a stalled reply
    max_connections: int = 512        # connections open at once; more are answered 503
    max_connections_per_client: int = 128   # of them from one client address
    backlog: int = 1024               # connections the kernel queues before the server accepts them
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self):
        if self.api_key is not None and not self.api_key:
            raise ValueError(f"--api_key is empty; give a key, or leave the flag and ${API_KEY_ENV} unset")
        if self.api_key is not None and not all("!" <= c <= "~" for c in self.api_key):
            # Clients send it in a header, where white space around it is dropped and only
            # ASCII travels unchanged: such a key could never match.
            raise ValueError("the API key (--api_key or $" + API_KEY_ENV + ") holds white space or characters "
                             "outside printable ASCII, so no client could send it; use letters, digits and "
                             "punctuation only")
        if not (self.request_timeout > 0 and math.isfinite(self.request_timeout)):
            raise ValueError(f"--request_timeout must be a positive number of seconds, got {self.request_timeout}")
        if self.max_connections < 1:
            raise ValueError(f"--max_connections must be at least 1, got {self.max_connections}")
        if self.max_connections_per_client < 1:
            raise ValueError(f"--max_connections_per_client must be at least 1, got {self.max_connections_per_client}")
        if self.backlog < 1 or self.max_body_bytes < 1:
            raise ValueError(f"backlog and max_body_bytes must be positive, got {self.backlog}, {self.max_body_bytes}")


def add_http_flags(parser) -> None:
    """The flags of `HTTPSettings`, shared by serve and serve_rm."""
    parser.add_argument("--api_key", default=None,
                        help=f"key every request must carry (Authorization: Bearer KEY); default: ${API_KEY_ENV}, "
                             "which keeps the key out of the process list. Without one, anyone who can reach the "
                             "port is served")
    parser.add_argument("--request_timeout", type=float, default=30.0,
                        help="seconds a client has to send each request (headers and body); slower clients and idle "
                             "keep-alive connections are closed")
    parser.add_argument("--max_connections", type=int, default=512,
                        help="connections open at once; a request on one over the bound is answered 503")
    parser.add_argument("--max_connections_per_client", type=int, default=128,
                        help="connections open at once from one client address (so one client cannot hold them "
                             "all); behind a reverse proxy every client has the proxy's address, so raise it to "
                             "--max_connections there")


def settings_from_flags(args) -> HTTPSettings:
    """`HTTPSettings` from the parsed flags of `add_http_flags`; the key falls back to $LIGHTRFT_API_KEY.
    A variable set to nothing is an error, not "no key": a secret that failed to fill in would
    otherwise start a server that serves anyone."""
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if args.api_key is None and key is not None and not key.strip():
        raise ValueError(f"${API_KEY_ENV} is set but empty, which would serve every client; set it to the key, or "
                         "unset it to serve without one")
    return HTTPSettings(api_key=key, request_timeout=args.request_timeout, max_connections=args.max_connections,
                        max_connections_per_client=args.max_connections_per_client)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or "" (every interface): assume it is reachable from outside
        return False


def exposure_warning(host: str, settings: HTTPSettings, what: str) -> str | None:
    """The start-up warning for a server bound beyond loopback with no API key, else None."""
    if settings.api_key is not None or is_loopback(host):
        return None
    return (f"WARNING: listening on {host or 'every interface'} with no API key: anyone who can reach this port can "
            f"{what}. Set ${API_KEY_ENV} (or --api_key), or bind to 127.0.0.1 (--host).")


def warn_if_exposed(host: str, settings: HTTPSettings, what: str) -> None:
    """Logs `exposure_warning` (a WARNING reaches stderr even where logging is not set up)."""
    message = exposure_warning(host, settings, what)
    if message is not None:
        logger.warning(message)


# ---------------------------------------------------------------------------------- strict JSON
class _NonFinite(str):
    """What `parse_json` reads `NaN`, `Infinity` and `-Infinity` as, so the check names the field."""


class _HugeInt(int):
    """An integer literal too long to convert (Python refuses over 4300 digits): its digit count."""


def _parse_int(text: str) -> int:
    return int(text) if len(text) <= 40 else _HugeInt(len(text.lstrip("-")))


def _path(parent: str | None, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent or 'the request body'}[{key}]"
    return key if parent is None else f"{parent}.{key}"


def _problem(value: Any) -> str | None:
    """What is wrong with one parsed JSON scalar, or None."""
    if isinstance(value, _NonFinite):
        return f"is {value}; send a finite number"
    if isinstance(value, str):
        match = _SURROGATE.search(value)
        if match:
            return (f"holds a lone UTF-16 surrogate (\\u{ord(match.group()):04x} at character {match.start()}), "
                    "which is not Unicode text; send valid UTF-8")
        return None
    if isinstance(value, _HugeInt):
        return f"is an integer of {int(value)} digits; this server takes integers in [-2**63, 2**63)"
    if isinstance(value, int) and not isinstance(value, bool) and not -INT_LIMIT <= value < INT_LIMIT:
        return f"is an integer of {len(str(abs(value)))} digits; this server takes integers in [-2**63, 2**63)"
    if isinstance(value, float) and not math.isfinite(value):
        return f"is {value} (the number is too large for a float); send a finite number"
    return None


def json_items(body: bytes) -> int:
    """The `[`, `{` and `,` of a JSON text outside its strings (a bound on the values it holds, and
    on the objects parsing it builds). Counted on the bytes before parsing; strings are skipped
    only when the plain count is over MAX_JSON_ITEMS (commas inside texts)."""
    count = body.count(b",") + body.count(b"[") + body.count(b"{")
    if count <= MAX_JSON_ITEMS:
        return count
    bare = _JSON_STRING.sub(b"", body)
    return bare.count(b",") + bare.count(b"[") + bare.count(b"{")


def check_fields(payload: dict, allowed: frozenset[str], endpoint: str) -> None:
    """Refuses a field `endpoint` does not take (a misspelt option would otherwise be ignored)."""
    unknown = sorted(set(payload) - allowed)
    if unknown:
        raise RequestError(f"unknown field {shown(unknown[0])} for {endpoint}; it takes "
                           f"{', '.join(sorted(allowed))}", unknown[0][:SHOWN_CHARS])


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def validated(model: type, payload: Any, endpoint: str, hints: dict[str, str] | None = None):
    """`payload` (parsed by `parse_json`) validated by the pydantic `model` of `endpoint`, or a
    `RequestError` naming the first field that fails: a field the model does not have, a missing
    one, or a value of the wrong type or range. `hints` says, per field, what to send: added to
    "is missing", and instead of pydantic's message for a field of several shapes (where pydantic
    lists one failure per shape)."""
    from pydantic import ValidationError

    if not isinstance(payload, dict):
        raise RequestError(f"the request body must be a JSON object of {endpoint}'s fields, got "
                           f"{_json_type(payload)}")
    check_fields(payload, frozenset(model.model_fields), endpoint)
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        problem = error.errors(include_url=False)[0]
    loc = problem["loc"]
    hint = (hints or {}).get(loc[0])
    if problem["type"] == "missing":
        field = _loc_path(loc)
        raise RequestError(f"'{field}' is missing" + (f": it {hint}" if hint and len(loc) == 1 else ""), field)
    if hint is not None and len(loc) > 1 and isinstance(loc[1], str):   # one failure per shape of a union
        raise RequestError(f"'{loc[0]}' {hint}, got {shown(payload[loc[0]])}", str(loc[0]))
    field = _loc_path(loc)
    message = problem["msg"]
    raise RequestError(f"'{field}': {message[:1].lower()}{message[1:]}, got {shown(problem['input'])}", field)


def _loc_path(loc: tuple) -> str:
    """("messages", 0, "content") as "messages[0].content"."""
    path = None
    for key in loc:
        path = _path(path, key)
    return path or "the request body"


def _check_tree(value: Any) -> None:
    """Walks a parsed body without recursion and refuses, naming the field: NaN/Infinity, floats
    that overflowed to inf, integers outside 64 bits, strings (and keys) with lone surrogates,
    containers more than MAX_JSON_DEPTH deep. Paths are built only for containers and for the
    value refused."""
    if not isinstance(value, (dict, list)):
        if (problem := _problem(value)) is not None:
            raise RequestError(f"the request body {problem}")
        return
    stack = [(value, None, 1)]
    while stack:
        item, path, depth = stack.pop()
        for key, child in item.items() if isinstance(item, dict) else enumerate(item):
            if isinstance(key, str) and (problem := _problem(key)) is not None:
                raise RequestError(f"a key of {f'{path!r}' if path else 'the request body'} {problem}", path)
            if isinstance(child, (dict, list)):
                field = _path(path, key)
                if depth >= MAX_JSON_DEPTH:
                    raise RequestError(f"'{field}' nests JSON arrays or objects more than {MAX_JSON_DEPTH} deep; "
                                       "send a flatter value", field)
                stack.append((child, field, depth + 1))
            elif (problem := _problem(child)) is not None:
                field = _path(path, key)
                raise RequestError(f"'{field}' {problem}", field)


def _too_deep_field(text: str) -> str | None:
    """The top-level key whose value nests too deeply for the JSON parser (None when the body is
    not an object or the key cannot be found): decodes the object one member at a time."""
    decoder = json.JSONDecoder()
    i = _WHITESPACE.match(text, 0).end()
    if not text.startswith("{", i):
        return None
    i += 1
    while True:
        i = _WHITESPACE.match(text, i).end()
        try:
            key, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        i = _WHITESPACE.match(text, i).end()
        if not text.startswith(":", i):
            return None
        i = _WHITESPACE.match(text, i + 1).end()
        try:
            _, i = decoder.raw_decode(text, i)
        except RecursionError:
            return key if isinstance(key, str) else None
        except ValueError:
            return None
        i = _WHITESPACE.match(text, i).end()
        if not text.startswith(",", i):
            return None
        i += 1


def parse_json(body: bytes) -> Any:
    """The JSON value of a request body, or a `RequestError` (400) naming the field: the body must be
    UTF-8, nest no deeper than Python's parser allows, hold no NaN/Infinity, no number that does not
    fit a float or a 64-bit integer, and no lone UTF-16 surrogate escape (`"\\ud800"`)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not valid JSON: it is not UTF-8 (byte {e.start}: "
                           f"{e.reason})") from None
    items = json_items(body)
    if items > MAX_JSON_ITEMS:
        # Parsing 64 MB of `[{},{},...]` would build ten million objects (gigabytes, a minute of CPU).
        raise RequestError(f"the request body has {items:,} JSON arrays, objects and commas, over this server's "
                           f"limit of {MAX_JSON_ITEMS:,}; send fewer values per request", None,
                           HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    try:
        value = json.loads(text, parse_constant=_NonFinite, parse_int=_parse_int)
    except RecursionError:
        field = _too_deep_field(text)
        where = f"'{field}' nests" if field else "the request body nests"
        raise RequestError(f"{where} JSON arrays or objects too deeply to parse; send a flatter value",
                           field) from None
    except ValueError as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    _check_tree(value)
    return value


# ------------------------------------------------------------------------------ prompt size cap
def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` stands for (its longest vocabulary entry,
    special tokens included): a text of T tokens has at most T times this many characters."""
    return max(1, max((len(token) for token in tokenizer.get_vocab()), default=1))


def prompt_char_limit(tokens: int, token_chars: int) -> int:
    """Characters a text may have and still fit in `tokens` tokens of a tokenizer whose longest
    token is `token_chars` characters: the cap checked before tokenising."""
    return tokens * token_chars


# ------------------------------------------------------------------------------------ the socket
def address_problem(host: str, port: int) -> str | None:
    """Why a server cannot listen on (host, port) right now (the port is taken, the address is not
    this machine's), or None. The commands check it before loading a model, so a busy port costs
    no load; binding can still fail in the moment between, which they report the same way."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)      # as the server binds
        try:
            probe.bind((host, port))
        except OSError as err:
            return bind_error(host, port, err)
    return None


def bind_error(host: str, port: int, err: OSError) -> str:
    return (f"cannot listen on --host {host} --port {port}: {err.strerror or err}; stop the process that holds "
            "the port or pick another --port (0 takes any free port, printed at start)")
