"""What a client can hold of a real `trainvitals serve`, over real sockets (issue 15, items 6 and 7):
a connection trickling its headers or its body is cut off at its deadline, large bodies are
decoded a few at a time (the rest: 503 with Retry-After) and /healthz answers quickly meanwhile,
and the API's map is not served unless asked for."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HEADER_S, BODY_S = 1.0, 2.0
ENV = {
    "TRAINVITALS_HEADER_TIMEOUT_SECONDS": str(HEADER_S),
    "TRAINVITALS_BODY_TIMEOUT_SECONDS": str(BODY_S),
    "TRAINVITALS_RUN_ANALYSIS": "false",
    "TRAINVITALS_MAX_LARGE_BODIES": "2",
}


@pytest.fixture
def start(tmp_path: Path, unused_port: int, serve):
    """start(**env): a `trainvitals serve` on SQLite with these settings, stopped after the test."""
    procs = []

    def start(**env: str) -> int:
        log = tmp_path / "serve.log"
        procs.append(serve.start(f"sqlite:///{tmp_path / 'tv.db'}", unused_port, log, env={**ENV, **env}))
        return unused_port

    yield start
    for proc in procs:
        serve.stop(proc)


@pytest.fixture
def server(start) -> int:
    return start()


def _closed_after(sock: socket.socket, trickle: bytes, limit_s: float) -> tuple[float, bytes]:
    """Send `trickle` a byte every 0.2 s until the server closes the connection; (seconds, reply)."""
    start = time.monotonic()
    sock.settimeout(0.2)
    reply = b""
    for byte in trickle:
        assert time.monotonic() - start < limit_s, "still open"
        try:
            sock.send(bytes([byte]))
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        reply += chunk
        if not chunk:
            break
    return time.monotonic() - start, reply


def test_trickling_headers_or_body_is_cut_off(server: int) -> None:
    # Nothing sent at all: closed at the header deadline.
    with socket.create_connection(("127.0.0.1", server)) as idle:
        idle.settimeout(HEADER_S + 3)
        start = time.monotonic()
        assert idle.recv(10) == b""
        assert HEADER_S - 0.2 < time.monotonic() - start < HEADER_S + 1.5
    # Headers a byte at a time: closed at the header deadline, trickling does not extend it.
    with socket.create_connection(("127.0.0.1", server)) as slow:
        took, _ = _closed_after(slow, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 200, 6.0)
        assert took < HEADER_S + 1.5
    # Headers in time, the body a byte at a time: 408 at the body deadline, then closed.
    with socket.create_connection(("127.0.0.1", server)) as slow:
        slow.sendall(
            b"POST /v1/batches HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
        )
        took, reply = _closed_after(slow, b"{" + b" " * 400, 8.0)
        assert reply.startswith(b"HTTP/1.1 408 "), reply
        assert b"not received within 2 s" in reply and BODY_S - 0.3 < took < BODY_S + 2.0
    # A well-behaved client on a keep-alive connection is served as before.
    with urllib.request.urlopen(f"http://127.0.0.1:{server}/healthz", timeout=5) as resp:
        assert resp.status == 200


def test_large_bodies_are_bounded_and_healthz_stays_fast(start) -> None:
    server = start(TRAINVITALS_BODY_TIMEOUT_SECONDS="60")  # eight 12 MB uploads at once on a busy machine
    base = f"http://127.0.0.1:{server}"
    urllib.request.urlopen(urllib.request.Request(base + "/v1/runs", data=b'{"run": "r"}',
                           headers={"content-type": "application/json"}), timeout=10).close()  # fmt: skip
    # Near the limit and refused by the fast decoder: every record invalid (a negative step).
    records = [{"kind": "step", "step": -1, "ts": 1.0, "step_seconds": 0.25, "loss": float("nan")}] * 190_000
    body = json.dumps({"run": "r", "rank": 0, "incarnation": 1, "seq": 0, "records": records}).encode()
    assert len(body) > 12_000_000
    answers: list[tuple[int, str, str | None]] = []

    def post() -> None:
        req = urllib.request.Request(base + "/v1/batches", data=body, headers={"content-type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60).close()
        except urllib.error.HTTPError as exc:
            answers.append((exc.code, exc.read().decode()[:300], exc.headers.get("retry-after")))

    senders = [threading.Thread(target=post) for _ in range(8)]
    for t in senders:
        t.start()
    health: list[float] = []
    while any(t.is_alive() for t in senders):
        start = time.monotonic()
        with urllib.request.urlopen(base + "/healthz", timeout=10) as resp:
            assert resp.status == 200
        health.append(time.monotonic() - start)
        time.sleep(0.05)
    for t in senders:
        t.join()
    codes = sorted(code for code, _, _ in answers)
    assert len(answers) == 8 and set(codes) <= {422, 503} and 422 in codes, answers
    for code, text, retry_after in answers:
        if code == 422:  # the first error, named by its place
            assert "records.0.step" in text and "Expected `int` >= 0" in text, text
        else:
            assert retry_after == "1" and "large batches" in text and "retry" in text, text
    # Tens of ms when the machine is idle; under a load average of 14 on 2 cores, up to ~1.6 s was
    # seen (before the bound: 17 s, with the lax re-validation of every body on every thread).
    assert max(health) < 3.0, health
    metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    refused = {
        line.split('"')[1]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("trainvitals_ingest_refused_total{")
    }
    assert refused["busy_large"] == codes.count(503) and refused["invalid"] == codes.count(422)


def test_the_api_map_is_served_only_when_asked(server: int) -> None:
    for path in ("/docs", "/openapi.json"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{server}{path}", timeout=5)
        assert refused.value.code == 404
