"""`trainvitals demo`: a collector on SQLite plus a multi-rank training job with the agent attached,
one rank made slow on purpose, then a summary of what the collector saw.

What the demo promises is that the injected straggler is found on the injected rank and on no other,
also on a small loaded machine (2 cores, another CPU-heavy process). Hence a fixed step count rather
than a fixed time (the straggler detector judges complete 50-step windows and reports after 3
consecutive slow ones, so the verdict must not depend on how fast the machine is), a 20-step
detector warm-up registered by the run itself, a 0.1 s/step slowdown from step 20 (several times a
CPU step's compute, far above what scheduling noise does to a window's median), the last rank as
the slow one (rank 0 also saves the checkpoints) and no emulated FP8 (DDP's buffer broadcast would
make rank 0 look slow too). tests/e2e/test_demo.py runs it next to a busy loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STEPS = 250
"""Five 50-step windows: the slow rank is flagged in windows 1..4 (steps 50..249), one more than the
three it takes, so a window disturbed by load does not cost the finding."""
SLOW_FROM = 20
SLOW_SECONDS = 0.1
WARMUP_STEPS = 20
PROJECT = "demo"
SECONDS_PER_STEP = 0.15
"""Measured here (2 cores, 4 ranks): about 0.13-0.14 s a step idle, 0.2 s with a busy loop alongside."""
START_SECONDS = 8
"""Collector start, four ranks importing torch and meeting, the analysis catching up at the end: 3-4 s
on a warm machine (the summary came 39 s after the start, the 250 steps taking 35 s), more on a cold one."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _shown(path: Path) -> str:
    """`path` as a user pastes it: relative to the working directory when below it."""
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else str(path)


def _trainvitals() -> Path:
    """The `trainvitals` of this interpreter's environment (the virtualenv's, not whatever is on PATH)."""
    here = Path(sys.executable).with_name("trainvitals")
    if here.exists():
        return here
    found = shutil.which("trainvitals")
    return Path(found) if found else here


def _die_with_parent() -> None:
    """In the child: SIGTERM when the demo dies without cleaning up (Linux; elsewhere a no-op)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _get(url: str, token: str) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def _wait_ours(url: str, proc: subprocess.Popen[bytes], read_token: str, timeout: float = 60.0) -> None:
    """Until the collector we started answers: /healthz, then a request only a collector on our
    database accepts (the read token was made in it a moment ago)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the collector exited with code {proc.returncode}")
        try:
            _get(url + "/v1/runs", read_token)
            return
        except urllib.error.HTTPError as exc:
            msg = f"{url} answered {exc.code} to the demo's own token: not the collector it started"
            raise RuntimeError(msg) from None
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"the collector at {url} did not answer within {timeout:.0f}s")


def _stop(proc: subprocess.Popen[Any] | None, sig: int, wait: float = 15.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # the child leads its own process group (start_new_session)
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def _quiet_interrupt() -> Iterator[None]:
    """SIGTERM as Ctrl-C: either ends the demo through the same clean-up."""

    def raise_interrupt(_sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_demo(*, ranks: int, seconds: float | None, port: int, workdir: str, keep_serving: bool = False) -> int:
    """The demo; 0 when it ran (the summary says whether the finding is as injected), 2 when it
    could not start, 130 on Ctrl-C. `seconds` caps the training time (None or 0: no cap); a cap
    shorter than the 250 steps take leaves the straggler unjudged, and the summary says so."""
    if ranks < 3:
        print("[demo] --ranks must be at least 3: a rank is judged against the median of its peers", file=sys.stderr)
        return 2
    work = Path(workdir).resolve()
    try:
        with _quiet_interrupt():
            return _run(ranks=ranks, seconds=seconds, port=port, work=work, keep_serving=keep_serving)
    except KeyboardInterrupt:
        print(f"\n[demo] interrupted: training and collector stopped; what was stored is in {_shown(work)}/",
              flush=True)  # fmt: skip
        return 130


def _run(*, ranks: int, seconds: float | None, port: int, work: Path, keep_serving: bool) -> int:
    from trainvitals.service import auth
    from trainvitals.service.store import db, queries

    if port == 0:
        port = _free_port()
    elif _port_taken(port):
        print(
            f"[demo] port {port} is in use (another collector?). The demo trains only against a collector it "
            f"starts itself: give it another port (make demo PORT=8001, trainvitals demo --port 8001) or "
            f"--port 0 for a free one.",
            file=sys.stderr,
        )
        return 2
    work.mkdir(parents=True, exist_ok=True)
    db_path = work / "trainvitals.db"
    db_url = f"sqlite:///{db_path}"
    url = f"http://127.0.0.1:{port}"
    for old in ("ckpt", "torchrun-logs", "spool"):  # the previous demo's; its database is kept
        shutil.rmtree(work / old, ignore_errors=True)
    existed = db_path.exists()
    db.upgrade(db_url)
    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        earlier = len(queries.list_runs(session, project=None))
        ingest_token = auth.create_token(session, project=PROJECT, scope="ingest", name="demo agents")
        read_token = auth.create_token(session, project=PROJECT, scope="read", name="demo reader")
        session.commit()
    engine.dispose()
    token_file = work / "read-token"
    token_file.write_text(read_token + "\n")
    token_file.chmod(0o600)
    kept = f"kept, {earlier} earlier run(s) in it; this one is added" if existed else "new"
    print(f"[demo] database   {_shown(db_path)} ({kept})", flush=True)

    exe = _trainvitals()
    torchrun = shutil.which("torchrun", path=str(exe.parent)) or shutil.which("torchrun") or "torchrun"
    run = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    slow = ranks - 1
    cap = float(seconds) if seconds else None
    estimate = START_SECONDS + STEPS * SECONDS_PER_STEP
    print(f"[demo] collector  {url}, tokens required, log {_shown(work / 'collector.log')}", flush=True)
    print(
        f"[demo] training   run {run!r}: {ranks} ranks (torchrun, gloo, DDP on CPU), {STEPS} steps; rank {slow} "
        f"is made slow ({SLOW_SECONDS:.1f} s a step from step {SLOW_FROM}); detection from step {WARMUP_STEPS}",
        flush=True,
    )
    print(
        f"[demo] this takes about {estimate:.0f} s on an idle 2-core machine, up to twice that on a busy one"
        + (f"; training stops after {cap:.0f} s" if cap else ""),
        flush=True,
    )
    plan = work / "plan.json"
    plan.write_text(json.dumps({"detector_warmup_steps": WARMUP_STEPS}))
    t_start = time.monotonic()
    collector: subprocess.Popen[bytes] | None = None
    job: subprocess.Popen[bytes] | None = None
    serve_log = open(work / "collector.log", "ab")  # noqa: SIM115 - closed below
    train_log = open(work / "training.log", "wb")  # noqa: SIM115 - closed below
    try:
        collector = subprocess.Popen(
            [str(exe), "serve", "--db", db_url, "--port", str(port)],
            stdout=serve_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent,
        )  # fmt: skip
        try:
            _wait_ours(url, collector, read_token)
        except (RuntimeError, TimeoutError) as exc:
            print(f"[demo] {exc}; see {_shown(work / 'collector.log')}", file=sys.stderr)
            return 2
        env = {
            **os.environ,
            "TRAINVITALS_COLLECTOR": url,
            "TRAINVITALS_TOKEN": ingest_token,
            "TRAINVITALS_SPILL_DIR": str(work / "spool"),
        }
        env.pop("TRAINVITALS_PROJECT", None)  # the run goes to the token's project
        cmd = [
            str(torchrun), "--standalone", f"--nproc_per_node={ranks}", "--log-dir", str(work / "torchrun-logs"),
            "-m", "trainvitals.examples.train_gpt", "--run-name", run, "--steps", str(STEPS),
            *(["--max-seconds", str(cap)] if cap else []),
            "--ckpt-dir", str(work / "ckpt"), "--plan", str(plan),
            "--slow-rank", str(slow), "--slow-from", str(SLOW_FROM), "--slow-seconds", str(SLOW_SECONDS),
        ]  # fmt: skip
        t0 = time.monotonic()
        job = subprocess.Popen(
            cmd, env=env, cwd=work, stdout=train_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent,
        )  # fmt: skip
        _progress(job, url, run, read_token, t0)
        print(f"[demo] training exited with code {job.returncode} after {time.monotonic() - t0:.0f}s", flush=True)
        if job.returncode != 0:
            print((work / "training.log").read_text()[-4000:])
            return job.returncode
        _wait_analysed(db_url, run, slow)
        metrics = _metrics(url, read_token)
        ok = _print_summary(db_url, run, metrics, slow=slow)
        print(f"[demo] {time.monotonic() - t_start:.0f} s from start to this summary", flush=True)
        _print_again(exe, db_url, run, token_file, port)
        if not ok:
            print(f"[demo] the finding was not as injected; logs in {_shown(work)}/", flush=True)
        if keep_serving:
            print(f"[demo] collector still serving at {url}; Ctrl-C to stop", flush=True)
            collector.wait()
        return 0
    finally:
        _stop(job, signal.SIGTERM)
        _stop(collector, signal.SIGINT)
        serve_log.close()
        train_log.close()


def _progress(job: subprocess.Popen[bytes], url: str, run: str, token: str, t0: float) -> None:
    """Until the job exits: the collector's newest step of the run, every few seconds."""
    tty = sys.stdout.isatty()
    last_shown = 0.0
    while job.poll() is None:
        time.sleep(0.5)
        now = time.monotonic()
        if now - last_shown < (1.0 if tty else 10.0):
            continue
        last_shown = now
        try:
            step = _get(f"{url}/v1/runs/{run}", token).get("last_step")
        except (OSError, ValueError):
            step = None  # not registered yet (ranks still starting)
        done = f"step {step + 1} of {STEPS}" if step is not None else "starting the ranks"
        line = f"[demo] training   {done}, {now - t0:.0f} s"
        if tty:
            sys.stdout.write("\r" + line.ljust(60))
            sys.stdout.flush()
        else:
            print(line, flush=True)
    if tty:
        sys.stdout.write("\n")


def _wait_analysed(db_url: str, run: str, slow: int, timeout: float = 30.0) -> None:
    """Until the analysis has reduced the whole run and passed over it once more (it runs every 2 s)."""
    from sqlalchemy import func, select

    from trainvitals.service.store import db, run_keys
    from trainvitals.service.store.models import ReductionState, StepRow

    engine = db.make_engine(db_url)
    deadline = time.monotonic() + timeout
    key = run_keys.run_key(PROJECT, run)  # the demo's tokens are for PROJECT
    try:
        while time.monotonic() < deadline:
            with db.make_sessionmaker(engine)() as session:
                last = session.scalar(select(func.max(StepRow.step)).where(StepRow.run_id == key))
                state = session.get(ReductionState, key)
                if last is not None and state is not None and state.reduced_upto >= last:
                    break
            time.sleep(0.5)
        time.sleep(3)  # the detectors run after the reduction, in the same cycle or the next
    finally:
        engine.dispose()


def _metrics(url: str, token: str) -> str:
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(resp.read().decode())


def _print_summary(db_url: str, run: str, metrics: str, *, slow: int) -> bool:
    """The summary; True when the findings on ranks are exactly the straggler on the slowed rank."""
    from trainvitals.service.store import db, queries, run_keys

    key = run_keys.run_key(PROJECT, run)  # the demo's tokens are for PROJECT
    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        ov = queries.run_overview(session, run_id=key)
        per_rank = queries.rank_step_seconds(session, run_id=key)
        found = queries.findings(session, run_id=key)
        gens = queries.checkpoint_generations(session, run_id=key)
    engine.dispose()
    if ov is None:
        print("[demo] the collector saw nothing: see collector.log and training.log")
        return False
    print("\n=== what the collector saw ===")
    print(f"run        {ov.run_id} ({ov.status}), project {ov.project}")
    print(f"ranks      {ov.ranks} of {ov.world_size} declared")
    print(
        f"steps      {ov.steps} (steps {ov.first_step}..{ov.last_step}), {ov.step_records} step records, "
        f"{ov.grad_records} gradient records, {ov.events} events"
    )
    print(f"detection  {ov.detection}")
    print(f"mfu        {ov.mfu}")
    if ov.step_seconds_p50 is not None:
        print(f"step time  median {ov.step_seconds_p50 * 1000:.1f} ms")
    for rank, mean, p50, p99 in per_rank:
        print(
            f"  rank {rank}: mean {mean * 1000:6.1f} ms  p50 {p50 * 1000:6.1f} ms  p99 {p99 * 1000:6.1f} ms"
        )
    if per_rank:
        print("  (equal: every rank's step lasts as long as the slowest's; the detector compares compute time)")
    print(f"checkpoints {len(gens)} generations: " + ", ".join(f"{g['step']} {g['status']}" for g in gens))
    print(f"findings   {len(found)}" + "".join(f"\n  [{f['severity']}] {f['summary']}" for f in found))
    on_ranks = {(f["kind"], f["subject"]) for f in found if f["subject_kind"] == "rank"}
    ok = {subject for _, subject in on_ranks} == {str(slow)} and any(k == "straggler" for k, _ in on_ranks)
    verdict = "found, and on no other rank" if ok else "NOT as expected"
    print(f"injected   rank {slow} slowed {SLOW_SECONDS:.1f} s a step from step {SLOW_FROM}: {verdict}")
    print("\n=== /metrics (excerpt) ===")
    for line in metrics.splitlines():
        shown = ("trainvitals_run_", "trainvitals_finding_active")
        if line.startswith(shown) and run in line:
            print(line)
    return ok


def _print_again(exe: Path, db_url: str, run: str, token_file: Path, port: int) -> None:
    tv = _shown(exe)
    tok = _shown(token_file)
    print("\nLook at it again (the database stays; paste these):")
    print(f"  {tv} query findings --run {run} --db {db_url}")
    print(f"  {tv} query steps --run {run} --db {db_url} --format csv | head")
    print(f"  {tv} serve --db {db_url} --port {port} > collector-again.log 2>&1 &")
    print(f"  until curl -sf http://127.0.0.1:{port}/healthz > /dev/null; do sleep 0.5; done")
    print(f"  curl -s -H \"Authorization: Bearer $(cat {tok})\" http://127.0.0.1:{port}/metrics"
          f" | grep 'run=\"{run}\"'")  # fmt: skip
    print("  kill %1")
