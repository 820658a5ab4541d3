"""The cross-rank reduction (service/analysis/reduction.py): each batch counted once."""

from __future__ import annotations

import pytest

from trainvitals.service.analysis.reduction import StepIn, batch_copies, summarize_steps


def _row(rank: int, *, tokens: float, flops: float) -> StepIn:
    return StepIn(step=0, rank=rank, incarnation=0, ts=1.0, step_seconds=1.0, compute_seconds=None,
                  wait_seconds=None, data_seconds=None, loss=1.0, tokens=tokens, flops=flops, grad_norm=None,
                  pp_stage=rank // 4, skipped=False)  # fmt: skip


def test_a_batch_reported_by_every_model_parallel_rank_counts_once() -> None:
    """8 ranks, tp=2 x pp=2 x dp=2: two data-parallel replicas of 4096 tokens each, every rank of a
    replica reporting its batch, and a quarter of its FLOPs (the agent's share). The job did 8,192
    tokens and 8,192 x F FLOPs; the sum over ranks read 32,768 tokens."""
    registration = {"parallelism": {"world_size": 8, "tp": 2, "pp": 2}}
    f = 1e9
    rows = [_row(r, tokens=4096, flops=4096 * f / 4) for r in range(8)]
    (s,) = summarize_steps(rows, peak_flops_total=8e15, batch_copies=batch_copies(registration))
    assert s["tokens"] == 8192
    assert s["flops"] == pytest.approx(8192 * f)
    assert s["mfu"] == pytest.approx(8192 * f / 8e15)
    assert batch_copies({}) == 1 and batch_copies({"parallelism": {"tp": 8}}) == 8
