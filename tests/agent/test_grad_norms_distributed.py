"""Gradient norms under DDP, FSDP2 (fully_shard) and FSDP1 (FullyShardedDataParallel, flat or original
parameters) in real torchrun jobs on CPU/gloo: the sum over ranks of owned sums of squares equals the
job's own total norm (clip_grad_norm_'s; FSDP1's own method), with no extra collective."""

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainvitals.wire import Batch, GradRecord
from trainvitals.wire.conventions import GLOBAL_GROUP

SCRIPT = Path(__file__).parent / "dist_scripts" / "grad_norm_job.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _grad_records(out: Path, ranks: int) -> Iterator[GradRecord]:
    for rank in range(ranks):
        for line in (out / f"rec-{rank}.jsonl").read_bytes().splitlines()[1:]:
            yield from (rec for rec in Batch.model_validate_json(line).records if rec.kind == "grad")


def _global_sq_by_step(out: Path, ranks: int) -> dict[int, float]:
    total: dict[int, float] = {}
    for rec in _grad_records(out, ranks):
        if rec.group == GLOBAL_GROUP:
            total[rec.step] = total.get(rec.step, 0.0) + rec.owned_sq
    return total


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "fsdp1", "fsdp1-orig", "ddp-attach-first", "fsdp2-attach-first"])
def test_global_norm_matches_clip_grad_norm(mode: str, tmp_path: Path) -> None:
    ranks = 2
    result = subprocess.run(
        [str(TORCHRUN), "--standalone", f"--nproc_per_node={ranks}", str(SCRIPT), mode, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected = json.loads((tmp_path / "totals-0.json").read_text())
    assert expected == json.loads((tmp_path / "totals-1.json").read_text())
    ours = _global_sq_by_step(tmp_path, ranks)
    assert sorted(ours) == list(range(len(expected)))
    for step, total in enumerate(expected):
        assert math.sqrt(ours[step]) == pytest.approx(total, rel=1e-5), step
    # Per-layer groups by the model's own names, whatever the wrapper (FSDP1's flat parameters:
    # a wrapped layer's is that layer's; the root's, holding emb and head, has only its own name).
    groups = {rec.group for rec in _grad_records(tmp_path, ranks)}
    assert {"layers.0", "layers.1", "layers.2"} <= groups, groups
    assert groups - {"layers.0", "layers.1", "layers.2", GLOBAL_GROUP} == (
        {"_flat_param"} if mode == "fsdp1" else {"emb", "head"}
    ), groups
