"""How a message reaches the collector: one POST, HTTP/1.1 keep-alive, standard library only."""

from __future__ import annotations

import http.client
import urllib.parse
from typing import NamedTuple, Protocol


class Reply(NamedTuple):
    """The collector's answer: its status and body (a refusal's body says why: docs/agent.md)."""

    status: int
    body: bytes = b""


class Transport(Protocol):
    """What the delivery needs from the network; tests and custom setups pass their own."""

    def post(self, path: str, body: bytes, timeout: float) -> Reply:
        """POST JSON; return the collector's reply, raise OSError when it is unreachable."""
        ...


class HttpTransport:
    """Keep-alive HTTP/1.1 to one collector (the agent imports torch and pydantic only).

    Usage::

        transport = HttpTransport("http://collector:8000", token="tv_...")
        reply = transport.post("/v1/batches", body, timeout=5.0)
        transport.close()
    """

    def __init__(self, base_url: str, token: str | None = None) -> None:
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"collector URL must be http(s)://host[:port], got {base_url!r}")
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname
        self._port = parsed.port or (443 if self._https else 80)
        self._prefix = parsed.path.rstrip("/")
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._conn: http.client.HTTPConnection | None = None

    def post(self, path: str, body: bytes, timeout: float) -> Reply:
        for attempt in (0, 1):  # one silent retry: a keep-alive connection may have been closed
            conn = self._connection(timeout)
            try:
                conn.request("POST", self._prefix + path, body=body, headers=self._headers)
                resp = conn.getresponse()
                return Reply(resp.status, resp.read())
            except (http.client.HTTPException, OSError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=timeout)
        else:
            self._conn.timeout = timeout
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
