"""What the two HTTP servers (`lightrft.cli.serve`, `lightrft.cli.serve_rm`) share against hostile
or careless clients.

- `BoundedHTTPServer`: a threading HTTP server with a listen backlog, a bound on the connections
  handled at once (more wait in the backlog) and a deadline per request: a client has
  `request_timeout` seconds to send the headers and body of each request (an idle keep-alive
  connection counts as a request not yet sent), so a slow client cannot hold a thread for long.
- `JSONRequestHandler`: the API key (`Authorization: Bearer <key>`, or HTTP basic authentication
  with the key as the password), the content type (`application/json` only: a web page can post
  `text/plain` or a form to any address without the browser asking, never JSON), a body read
  against a byte cap with a strictly checked `Content-Length`, and strict JSON (`parse_json`).
- `prompt_char_limit`: a character cap for texts that are tokenised, checked before tokenising.

A request that fails any check is answered with a 4xx naming the header or field
(`RequestError`); the server keeps serving.
"""

import base64
import binascii
import hmac
import io
import ipaddress
import json
import logging
import math
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lightrft.utils import json_out

logger = logging.getLogger("lightrft.serving.http")

API_KEY_ENV = "LIGHTRFT_API_KEY"
MAX_BODY_BYTES = 64 * 1024 * 1024
INT_LIMIT = 2**63          # integers in a request must lie in [-2**63, 2**63)
LINGER_BYTES = 1024 * 1024  # unread body drained after an early error reply, so the reply is not lost
LINGER_SECONDS = 1.0
_CONTENT_LENGTH = re.compile(r"[0-9]{1,19}")
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
    """How a server treats its clients (flags `--api_key`, `--request_timeout`, `--max_connections`)."""

    api_key: str | None = None        # None: every client is served
    request_timeout: float = 30.0     # seconds to send a request's headers and body; also per reply write
    max_connections: int = 64         # connections handled at once (one thread each)
    backlog: int = 128                # connections the kernel queues while all are busy
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self):
        if self.api_key is not None and not self.api_key:
            raise ValueError(f"--api_key is empty; give a key, or leave the flag and ${API_KEY_ENV} unset")
        if not (self.request_timeout > 0 and math.isfinite(self.request_timeout)):
            raise ValueError(f"--request_timeout must be a positive number of seconds, got {self.request_timeout}")
        if self.max_connections < 1:
            raise ValueError(f"--max_connections must be at least 1, got {self.max_connections}")
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
    parser.add_argument("--max_connections", type=int, default=64,
                        help="connections handled at once, one thread each; more wait until one closes")


def settings_from_flags(args) -> HTTPSettings:
    """`HTTPSettings` from the parsed flags of `add_http_flags`; the key falls back to $LIGHTRFT_API_KEY
    (an empty variable counts as unset)."""
    key = args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    return HTTPSettings(api_key=key, request_timeout=args.request_timeout, max_connections=args.max_connections)


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


# ------------------------------------------------------------------------------------ the server
class _DeadlineReader(io.RawIOBase):
    """The socket as a raw stream whose reads fail with `TimeoutError` once `deadline` (a
    `time.monotonic()` value, None for no deadline) has passed: a client sending one byte a
    second cannot stretch a request past it."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the client took too long to send its request")
            self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


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


class BoundedHTTPServer(ThreadingHTTPServer):
    """`ThreadingHTTPServer` with `settings.backlog` as its listen backlog and at most
    `settings.max_connections` connections handled at once: the accept loop waits for a free
    slot, and the connections that arrive meanwhile wait in the backlog."""

    daemon_threads = True
    block_on_close = False  # stopping the server does not wait for idle keep-alive connections

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], settings: HTTPSettings):
        self.settings = settings
        self.request_queue_size = settings.backlog
        self._slots = threading.BoundedSemaphore(settings.max_connections)
        self._closing = threading.Event()
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        while not self._slots.acquire(timeout=0.2):
            if self._closing.is_set():
                self.shutdown_request(request)
                return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: its slot is free again
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def shutdown(self) -> None:
        self._closing.set()
        super().shutdown()

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):  # the client went away or stalled mid-reply
            logger.info("%s: connection ended: %s", client_address[0], error)
        else:
            logger.exception("request from %s failed", client_address[0])


class JSONRequestHandler(BaseHTTPRequestHandler):
    """The checks both servers run before a request reaches them. Subclasses define `do_GET` /
    `do_POST` and `error_body(error)`, the JSON they answer a `RequestError` with; they call
    `check_api_key()` first, and `read_json()` for a POST body. `server` is a `BoundedHTTPServer`."""

    protocol_version = "HTTP/1.1"
    server: BoundedHTTPServer
    # TCP_NODELAY: a reply goes out as its headers and then its body; with Nagle's algorithm the
    # body waited for the client's delayed ACK of the headers, 40 ms on Linux, on every request
    # of a keep-alive connection (benchmarks/serve_load.py: 52 ms -> 6 ms per request for one client).
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced by a reader that enforces the request deadline
        self._reader = _DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self._reader)
        self.headers, self._body_read = None, False

    def handle_one_request(self) -> None:
        self._reader.deadline = time.monotonic() + self.server.settings.request_timeout
        self.headers, self._body_read = None, False
        super().handle_one_request()

    def send_response(self, code, message=None) -> None:
        # The request is read (or refused): the read deadline ends, the reply gets its own timeout.
        self._reader.deadline = None
        self.connection.settimeout(self.server.settings.request_timeout)
        super().send_response(code, message)

    def finish(self) -> None:
        if self.headers is not None and not self._body_read and self._declares_body():
            self._linger()
        super().finish()

    def _linger(self) -> None:
        """Reads and drops what is left of a body the server refused without reading: closing a
        socket with unread data resets it, and the client would lose the error reply."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            end, drained = time.monotonic() + LINGER_SECONDS, 0
            while drained < LINGER_BYTES and (left := end - time.monotonic()) > 0:
                self.connection.settimeout(left)
                chunk = self.connection.recv(65536)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass

    # ------------------------------------------------------------------------------- checks
    def _declares_body(self) -> bool:
        """Whether the request says a body follows (a malformed length counts as yes)."""
        length = (self.headers.get("Content-Length") or "0").strip()
        return self.headers.get("Transfer-Encoding") is not None or length != "0"

    def check_api_key(self) -> None:
        """401 unless the request carries the server's key: `Authorization: Bearer <key>` (what
        OpenAI clients send) or basic authentication with the key as the password (what a
        `http://user:<key>@host/...` URL sends, e.g. train_ppo --remote_rm_url)."""
        key = self.server.settings.api_key
        if key is None:
            return
        header = self.headers.get("Authorization", "")
        scheme, _, credential = header.strip().partition(" ")
        given = None
        if scheme.lower() == "bearer":
            given = credential.strip().encode("latin-1")
        elif scheme.lower() == "basic":
            try:
                given = base64.b64decode(credential.strip(), validate=True).partition(b":")[2]
            except (binascii.Error, ValueError):
                given = None
        if given is None or not hmac.compare_digest(given, key.encode("utf-8")):
            reason = "no API key was sent" if not header else "the API key is wrong"
            raise RequestError(f"{reason}: send the server's key as 'Authorization: Bearer <key>' (the api_key of an "
                               f"OpenAI client; the server's --api_key or ${API_KEY_ENV})", "Authorization",
                               HTTPStatus.UNAUTHORIZED)

    def read_json(self) -> Any:
        """The request body as checked JSON (`parse_json`), after checking its content type
        (415 unless `application/json`) and its length (411 without `Content-Length`, 400 for a
        malformed one, 413 over `max_body_bytes`, 408 when it does not arrive in time)."""
        content_type = self.headers.get("Content-Type")
        charset = self.headers.get_content_charset()
        if content_type is None or self.headers.get_content_type() != "application/json":
            raise RequestError(f"the body must be JSON sent as 'Content-Type: application/json', got "
                               f"{shown(content_type) if content_type else 'no Content-Type'}", "Content-Type",
                               HTTPStatus.UNSUPPORTED_MEDIA_TYPE)
        if charset not in (None, "utf-8", "utf8"):
            raise RequestError(f"the body must be UTF-8, got charset {shown(charset)}", "Content-Type",
                               HTTPStatus.UNSUPPORTED_MEDIA_TYPE)
        if self.headers.get("Transfer-Encoding") is not None:
            raise RequestError("send the body with a Content-Length header, not Transfer-Encoding", "Content-Length",
                               HTTPStatus.LENGTH_REQUIRED)
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            raise RequestError("the request needs a Content-Length header", "Content-Length",
                               HTTPStatus.LENGTH_REQUIRED)
        if len(lengths) > 1 or not _CONTENT_LENGTH.fullmatch(lengths[0].strip()):
            raise RequestError(f"bad Content-Length header {shown(', '.join(lengths))}: send one number of bytes",
                               "Content-Length")
        length = int(lengths[0])
        limit = self.server.settings.max_body_bytes
        if length > limit:
            raise RequestError(f"the body is {length} bytes, over this server's limit of {limit} bytes; send less per "
                               "request", "Content-Length", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        try:
            body = self.rfile.read(length)
        except TimeoutError:
            self._body_read = True  # as much as will come: nothing to drain
            raise RequestError(f"the body did not arrive within --request_timeout "
                               f"{self.server.settings.request_timeout:g} s", "Content-Length",
                               HTTPStatus.REQUEST_TIMEOUT) from None
        self._body_read = True
        if len(body) < length:
            raise RequestError(f"the body ended after {len(body)} of its {length} bytes (Content-Length)",
                               "Content-Length")
        return parse_json(body)

    # ------------------------------------------------------------------------------ replies
    def error_body(self, error: RequestError) -> dict:
        raise NotImplementedError

    def reply_json(self, status: HTTPStatus, payload: dict, headers: dict[str, str] | None = None) -> None:
        """`payload` as a JSON response with its length. An error reply also closes the
        connection: an unread or half-read body would corrupt the next request on it."""
        body = json_out.dumps(payload).encode()       # a NaN or inf (a log-prob of -inf) as null
        self.send_response(status)
        if status >= 400:
            self.close_connection = True
            self.send_header("Connection", "close")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def reply_error(self, error: RequestError) -> None:
        headers = {"WWW-Authenticate": 'Bearer realm="lightrft"'} if error.status == HTTPStatus.UNAUTHORIZED else None
        self.reply_json(error.status, self.error_body(error), headers)

    def log_message(self, format: str, *args) -> None:
        logger.info("%s %s", self.address_string(), format % args)
