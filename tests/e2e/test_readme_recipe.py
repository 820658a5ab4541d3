"""The README's copy-paste recipe, run as it is written there: a real `trainvitals serve`, real
tokens made by `trainvitals token create --project llm`, a training job with the two lines and no
project of its own, then `/metrics` with the read token. The block is read from README.md, so
the README cannot drift from what works.

Two things differ from a user's terminal, both outside the block's text: the collector's port
(8000 may be taken on a shared machine: TRAINVITALS_PORT and the URLs in the block point at a
free one) and the spool directory (per test, so no other run's leftovers are delivered)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from trainvitals.service.store import db
from trainvitals.service.store.models import Run, StepRow

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- recipe: the block below is run by tests/e2e/test_readme_recipe.py -->"
pytestmark = pytest.mark.slow


def recipe() -> str:
    text = README.read_text()
    assert MARKER in text, "the README lost its recipe marker"
    block = re.search(r"```bash\n(.*?)\n```", text[text.index(MARKER) :], re.S)
    assert block is not None
    return block.group(1)


def test_the_readme_recipe_delivers_every_step_to_the_tokens_project(tmp_path: Path, unused_port: int) -> None:
    script = recipe()
    assert "--project llm" in script and "project=" not in script  # the attach names no project
    script = script.replace("127.0.0.1:8000", f"127.0.0.1:{unused_port}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINVITALS_")}
    env |= {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",  # python, trainvitals: the venv's
        "TRAINVITALS_PORT": str(unused_port),
        "TRAINVITALS_SPILL_DIR": str(tmp_path / "spool"),
    }
    # Its own process group: the collector the block leaves running (and its analysis child) is
    # stopped with it.
    proc = subprocess.Popen(
        ["bash", "-e", "-c", script], cwd=tmp_path, env=env, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        _stop_group(proc)
    assert proc.returncode == 0, out + err + (tmp_path / "collector.log").read_text()
    assert 'trainvitals_run_latest_step{run="quickstart"} 49.0' in out, out
    assert 'trainvitals_run_info{project="llm",run="quickstart"' in out, out
    assert "trainvitals agent:" not in err, err  # nothing refused, nothing left undelivered

    engine = db.make_engine(f"sqlite:///{tmp_path / 'trainvitals.db'}")
    with engine.connect() as conn:
        runs = {r.run_id: r.project for r in conn.execute(select(Run.run_id, Run.project))}
        steps = sorted(conn.execute(select(StepRow.step).where(StepRow.run_id == "llm/quickstart")).scalars())
    engine.dispose()
    assert runs == {"llm/quickstart": "llm"}  # the project's own run id (store/run_keys.py)
    assert steps == list(range(50))
    assert not any((tmp_path / "spool").glob("*.jsonl"))


@pytest.mark.parametrize("holder", ["another-collector", "not-http"])
def test_the_recipes_wait_stops_and_says_why_when_serve_cannot_listen(
    holder: str, tmp_path: Path, unused_port: int
) -> None:
    """Step 1 with port 8000 taken: the wait spun forever in silence (something that is not HTTP
    holds the port), or took another collector's /healthz for this one's and went on (the tokens
    then went into a ./trainvitals.db no collector reads). Now it stops and shows serve's line."""
    step1 = recipe().split("\n# 2.")[0].replace("127.0.0.1:8000", f"127.0.0.1:{unused_port}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINVITALS_")}
    env |= {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", "TRAINVITALS_PORT": str(unused_port)}
    with _port_held(unused_port, answers=holder == "another-collector"):
        proc = subprocess.Popen(
            ["bash", "-e", "-c", step1], cwd=tmp_path, env=env, start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()[0], "the wait did not stop"
        finally:
            _stop_group(proc)
    assert f"trainvitals: 127.0.0.1:{unused_port} is already in use (another collector?" in out, out + err


@contextlib.contextmanager
def _port_held(port: int, *, answers: bool) -> Iterator[None]:
    """The port held by an HTTP server that answers 200 to every GET (a collector's /healthz), or
    by a socket that listens and never answers."""
    if not answers:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
            sock.listen()
            yield
        return

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the handler's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}')

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Healthy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _stop_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the block's process group, SIGKILL to what is left after 15 s."""
    proc.wait()  # bash, the group's leader, has returned
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _running_in_group(proc.pid):
            return
        os.killpg(proc.pid, sig)
        deadline = time.monotonic() + 15
        while _running_in_group(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)


def _running_in_group(pgid: int) -> bool:
    """A live (not zombie) process in the group: the collector, orphaned when bash returned,
    may stay a zombie here, where no init reaps it."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


TRAIN = """
import sys
import torch
import trainvitals.agent as tv

first, last, retry_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
model = torch.nn.Linear(8, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
agent = tv.attach(model, optimizer, run="typo", config=tv.AgentConfig(send_interval_s=0.2, auth_retry_s=retry_s))
for step in range(first, last):
    loss = model(torch.randn(4, 8)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    agent.step(loss=loss, step=step)
"""


def test_a_wrong_project_then_fixed_delivers_and_the_set_aside_batches_replay(
    tmp_path: Path, unused_port: int, serve
) -> None:
    """A job names a project its token is not for (TRAINVITALS_PROJECT=lm, a typo): refused, said
    once on stderr with the collector's reason, set aside (a zero retry window here, instead of
    waiting out the default); the same run id rerun without the typo delivers every step; then
    `trainvitals replay` stores the set-aside batches into the run as the rerun registered it."""
    db_url = f"sqlite:///{tmp_path / 'tv.db'}"
    tv = str(Path(sys.executable).parent / "trainvitals")
    token = subprocess.run(
        [tv, "token", "create", "--db", db_url, "--project", "llm", "--scope", "ingest"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINVITALS_")}
    env |= {
        "TRAINVITALS_COLLECTOR": f"http://127.0.0.1:{unused_port}",
        "TRAINVITALS_TOKEN": token,
        "TRAINVITALS_SPILL_DIR": str(tmp_path / "spool"),
    }
    collector = serve.start(db_url, unused_port, tmp_path / "collector.log", auth=True)
    try:
        wrong = subprocess.run(
            [sys.executable, "-c", TRAIN, "0", "20", "0"], env=env | {"TRAINVITALS_PROJECT": "lm"},
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        fixed = subprocess.run(
            [sys.executable, "-c", TRAIN, "0", "30", "300"], env=env, capture_output=True, text=True, timeout=300
        )
    finally:
        serve.stop(collector)
    assert wrong.returncode == 0 and fixed.returncode == 0, wrong.stderr + fixed.stderr
    quarantine = tmp_path / "spool" / "typo.rank0.quarantine.jsonl"
    said = wrong.stderr.splitlines()
    refusals = [line for line in said if "refused" in line and "(403)" in line]
    assert len(refusals) == 1, wrong.stderr  # once, not per batch
    assert refusals[0].startswith(
        f"trainvitals agent: the collector at http://127.0.0.1:{unused_port} refused the run registration (403): "
        "token is for project 'llm' with scope 'ingest'; this needs scope 'ingest' on project 'lm' (the project "
        "comes from attach(project=) or TRAINVITALS_PROJECT; without either, the token's). "
        f"Set aside in {quarantine}; later data keeps flowing."
    )
    assert said[-1].startswith("trainvitals agent: ") and f"trainvitals replay {quarantine}" in said[-1]
    assert token not in wrong.stderr
    assert "trainvitals agent:" not in fixed.stderr, fixed.stderr

    engine = db.make_engine(db_url)
    with engine.connect() as conn:
        runs = {r.run_id: r.project for r in conn.execute(select(Run.run_id, Run.project))}
        stored = sorted(conn.execute(select(StepRow.step)).scalars())
    assert runs == {"llm/typo": "llm"} and stored == list(range(30))

    replay = subprocess.run(
        [tv, "replay", str(quarantine), "--db", db_url, "--no-analysis"], capture_output=True, text=True, timeout=300
    )
    assert replay.returncode == 0, replay.stdout + replay.stderr
    report = json.loads(replay.stdout)
    set_aside = len(quarantine.read_bytes().splitlines())
    assert report["batches"] == set_aside > 0 and report["rejected_lines"] == 0 and report["errors"] == []
    with engine.connect() as conn:
        by_incarnation = conn.execute(
            select(StepRow.incarnation, func.count()).group_by(StepRow.incarnation).order_by(StepRow.incarnation)
        ).all()
    engine.dispose()
    assert [n for _, n in by_incarnation] == [20, 30]  # the typo'd process's 20 steps, beside the rerun's 30
