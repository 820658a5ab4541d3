"""What a real `trainvitals serve` logs: where it listens, which database (password hidden),
whether auth is on, an ingest summary while batches arrive, and never a token: not from the
access log, not from refusals, not from a token put where it does not belong (a query string)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def _post(url: str, body: object, token: str) -> int:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {token}"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_serve_logs_its_setup_and_traffic_and_never_a_token(
    empty_pg_url: str, unused_port: int, tmp_path: Path, serve
) -> None:
    # The test server trusts every password: one in the URL shows that the log hides it.
    db_url = empty_pg_url.replace("postgres@", "postgres:s3cr3t-pw@")
    token = subprocess.run(
        [str(BIN / "trainvitals"), "token", "create", "--db", db_url, "--project", "llm", "--scope", "ingest"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    log = tmp_path / "serve.log"
    env = {"TRAINVITALS_LOG_SUMMARY_SECONDS": "1", "TRAINVITALS_LOG_LEVEL": "debug",  # debug: every request
           "TRAINVITALS_MAX_BODY_SIZE": "1"}  # misspelt: said, not ignored in silence  # fmt: skip
    proc = serve.start(db_url, unused_port, log, auth=True, env=env)
    base = f"http://127.0.0.1:{unused_port}"
    try:
        assert _post(base + "/v1/runs", {"run": "a", "project": "llm", "parallelism": {"world_size": 1}}, token) == 201
        for seq in range(3):
            records = [{"kind": "step", "step": seq, "ts": 1.0 + seq, "step_seconds": 0.5}]
            batch = {"run": "a", "rank": 0, "incarnation": 1, "seq": seq, "records": records}
            assert _post(base + "/v1/batches", batch, token) == 200
        assert _post(base + "/v1/batches", {"run": "a"}, token[:-1] + "x") == 401  # a near miss
        assert _post(base + f"/v1/batches?token={token}", {"run": "a"}, "nonsense") == 401
        deadline = time.monotonic() + 30
        expected = {"batches": 3, "records": 3, "refused_unauthenticated": 2}
        while _summed(log.read_text()) != expected or " event=analyse " not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    finally:
        serve.stop(proc)

    text = log.read_text()
    assert token not in text and token[:-1] not in text and "s3cr3t-pw" not in text, text
    assert "Traceback" not in text, text
    lines = text.splitlines()
    assert all(re.match(r"ts=\S+Z level=\w+ logger=\S+ pid=\d+ ", line) for line in lines), text
    startup = next(line for line in lines if " event=serve " in line)
    assert f" listen=http://127.0.0.1:{unused_port} " in startup
    assert f" db=postgresql+psycopg://postgres:***@127.0.0.1:5432/{empty_pg_url.rsplit('/', 1)[1]} " in startup
    assert " auth=on " in startup and " analysis=process " in startup
    assert " ingest_commit=async " in startup  # PostgreSQL: acknowledged before the WAL flush (the default)
    assert " ingest_group_wait_ms=5 " in startup  # PostgreSQL's writers wait for a fuller group (the default)
    assert any(" event=analyse " in line for line in lines)  # the child process says where it analyses
    misspelt = [line for line in lines if " event=unknown_setting " in line]
    assert len(misspelt) == 1 and " level=warning logger=trainvitals.serve " in misspelt[0], text  # not the child too
    assert misspelt[0].endswith(
        ' msg="TRAINVITALS_MAX_BODY_SIZE (did you mean TRAINVITALS_MAX_BODY_BYTES?): ignored, it sets nothing"'
    )
    summary = next(line for line in lines if " event=ingest_summary " in line)
    assert re.search(r" window_s=\d+ batches=\d+ records=\d+ duplicates=0 refused=\d+ .*queue_records=0 ", summary)
    assert any(" event=http " in line and " status=200" in line for line in lines)  # at debug level
    assert any("path=\"/v1/batches?token=***\"" in line for line in lines), text


def _summed(text: str) -> dict[str, int]:
    """batches, records and 401 refusals over every summary line (a window may split them)."""
    out = {"batches": 0, "records": 0, "refused_unauthenticated": 0}
    for line in text.splitlines():
        if " event=ingest_summary " in line:
            for key in out:
                m = re.search(rf" {key}=(\d+)", line)
                out[key] += int(m[1]) if m else 0
    return out
