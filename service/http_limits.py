"""What a client may cost the collector on the wire: a body size limit, a deadline for a request's
headers and one for its body.

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
from typing import Any

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# The lifespan state key through which the app tells the protocol its header deadline: Uvicorn
# builds the protocol with its own config only, and `serve --workers` builds the app in each process.
HEADER_TIMEOUT_KEY = "header_timeout_seconds"

log = logging.getLogger("trainvitals.serve")


class BodyLimit:
    """413 for a request whose declared body exceeds the limit, before any of it is read.

    Plain ASGI rather than @app.middleware("http"): Starlette's BaseHTTPMiddleware wraps every
    request in a task group and memory streams, a measurable cost at hundreds of batches a second.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                    response = JSONResponse(
                        {"detail": f"request body of {int(value)} bytes exceeds the limit of {self.max_bytes}"},
                        status_code=413,
                    )
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


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


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """Uvicorn's httptools protocol, closing a connection whose request line and headers are not
    complete within the app's header deadline (lifespan state `HEADER_TIMEOUT_KEY`; none: no deadline).

    Armed when the connection is made and when a keep-alive connection's next request begins (its
    idle time before that is `timeout_keep_alive`'s), never re-armed by trickled bytes.
    """

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        _no_delay(transport)
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_deadline()

    def on_headers_complete(self) -> None:
        self._disarm_header_deadline()
        super().on_headers_complete()

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
