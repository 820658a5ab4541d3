"""What a client may cost the collector on the wire: body size limits, a size limit and a deadline
for a request's headers and a deadline for its body.

Uvicorn closes idle keep-alive connections (`timeout_keep_alive`) and can refuse connections past
a count (`limit_concurrency`), but it has no read timeout: a client that sends its headers or its
body a byte at a time holds a connection (and a request task) for as long as it likes. Here the
headers must be complete within `header_timeout_seconds` of a request's first byte (or of the
connection, for a request that never starts): `HeaderDeadlineProtocol`, the protocol `serve`
hands Uvicorn. The body must be complete within `body_timeout_seconds` of its headers:
`BodyDeadline`, ASGI middleware, answered 408 and the connection closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any, cast

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from trainvitals.service.api.ingest_fast_path import INGEST_PATH
from trainvitals.service.logs import QuietAccessLogger

# The lifespan state key through which the app tells the protocol its header deadline: Uvicorn
# builds the protocol with its own config only, and `serve --workers` builds the app in each process.
HEADER_TIMEOUT_KEY = "header_timeout_seconds"

log = logging.getLogger("trainvitals.serve")


SMALL_BODY_BYTES = 1 << 20
"""The body limit of every route but a batch's (a registration, an advisor's log)."""


class BodyLimit:
    """413 for a request whose body exceeds its route's limit: `max_bytes` for a batch,
    `SMALL_BODY_BYTES` (or `max_bytes`, if smaller) for any other route.

    A declared body is refused before any of it is read; a chunked one, which declares no length,
    when it passes the limit (the batch route counts its own chunks: no wrapper on its hot path).
    Plain ASGI rather than @app.middleware("http"): Starlette's BaseHTTPMiddleware wraps every
    request in a task group and memory streams, a measurable cost at hundreds of batches a second.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        batch = scope["path"] == INGEST_PATH
        limit = self.max_bytes if batch else min(self.max_bytes, SMALL_BODY_BYTES)
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                detail = f"request body of {int(value)} bytes exceeds the limit of {limit} bytes"
                response = JSONResponse({"detail": detail}, status_code=413)
                await response(scope, receive, send)
                return
        if batch:
            await self.app(scope, receive, send)
            return
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # raised into the route that reads the body, answered as FastAPI's own
                    raise HTTPException(413, f"request body exceeds the limit of {limit} bytes")
            return message

        await self.app(scope, receive_within_limit, send)


class BodyDeadline:
    """408 (and the connection closed) when a request's body is not complete within `seconds`.

    The deadline is on the whole body, not on the gap between chunks: a client trickling a byte
    every second would pass any idle timeout. 60 s carries the 32 MB limit at about 4 Mbit/s.
    """

    def __init__(self, app: ASGIApp, *, seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        complete = False

        async def receive_by_deadline() -> Message:
            nonlocal complete
            if complete:  # after the body, receive() only waits for a disconnect: no deadline
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                # Raised into the route that reads the body; FastAPI answers it like its own.
                raise HTTPException(
                    408,
                    f"request body not received within {self.seconds:g} s: nothing stored",
                    headers={"Connection": "close"},
                ) from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, receive_by_deadline, send)


MAX_HEADER_BYTES = 64 * 1024
"""A request line and headers past this: 431 and the connection closed. The agent's requests carry
well under 1 KiB; nginx's default allows 4 x 8 KiB."""

_HEADERS_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s"
)


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """Uvicorn's httptools protocol, closing a connection whose request line and headers are not
    complete within the app's header deadline (lifespan state `HEADER_TIMEOUT_KEY`; none: no deadline)
    or pass `MAX_HEADER_BYTES`.

    The deadline is armed when the connection is made and when a keep-alive connection's next
    request begins (its idle time before that is `timeout_keep_alive`'s), never re-armed by trickled
    bytes. The size matters because httptools has no limit of its own and grows a header value by
    concatenation: a 16 MB header cost 1.4 s of the event loop. It is checked before each read is
    parsed (a read is at most 256 KiB), so a read that ends the headers and starts the body is never
    refused for the body's bytes.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Uvicorn calls only `info` on it (logs.py, QuietAccessLogger).
        self.access_logger = cast(logging.Logger, QuietAccessLogger(self.access_logger))

    _header_timer: asyncio.TimerHandle | None = None
    _header_bytes: int | None = 0
    """Bytes read of the current request's line and headers; None while its body is read."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        _no_delay(transport)
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self._header_bytes is not None:
            if self._header_bytes > MAX_HEADER_BYTES:
                self._headers_too_large()
                return
            self._header_bytes += len(data)
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_deadline()

    def on_headers_complete(self) -> None:
        self._disarm_header_deadline()
        self._header_bytes = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._header_bytes = 0  # the next request on this connection starts with its headers

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        seconds: Any = self.app_state.get(HEADER_TIMEOUT_KEY)
        if self._header_timer is None and seconds:
            self._header_timer = self.loop.call_later(float(seconds), self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_large(self) -> None:
        self._disarm_header_deadline()
        if not self.transport.is_closing():
            log.debug("closing a connection whose request headers passed %d bytes: %s", MAX_HEADER_BYTES, self.client)
            message = f"request line and headers exceed {MAX_HEADER_BYTES} bytes".encode()
            self.transport.write(_HEADERS_TOO_LARGE % (len(message), message))
            self.transport.close()

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.debug("closing a connection whose request headers did not arrive in time: %s", self.client)
            self.transport.close()


def _no_delay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on the connection's socket, whoever bound the listener.

    asyncio sets it only on sockets whose `proto` is IPPROTO_TCP, and the listener that uvicorn
    binds for `serve --workers N` is created with proto 0, so its accepted connections kept Nagle's
    algorithm: a response goes out as two writes (head, body), the second waited for the client's
    delayed ACK, and every keep-alive request took 40-44 ms instead of 1 (docs/performance.md)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
