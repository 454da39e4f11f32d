"""The HTTP stack of `serve` and `serve_rm`: uvicorn runs a starlette application.

The libraries do the HTTP: uvicorn (its h11 protocol) parses and frames requests, keeps
connections alive, bounds header sizes and decodes chunked bodies; starlette routes, builds
responses and streams server-sent events; pydantic validates request bodies (in the servers'
own modules). What lightrft keeps is what they do not have:

- a deadline per request: a client has `--request_timeout` seconds to send a request's headers
  and body (an idle keep-alive connection counts as a request not yet sent). uvicorn's
  keep-alive timeout ends at a request's first byte, so a client sending one byte a second would
  hold a connection forever; `GuardedProtocol` closes it at the deadline, and `read_body`
  answers 408 when the body is late. A reply the client stops reading is cut after as long.
- connection bounds per client address and in all (`--max_connections_per_client`,
  `--max_connections`): one client holding hundreds of slow connections gets 503s for the ones
  over its share, while every other client is served;
- the API key (`Authorization: Bearer <key>` or basic authentication with the key as the
  password) on every route, the JSON-only content type, the body byte cap and strict JSON
  (`lightrft.serving.http.parse_json`), and error bodies in each server's own shape, framing
  errors found by h11 included;
- an error reply ends its connection, and a body refused before it was read is first drained
  briefly (`drain`), so the client reads the reply rather than a connection reset.

`HTTPServer` binds the socket when it is built (a taken port fails there), `serve_forever()`
runs uvicorn until `shutdown()` or SIGINT/SIGTERM, `server_address` is the bound address.
"""

import asyncio
import base64
import binascii
import gc
import hmac
import ipaddress
import logging
import signal
import socket
import sys
import threading
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from http import HTTPStatus
from typing import Any

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from lightrft.serving.http import API_KEY_ENV, HTTPSettings, RequestError, parse_json, shown
from lightrft.utils import json_out

logger = logging.getLogger("lightrft.serving.server")

ErrorBody = Callable[[RequestError], dict]
DEADLINE = "lightrft.deadline"   # scope["extensions"] keys: the loop time the request must have arrived by,
BODY_READ = "lightrft.body_read"  # and whether its body was read (all of it, or all that came in time)
MAX_HEADER_BYTES = 64 * 1024     # request line and headers (h11 answers 431 beyond)
LINGER_BYTES = 1024 * 1024       # an unread body drained after an early reply, so the reply is not lost
LINGER_SECONDS = 1.0
# A body's pieces (chunks, or parts of them as they arrive): past SMALL_PIECES of them, they must
# average MIN_PIECE_BYTES. Each costs the event loop a parse, so a body trickled in 1-byte chunks
# by a few clients would slow every other client's requests to a crawl.
SMALL_PIECES = 1024
MIN_PIECE_BYTES = 64
_JSON_TYPES = ("application/json",)


# ----------------------------------------------------------------------------------- replies
def json_response(status: int, payload: Any, headers: dict[str, str] | None = None) -> Response:
    """`payload` as JSON (a NaN or inf, such as a log-prob of -inf, as null)."""
    return Response(json_out.dumps(payload).encode(), status_code=status, headers=headers,
                    media_type="application/json")


def error_response(error: RequestError, error_body: ErrorBody) -> Response:
    """The JSON reply to a refused request; it ends the connection."""
    headers = {"Connection": "close"}
    if error.status == HTTPStatus.UNAUTHORIZED:
        headers["WWW-Authenticate"] = 'Bearer realm="lightrft"'
    return json_response(int(error.status), error_body(error), headers)


async def drain(scope, receive) -> None:
    """Reads and drops what is left of a refused request's body (at most LINGER_BYTES, for at most
    LINGER_SECONDS) before the reply: closing a connection with unread data resets it, and the
    client, still sending, would lose the reply."""
    if scope.get("extensions", {}).get(BODY_READ):
        return
    loop = asyncio.get_running_loop()
    end, drained = loop.time() + LINGER_SECONDS, 0
    while drained <= LINGER_BYTES:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, end - loop.time()))
        except (asyncio.TimeoutError, TimeoutError):
            return
        drained += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


async def refuse(error: RequestError, error_body: ErrorBody, scope, receive, send) -> None:
    """Answers `error` from ASGI middleware (a body left unread is drained first)."""
    await drain(scope, receive)
    await error_response(error, error_body)(scope, receive, send)


def _raw_response(status: int, body: bytes) -> bytes:
    """A whole HTTP/1.1 reply that closes the connection, for the protocol layer (no app runs)."""
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


# ------------------------------------------------------------------------------- the protocol
def client_key(host: str) -> str:
    """What the per-client bound counts a connection under: an IPv4 address, or the /64 network of
    an IPv6 one (one host holds a whole /64), an IPv4-mapped IPv6 address as its IPv4 address."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return host


REFUSAL_LOG_SECONDS = 10.0        # a client's refused connections are logged once in this time
REFUSED_OPEN = 256                # refused connections answered at once (each open for LINGER_SECONDS)


class ConnectionBook:
    """Connections admitted per client (`client_key`) and in all. A connection over either bound
    is answered 503 at once, unprompted, and closed LINGER_SECONDS later (it holds no slot for the
    request deadline); refused connections still open are counted, and past REFUSED_OPEN (or
    --max_connections, if more) of them a new one is dropped without a reply. Refusals are logged once per client every
    REFUSAL_LOG_SECONDS, with the number not logged."""

    def __init__(self, settings: HTTPSettings):
        self.settings = settings
        self.per_client: Counter[str] = Counter()
        self.total = 0
        self.refused_open = 0
        self.refused = 0                   # connections refused since the server started
        self._logged: dict[str, tuple[float, int]] = {}      # client -> (last logged, refused since)

    def log_refusal(self, key: str, why: str, now: float, counted: bool = True) -> None:
        """Logs a refusal (at most one message per client every REFUSAL_LOG_SECONDS); `counted`:
        a connection refused by the bounds (`refused`)."""
        self.refused += counted
        last, unlogged = self._logged.get(key, (float("-inf"), 0))
        if now - last < REFUSAL_LOG_SECONDS:
            self._logged[key] = (last, unlogged + 1)
            return
        more = f" ({unlogged} more from this client since the last message)" if unlogged else ""
        logger.warning("refused a connection: %s%s", why, more)
        self._logged[key] = (now, 0)

    def admit(self, host: str) -> str | None:
        """None when a connection from `host` is admitted (counted), else why not."""
        settings = self.settings
        if self.per_client[host] >= settings.max_connections_per_client:
            return (f"this client ({host}) already has {self.per_client[host]} connections open, the server's "
                    f"--max_connections_per_client {settings.max_connections_per_client}; reuse them (keep-alive) "
                    "or close some")
        if self.total >= settings.max_connections:
            return (f"the server has {self.total} connections open, its --max_connections "
                    f"{settings.max_connections}; retry shortly")
        self.per_client[host] += 1
        self.total += 1
        return None

    def release(self, host: str) -> None:
        self.per_client[host] -= 1
        if self.per_client[host] <= 0:
            del self.per_client[host]
        self.total -= 1


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with the request deadline, the connection bounds, a deadline on
    replies the client stops reading, and JSON bodies for the framing errors h11 finds. Built per
    server by `guarded_protocol` (class attributes `settings`, `book`, `error_body`)."""

    settings: HTTPSettings
    book: ConnectionBook
    error_body: ErrorBody

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        # TCP_NODELAY: a reply leaves as its headers and then its body; with Nagle's algorithm the body
        # waits for the client's delayed ACK of the headers, 40 ms on Linux, on every request of a
        # keep-alive connection (asyncio sets it only on sockets made with proto=IPPROTO_TCP).
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._host = client_key(self.client[0]) if self.client else "unknown"
        self._pieces = self._piece_bytes = 0
        self.conn.next_event = self._counted(self.conn.next_event)
        self._refusal = self.book.admit(self._host)
        self._admitted = self._refusal is None        # counted in the book until the connection ends
        self._timer = self._stall = None
        if not self._admitted:
            self._refuse_now()
            return
        self._arm()

    def _refuse_now(self) -> None:
        """A connection over a bound: its 503 goes out at once and it closes LINGER_SECONDS later
        (what the client sends meanwhile is read and dropped, so the reply is not reset away)."""
        book = self.book
        book.log_refusal(self._host, self._refusal, self.loop.time())
        if book.refused_open >= max(REFUSED_OPEN, self.settings.max_connections):    # a flood: no reply at all
            self.transport.abort()
            return
        book.refused_open += 1
        self._refused_open = True
        error = RequestError(self._refusal, None, HTTPStatus.SERVICE_UNAVAILABLE)
        self.transport.write(_raw_response(int(error.status), json_out.dumps(self.error_body(error)).encode()))
        self._timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if self._admitted:
            super().data_received(data)        # a refused connection's request is dropped unread

    def connection_lost(self, exc) -> None:
        for handle in (self._timer, self._stall):
            if handle is not None:
                handle.cancel()
        self._timer = self._stall = None
        if self._admitted:
            self.book.release(self._host)
            self._admitted = False
        if getattr(self, "_refused_open", False):
            self.book.refused_open -= 1
            self._refused_open = False
        super().connection_lost(exc)

    def _counted(self, next_event):
        """h11's `next_event`, counting the current request's body pieces: a body whose pieces
        average under MIN_PIECE_BYTES past SMALL_PIECES of them is answered 400 and its connection
        closed, and h11 is read no further (uvicorn's loop sees NEED_DATA and stops)."""
        def counted():
            if self.transport.is_closing():
                return h11.NEED_DATA
            event = next_event()
            if isinstance(event, h11.Request):
                self._pieces = self._piece_bytes = 0
            elif isinstance(event, h11.Data):
                self._pieces += 1
                self._piece_bytes += len(event.data)
                if self._pieces > SMALL_PIECES and self._piece_bytes < MIN_PIECE_BYTES * self._pieces:
                    self._refuse_tiny_pieces()
                    return h11.NEED_DATA
            return event
        return counted

    def _refuse_tiny_pieces(self) -> None:
        message = (f"the body arrived in {self._pieces} pieces of {self._piece_bytes / self._pieces:.1f} bytes on "
                   f"average; send it with a Content-Length, or in chunks of at least {MIN_PIECE_BYTES} bytes")
        body = json_out.dumps(self.error_body(RequestError(message, "Transfer-Encoding"))).encode()
        self.transport.write(_raw_response(400, body))
        self.transport.close()
        self.book.log_refusal(self._host, "its body came in tiny pieces", self.loop.time(), counted=False)

    # -------------------------------------------------------------------------- the deadline
    def _arm(self) -> None:
        """Starts the clock for the next request: its headers and body must arrive in time."""
        if self._timer is not None:
            self._timer.cancel()
        self._deadline = self.loop.time() + self.settings.request_timeout
        self._timer = self.loop.call_at(self._deadline, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if self.cycle is None or self.cycle.response_complete:
            # The request's headers have not all arrived (or an idle keep-alive connection).
            logger.info("%s: closed a connection whose request did not arrive within --request_timeout", self._host)
            self.transport.close()
        # Otherwise the app is reading the body against the same deadline, or answering.

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self.cycle is not None:   # a new request: the app reads its deadline
            self.cycle.scope.setdefault("extensions", {})[DEADLINE] = self._deadline

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    # ------------------------------------------------------- a reply the client does not read
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self.settings.request_timeout, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        logger.info("%s: closed a connection that read no reply for --request_timeout", self._host)
        self.transport.abort()

    # ------------------------------------------------------------------------ framing errors
    def send_400_response(self, msg: str) -> None:
        """h11 refused the request's framing (a malformed or conflicting Content-Length, an
        unsupported Transfer-Encoding, headers over the size cap): the reason as JSON."""
        error = sys.exc_info()[1]     # the h11.RemoteProtocolError being handled
        detail = str(error) if error is not None else msg
        status = getattr(error, "error_status_hint", 400)
        param = next((name for name in ("Content-Length", "Transfer-Encoding") if name in detail), None)
        hint = (f"{detail}: send one Content-Length of the body's bytes (or Transfer-Encoding: chunked)"
                if param else f"the request is not valid HTTP/1.1: {detail}")
        body = json_out.dumps(self.error_body(RequestError(hint, param, HTTPStatus(status)))).encode()
        self.transport.write(_raw_response(status, body))
        self.transport.close()


def guarded_protocol(settings: HTTPSettings, error_body: ErrorBody) -> type[GuardedProtocol]:
    """A `GuardedProtocol` class for one server (uvicorn builds one instance per connection)."""
    return type("GuardedProtocol", (GuardedProtocol,), {"settings": settings, "book": ConnectionBook(settings),
                                                        "error_body": staticmethod(error_body)})


# ---------------------------------------------------------------------------- request checks
def key_problem(headers, api_key: str | None) -> RequestError | None:
    """A 401 unless the request carries the server's key: `Authorization: Bearer <key>` (what
    OpenAI clients send) or basic authentication with the key as the password (what a
    `http://user:<key>@host/...` URL sends, e.g. train_ppo --remote_rm_url)."""
    if api_key is None:
        return None
    header = headers.get("authorization", "")
    scheme, _, credential = header.strip().partition(" ")
    given = None
    if scheme.lower() == "bearer":
        given = credential.strip().encode("latin-1", "replace")
    elif scheme.lower() == "basic":
        try:
            given = base64.b64decode(credential.strip(), validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            given = None
    if given is not None and hmac.compare_digest(given, api_key.encode("utf-8")):
        return None
    reason = "no API key was sent" if not header else "the API key is wrong"
    return RequestError(f"{reason}: send the server's key as 'Authorization: Bearer <key>' (the api_key of an OpenAI "
                        f"client; the server's --api_key or ${API_KEY_ENV})", "Authorization", HTTPStatus.UNAUTHORIZED)


async def read_body(request: Request, settings: HTTPSettings) -> bytes:
    """The request body, after checking its content type (415 unless `application/json` in
    UTF-8) and its size (411 without `Content-Length` or chunked framing, 413 over the cap, 408
    when it has not all arrived by the request's deadline)."""
    headers = request.headers
    content_type = headers.get("content-type")
    media, _, options = (content_type or "").partition(";")
    if content_type is None or media.strip().lower() not in _JSON_TYPES:
        raise RequestError(f"the body must be JSON sent as 'Content-Type: application/json', got "
                           f"{shown(content_type) if content_type else 'no Content-Type'}", "Content-Type",
                           HTTPStatus.UNSUPPORTED_MEDIA_TYPE)
    charset = next((value.strip().strip('"').lower() for name, _, value in
                    (part.partition("=") for part in options.split(";")) if name.strip().lower() == "charset"), None)
    if charset not in (None, "utf-8", "utf8"):
        raise RequestError(f"the body must be UTF-8, got charset {shown(charset)}", "Content-Type",
                           HTTPStatus.UNSUPPORTED_MEDIA_TYPE)
    length = headers.get("content-length")
    if length is None and headers.get("transfer-encoding") is None:
        raise RequestError("the request needs a Content-Length header (or a chunked body)", "Content-Length",
                           HTTPStatus.LENGTH_REQUIRED)
    limit = settings.max_body_bytes
    if length is not None and int(length) > limit:        # h11 has checked it is one number
        raise RequestError(f"the body is {int(length)} bytes, over this server's limit of {limit} bytes; send less "
                           "per request", "Content-Length", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    extensions = request.scope.setdefault("extensions", {})
    deadline = extensions.get(DEADLINE)
    loop = asyncio.get_running_loop()
    chunks, size = [], 0
    while True:
        left = None if deadline is None else max(0.0, deadline - loop.time())
        try:
            message = await asyncio.wait_for(request.receive(), left)
        except (asyncio.TimeoutError, TimeoutError):
            extensions[BODY_READ] = True               # all that came in time: nothing to drain
            raise RequestError(f"the body did not arrive within --request_timeout {settings.request_timeout:g} s",
                               "Content-Length", HTTPStatus.REQUEST_TIMEOUT) from None
        if message["type"] == "http.disconnect":
            extensions[BODY_READ] = True
            raise RequestError("the client closed the connection before sending its body", "Content-Length")
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            raise RequestError(f"the body is over this server's limit of {limit} bytes; send less per request",
                               "Content-Length", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        if not message.get("more_body", False):
            extensions[BODY_READ] = True
            return b"".join(chunks)


async def read_json(request: Request, settings: HTTPSettings) -> Any:
    """The request body as checked JSON (`parse_json`, in a worker thread: a 64 MB body does not
    stall the other clients)."""
    return await run_in_threadpool(parse_json, await read_body(request, settings))


# -------------------------------------------------------------------------------- the app
class KeyCheck:
    """ASGI middleware: every HTTP request carries the API key, or gets a 401 before routing."""

    def __init__(self, app, settings: HTTPSettings, error_body: ErrorBody):
        self.app, self.settings, self.error_body = app, settings, error_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.settings.api_key is not None:
            problem = key_problem(Request(scope).headers, self.settings.api_key)
            if problem is not None:
                await refuse(problem, self.error_body, scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(routes: list[Route], settings: HTTPSettings, error_body: ErrorBody, not_found: str):
    """A starlette app over `routes`: a `RequestError` raised by a route is answered with
    `error_body`, an unknown route with 404 (`not_found` says what there is), a failure nobody
    foresaw with a 500 naming its type; the server keeps serving after each."""

    async def request_error(request: Request, error: RequestError) -> Response:
        await drain(request.scope, request.receive)
        return error_response(error, error_body)

    async def no_route(request: Request, error: HTTPException) -> Response:
        status = HTTPStatus(error.status_code)
        return await request_error(request, RequestError(f"no {request.method} route {shown(request.url.path)}; "
                                                         f"{not_found}", None, status))

    async def crashed(request: Request, error: Exception) -> Response:
        logger.error("request to %s failed", request.url.path, exc_info=error)
        return await request_error(request, RequestError(f"the server could not answer this request: "
                                                         f"{type(error).__name__}", None,
                                                         HTTPStatus.INTERNAL_SERVER_ERROR))

    app = Starlette(routes=routes, exception_handlers={RequestError: request_error, 404: no_route, 405: no_route,
                                                       Exception: crashed})
    return KeyCheck(app, settings, error_body)


# ------------------------------------------------------------------------------- the server
def freeze_loaded_objects() -> None:
    """Leaves every object alive now (the model, its tokenizer, the imported libraries) out of the
    garbage collector's full passes (`gc.freeze`). Serving allocates enough to start a full pass
    every few seconds, and one over a loaded model took 0.24 s with every client waiting
    (benchmarks/serve_load.py: p99 latency with 32 clients 0.35 s, not 0.1 s). The commands call
    it once, after loading and before serving; a library process that frees models should not."""
    gc.collect()
    gc.freeze()


class _Server(uvicorn.Server):
    @contextmanager
    def capture_signals(self):
        """SIGINT and SIGTERM (a job scheduler, `kill`) stop serving cleanly; unlike uvicorn's own
        handling, the signal is not raised again afterwards, so the command exits with status 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class HTTPServer:
    """uvicorn serving `app` on (host, port) under `settings`; the socket is bound and listening
    once this is built (port 0 takes a free one: read it from `server_address`)."""

    def __init__(self, app, host: str, port: int, settings: HTTPSettings, error_body: ErrorBody):
        self.settings = settings
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
            self.socket.listen(settings.backlog)
        except OSError:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()
        protocol = guarded_protocol(settings, error_body)
        self.connections = protocol.book     # the admitted connections, per client address and in all
        config = uvicorn.Config(app, http=protocol, loop="asyncio", ws="none",
                                lifespan="off", interface="asgi3", log_config=None, log_level="warning",
                                access_log=False, proxy_headers=False, server_header=False,
                                timeout_keep_alive=settings.request_timeout, timeout_graceful_shutdown=5,
                                backlog=settings.backlog, h11_max_incomplete_event_size=MAX_HEADER_BYTES)
        self._uvicorn = _Server(config)
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        """Serves until `shutdown()` (or, in the main thread, SIGINT/SIGTERM)."""
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops serving (requests in progress get up to 5 s to finish) and waits for
        `serve_forever` to return."""
        self._uvicorn.should_exit = True
        self._stopped.wait(timeout)

    def server_close(self) -> None:
        self.socket.close()


__all__ = ["ConnectionBook", "GuardedProtocol", "HTTPServer", "build_app", "drain", "error_response",
           "freeze_loaded_objects", "guarded_protocol", "json_response", "key_problem", "read_body", "read_json"]
