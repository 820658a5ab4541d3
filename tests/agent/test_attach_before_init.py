"""attach() before init_process_group under a launcher that sets no RANK (torch.multiprocessing.spawn):
every process takes itself for rank 0 of 1, and its records would mix with the others' under one
rank. The first step() finds the process group, says so on each rank and delivers nothing; attached
after init_process_group, the same job reports each rank as itself. Real processes, gloo."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trainvitals.wire import Batch, RunRegistration

SCRIPT = Path(__file__).parent / "dist_scripts" / "spawn_job.py"


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _spawn(when: str, out: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), when, str(out), _free_port()],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_attach_before_init_under_spawn_says_so_and_delivers_nothing(tmp_path: Path) -> None:
    result = _spawn("before", tmp_path)
    for rank in (0, 1):
        assert (
            f"trainvitals agent disabled on rank {rank} of 2: attach() ran before "
            "torch.distributed.init_process_group and took this process for rank 0 of 1; "
            "call attach() after init_process_group"
        ) in result.stderr
        stats = json.loads((tmp_path / f"trained-{rank}.json").read_text())
        assert stats["steps"] == 0 and stats["delivered_batches"] == 0  # training went on, unmonitored
    assert not list(tmp_path.glob("rec-*.jsonl"))  # nothing under a rank the process is not
    assert "Traceback" not in result.stderr and "step() after close()" not in result.stderr  # said once, why


@pytest.mark.slow
def test_attach_after_init_under_spawn_reports_each_rank(tmp_path: Path) -> None:
    result = _spawn("after", tmp_path)
    assert "disabled" not in result.stderr
    for rank in (0, 1):
        first, *batches = (tmp_path / f"rec-{rank}.jsonl").read_bytes().splitlines()
        assert RunRegistration.model_validate_json(first).parallelism.world_size == 2
        parsed = [Batch.model_validate_json(line) for line in batches]
        assert {b.rank for b in parsed} == {rank}
        assert sorted(r.step for b in parsed for r in b.records if r.kind == "step") == [0, 1, 2, 3]
