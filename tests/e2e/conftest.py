"""Fixtures of the end-to-end tests: `trainvitals serve` as a real process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


class Serve:
    """start(): `trainvitals serve` on db_url and port, returned once /healthz answers (its log
    raised otherwise); stop(proc): SIGTERM, then SIGKILL after 15 s."""

    def start(
        self, db_url: str, port: int, log: Path, *, auth: bool = False, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        extra = [] if auth else ["--insecure-no-auth"]
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [str(BIN / "trainvitals"), "serve", "--db", db_url, "--port", str(port), *extra],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                    return proc
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(log.read_text()) from None
                time.sleep(0.2)

    @staticmethod
    def stop(proc: subprocess.Popen[bytes]) -> None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def serve() -> Serve:
    return Serve()
