"""`trainvitals demo`: a collector on SQLite plus a multi-rank training job with the agent attached,
then a summary of what the collector saw."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from trainvitals.service.store import db, queries


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"collector exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"collector at {url} not healthy after {timeout:.0f}s")


def run_demo(*, ranks: int, seconds: float, port: int, workdir: str, keep_serving: bool = False) -> int:
    work = Path(workdir).resolve()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    db_url = f"sqlite:///{work / 'trainvitals.db'}"
    url = f"http://127.0.0.1:{port}"
    exe = shutil.which("trainvitals") or sys.argv[0]
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    print(f"[demo] collector: {url}  (SQLite {work / 'trainvitals.db'})", flush=True)
    serve_log = open(work / "collector.log", "wb")  # noqa: SIM115 - closed below
    collector = subprocess.Popen(
        [exe, "serve", "--db", db_url, "--port", str(port), "--insecure-no-auth"],
        stdout=serve_log,
        stderr=subprocess.STDOUT,
        # A one-minute demo is shorter than a real run's warm-up: let the detectors start at step 100.
        env={**os.environ, "TRAINVITALS_DETECTOR_WARMUP_STEPS": "100"},
    )
    try:
        _wait_healthy(url, collector)
        run = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
        print(
            f"[demo] training: {ranks} ranks (torchrun, gloo, DDP, emulated FP8), run {run!r}, about {seconds:.0f}s;"
            f" rank {ranks - 1} is made slow from step 150",
            flush=True,
        )
        env = {**os.environ, "TRAINVITALS_COLLECTOR": url, "TRAINVITALS_SPILL_DIR": str(work / "spool")}
        cmd = [
            torchrun,
            "--standalone",
            f"--nproc_per_node={ranks}",
            "--log-dir",
            str(work / "torchrun-logs"),
            "-m",
            "trainvitals.examples.train_gpt",
            "--run-name",
            run,
            "--steps",
            "1000000",
            "--max-seconds",
            str(seconds),
            "--ckpt-dir",
            str(work / "ckpt"),
            "--fp8",  # train through emulated FP8 delayed scaling: real headroom to look at
            # A straggler from step 150 (after the demo's detector warm-up), so there is a finding.
            "--slow-rank",
            str(ranks - 1),
            "--slow-from",
            "150",
            "--slow-seconds",
            "0.08",
        ]
        t0 = time.monotonic()
        job = subprocess.run(
            cmd, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        print(
            f"[demo] training exited with code {job.returncode} after {time.monotonic() - t0:.0f}s",
            flush=True,
        )
        if job.returncode != 0:
            print(job.stdout[-4000:])
            return job.returncode
        time.sleep(6)  # the collector reduces and runs the detectors every 2 s
        metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        _print_summary(db_url, run, metrics, url)
        if keep_serving:
            print(f"[demo] collector still serving at {url}; Ctrl-C to stop", flush=True)
            collector.wait()
        return 0
    finally:
        if collector.poll() is None:
            collector.send_signal(signal.SIGINT)
            try:
                collector.wait(15)
            except subprocess.TimeoutExpired:
                collector.kill()
        serve_log.close()


def _print_summary(db_url: str, run: str, metrics: str, url: str) -> None:
    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        ov = queries.run_overview(session, run_id=run)
        per_rank = queries.rank_step_seconds(session, run_id=run)
        worst = queries.worst_tensors(session, run_id=run, k=3)
        found = queries.findings(session, run_id=run)
        gens = queries.checkpoint_generations(session, run_id=run)
    engine.dispose()
    if ov is None:
        print("[demo] the collector saw nothing: check demo-out/collector.log")
        return
    print("\n=== what the collector saw ===")
    print(f"run        {ov.run_id} ({ov.status}), project {ov.project}")
    print(f"ranks      {ov.ranks} of {ov.world_size} declared")
    print(
        f"steps      {ov.steps} (steps {ov.first_step}..{ov.last_step}), {ov.step_records} step records, "
        f"{ov.grad_records} gradient records, {ov.events} events"
    )
    if ov.step_seconds_p50 is not None:
        print(f"step time  median {ov.step_seconds_p50 * 1000:.1f} ms")
    for rank, mean, p50, p99 in per_rank:
        print(
            f"  rank {rank}: mean {mean * 1000:6.1f} ms  p50 {p50 * 1000:6.1f} ms  p99 {p99 * 1000:6.1f} ms"
        )
    spread = (ov.step_seconds_max_rank_mean or 0) / (ov.step_seconds_min_rank_mean or 1)
    print(f"  spread (slowest / fastest rank mean): {spread:.3f}")
    print(f"FP8        {ov.tensor_records} tensor records (emulated delayed scaling); least headroom:")
    for w in worst:
        name = f"{w['tensor']}:{w['role']}"
        print(f"  {name}  min {w['min_headroom_bits']:+.2f} bits, clipped on {w['clipped_steps']} steps")
    print(f"checkpoints {len(gens)} generations: " + ", ".join(f"{g['step']} {g['status']}" for g in gens))
    print(f"findings   {len(found)}" + "".join(f"\n  [{f['severity']}] {f['summary']}" for f in found))
    print("\n=== /metrics (excerpt) ===")
    for line in metrics.splitlines():
        shown = ("trainvitals_run_", "trainvitals_fp8_saturated", "trainvitals_finding_active")
        if line.startswith(shown) and run in line:
            print(line)
    print(f"\nLook yourself: trainvitals serve --db {db_url}  then  curl {url}/metrics")
    print(f"               trainvitals query runs --db {db_url}")
