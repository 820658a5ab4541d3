"""The collector's HTTP protocol on a listener bound the way `serve --workers N` binds it.

uvicorn binds that listener itself, with proto 0, and asyncio sets TCP_NODELAY only on connections
of IPPROTO_TCP sockets: before HeaderDeadlineProtocol set it, every keep-alive request to a
multi-process collector waited 40-44 ms for the client's delayed ACK (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from trainvitals.service.http_limits import HeaderDeadlineProtocol


async def _ok(scope: Scope, receive: Receive, send: Send) -> None:  # the smallest ASGI app
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def _server(protocol: type) -> Iterator[tuple[uvicorn.Server, int]]:
    sock = socket.socket(family=socket.AF_INET)  # as uvicorn's Config.bind_socket: proto 0
    sock.bind(("127.0.0.1", 0))
    assert sock.proto == 0
    config = uvicorn.Config(_ok, http=protocol, loop="asyncio", lifespan="off", log_config=None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield server, sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _server_side_nodelay(protocol: type) -> int:
    """TCP_NODELAY of the server's end of one keep-alive connection that answered a request."""
    with _server(protocol) as (server, port):
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            client.request("GET", "/")
            response = client.getresponse()
            assert (response.status, response.read()) == (200, b"ok")
            (connection,) = server.server_state.connections
            sock = connection.transport.get_extra_info("socket")  # type: ignore[attr-defined]
            return int(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        finally:
            client.close()


def test_connections_of_a_workers_listener_send_without_delay() -> None:
    assert _server_side_nodelay(HeaderDeadlineProtocol) == 1


def test_the_listener_reproduces_the_workers_path() -> None:
    """The control: uvicorn's own protocol on that listener leaves Nagle's algorithm on, so the
    test above sees the collector's protocol set the option, not asyncio."""
    assert _server_side_nodelay(HttpToolsProtocol) == 0


def _send_headers(port: int, header_bytes: int, body: bytes = b"") -> bytes:
    """A POST whose X-Pad header makes its request line and headers about `header_bytes` long,
    sent in 64 KiB writes; the reply, read until the server closes or answers."""
    head = f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nX-Pad: ".encode()
    request = head + b"a" * max(0, header_bytes - len(head) - 4) + b"\r\n\r\n" + body
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            for i in range(0, len(request), 65536):
                sock.sendall(request[i : i + 65536])
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed under us: the reply was sent before
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
            if reply.endswith(b"ok") or b"exceed" in reply:
                break
        return reply


def test_request_headers_past_the_limit_are_refused() -> None:
    """httptools has no header limit and grows a value by concatenation: a 16 MB header cost 1.4 s
    of the event loop. Past 64 KiB: 431 and the connection closed; the body is never counted."""
    with _server(HeaderDeadlineProtocol) as (_, port):
        refused = _send_headers(port, 4 << 20)
        assert refused.startswith(b"HTTP/1.1 431 ") and b"exceed 65536 bytes" in refused, refused[:200]
        assert _send_headers(port, 60_000).startswith(b"HTTP/1.1 200 ")
        # Headers under the limit with a large body in the same writes: served.
        assert _send_headers(port, 60_000, body=b"{" * (1 << 20)).startswith(b"HTTP/1.1 200 ")
    with _server(HttpToolsProtocol) as (_, port):  # the control: uvicorn's own protocol takes 4 MB
        assert _send_headers(port, 4 << 20).startswith(b"HTTP/1.1 200 ")
