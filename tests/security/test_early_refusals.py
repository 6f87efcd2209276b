"""Refusals sent before the body is read (401 no key / no secret, 413 declared too large) leave
the connection open: the client reads the refusal and may go on using the connection.

Regression of the fuzz test's flake (`test_malformed_internal_messages_get_4xx[conductor]`, a
reset on `b'null'`, the first /v1 example, sent on a kept-alive connection without the API key):
the guards answered `connection: close` before the body had arrived. httpx writes headers and
body apart, Nagle holds the body until the server's ACK, which on a kept-alive connection rides
on the 401; the body then meets a socket closing with it unread, and that close is a reset that
can drop the unsent tail of the 401 (about 6 in 1,000 such requests, before the fix).
"""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI

from mooncake_server.api.openai_app import install_api_guard
from mooncake_server.api.security import PUBLIC_PATHS, PUBLIC_PREFIXES
from mooncake_server.wire.auth import OPEN_PATHS, SECRET_HEADER, SecretGuard
from mooncake_testkit.in_process import serve_app

KEY = "sk-early-refusals"
SECRET = "early-refusals-secret"
LIMIT = 64


def guarded_app() -> FastAPI:
    """An API role's two guards (as `app_for_role` stacks them) in front of /health only."""
    app = FastAPI()
    app.add_api_route("/health", lambda: {"status": "ok"})
    install_api_guard(app, api_key=KEY, secret=SECRET, max_body_bytes=LIMIT)
    app.add_middleware(SecretGuard, secret=SECRET, open_paths=OPEN_PATHS | PUBLIC_PATHS,
                       open_prefixes=PUBLIC_PREFIXES)
    return app


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """Status line and body of one HTTP/1.1 response with a Content-Length."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in lines
                  if line.lower().startswith("content-length:"))
    body = await asyncio.wait_for(reader.readexactly(length), timeout=5)
    return lines[0].encode(), body


@pytest.mark.parametrize("path,headers,body,status", [
    ("/v1/chat/completions", "", b"null", 401),
    ("/v1/chat/completions", f"Authorization: Bearer {KEY}\r\n", b"x" * (LIMIT + 1), 413),
    ("/internal/register", "", b"null", 401),
    ("/internal/register", f"{SECRET_HEADER}: wrong\r\n", b'{"instance_id": "x"}', 401),
], ids=["no-api-key", "declared-too-large", "no-secret", "wrong-secret"])
async def test_refusal_before_the_body_keeps_the_connection(path: str, headers: str, body: bytes,
                                                            status: int) -> None:
    """Headers first, the refusal comes back, only then the body, then a second request."""
    async with serve_app(guarded_app()) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         f"{headers}Content-Length: {len(body)}\r\n\r\n".encode())
            await writer.drain()
            # NOTE: the refusal arrives while the body is still unsent: the slow-client case.
            first, _ = await read_response(reader)
            assert first.startswith(b"HTTP/1.1 %d" % status), first
            writer.write(body + b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            await writer.drain()
            try:
                second, answer = await read_response(reader)
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                raise AssertionError(f"closed before the body was read (a reset for a slower "
                                     f"client): {exc!r}") from exc
            assert second.startswith(b"HTTP/1.1 200"), (second, answer)
        finally:
            writer.close()
