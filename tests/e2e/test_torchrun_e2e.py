"""End to end: the collector as a real process, the example as a real 4-rank torchrun DDP job."""

from __future__ import annotations

import math
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from sqlalchemy import select

from trainvitals.service.store import db, queries
from trainvitals.service.store.models import GradStatRow, StepRow

BIN = Path(sys.executable).parent
RANKS = 4
STEPS = 30


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def wait_for_metric(port: int, line: str, timeout: float = 30.0) -> str:
    """Poll /metrics until `line` appears (the collector reduces every couple of seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        text = _get(f"http://127.0.0.1:{port}/metrics")
        if line in text or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def torchrun(
    args: list[str],
    cwd: Path,
    *,
    ranks: int = RANKS,
    env: dict[str, str] | None = None,
    module: str = "trainvitals.examples.train_gpt",
) -> subprocess.CompletedProcess[str]:
    import os

    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={ranks}", "-m", module, *args]
    result = subprocess.run(
        cmd, env={**os.environ, **(env or {})}, cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_every_step_of_every_rank_is_stored_and_exposed(
    db_url: str, tmp_path: Path, unused_port: int, promtool_check, serve
) -> None:
    proc = serve.start(db_url, unused_port, tmp_path / "collector.log")
    try:
        torchrun(
            [
                "--run-name",
                "e2e",
                "--steps",
                str(STEPS),
                "--clip",
                "0",
                "--send-interval",
                "0.5",
                "--collector",
                f"http://127.0.0.1:{unused_port}",
            ],
            tmp_path,
        )
        metrics = wait_for_metric(unused_port, f'trainvitals_run_complete_step{{run="e2e"}} {STEPS - 1}.0')
    finally:
        serve.stop(proc)

    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        keys = queries.step_keys(session, run_id="e2e")
        assert {(rank, step) for rank, _inc, step in keys} == {
            (r, s) for r in range(RANKS) for s in range(STEPS)
        }
        assert len(keys) == RANKS * STEPS  # exactly once
        # The collector's reduction (owned sums of squares over ranks) equals the job's own
        # clip_grad_norm_ total on every step: DDP replicas are counted once.
        job_norms = dict(
            session.execute(select(StepRow.step, StepRow.grad_norm).where(StepRow.rank == 0)).all()
        )
        for step in range(STEPS):
            ours = queries.global_grad_norm(session, run_id="e2e", step=step)
            assert ours == pytest.approx(job_norms[step], rel=1e-5), step
        groups = set(session.scalars(select(GradStatRow.group_name).distinct()))
        assert {"layers.0", "layers.1", "tok_emb", "lm_head", "__global__"} <= groups
        waits = session.scalars(select(StepRow.wait_seconds).where(StepRow.step > 0)).all()
        assert all(w is not None and w >= 0 for w in waits)  # DDP comm hook timed every step
    engine.dispose()
    assert f'trainvitals_run_complete_step{{run="e2e"}} {STEPS - 1}.0' in metrics
    assert f'trainvitals_run_latest_step{{run="e2e"}} {STEPS - 1}.0' in metrics
    assert f'trainvitals_run_ranks_reporting{{run="e2e"}} {RANKS}.0' in metrics
    assert 'trainvitals_run_rank_step_seconds{run="e2e",stat="p99"}' in metrics
    assert math.isfinite(float(metrics.split('trainvitals_run_loss{run="e2e"} ')[1].split()[0]))
    check = promtool_check(metrics)
    assert check.returncode == 0, check.stdout + check.stderr
