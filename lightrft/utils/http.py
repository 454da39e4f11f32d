"""What the HTTP servers (`serve_rm`, `serve`) share: a JSON reply from a request handler."""

import json
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler


def send_json(handler: BaseHTTPRequestHandler, status: HTTPStatus, payload: dict) -> None:
    """Writes `payload` as a JSON response with its length. An error reply also closes the
    connection: an unread or half-read request body would corrupt the next request on it."""
    body = json.dumps(payload).encode()
    if status >= 400:
        handler.close_connection = True
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
