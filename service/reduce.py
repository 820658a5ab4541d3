"""Cross-rank reduction of raw per-rank rows into per-step summaries (pure functions, no I/O).

Rules (DESIGN.md "Shape"):
- a (rank, step) reported by several incarnations (a restart that replayed steps) counts once,
  from the newest incarnation;
- step time: distribution over ranks; the job's pace is the slowest rank (synchronous training);
- amax: max over ranks and TP shards; headroom: min; gradient norms: sqrt of the sum over ranks of
  owned sums of squares (each element counted once);
- MFU: job FLOPs of the step / (slowest rank's step time x total peak FLOP/s).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class StepIn:
    """One raw step row (the columns the reducer needs)."""

    step: int
    rank: int
    incarnation: int
    ts: float
    step_seconds: float
    compute_seconds: float | None
    wait_seconds: float | None
    data_seconds: float | None
    loss: float | None
    tokens: float | None
    flops: float | None
    grad_norm: float | None
    pp_stage: int | None


def newest_incarnation(rows: Iterable[StepIn]) -> list[StepIn]:
    """Keep, per (rank, step), the row of the newest incarnation."""
    best: dict[tuple[int, int], StepIn] = {}
    for r in rows:
        key = (r.rank, r.step)
        cur = best.get(key)
        if cur is None or r.incarnation > cur.incarnation:
            best[key] = r
    return list(best.values())


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.median(vals)) if vals else None


def summarize_steps(
    rows: Sequence[StepIn],
    *,
    peak_flops_total: float | None,
    agent_grad_norms: dict[int, tuple[float, int]] | None = None,
) -> list[dict[str, Any]]:
    """One summary dict per step (keys = StepSummary columns except run_id)."""
    by_step: dict[int, list[StepIn]] = defaultdict(list)
    for r in newest_incarnation(rows):
        by_step[r.step].append(r)
    agent_grad_norms = agent_grad_norms or {}
    out = []
    for step in sorted(by_step):
        rs = by_step[step]
        times = np.array([r.step_seconds for r in rs])
        q = np.quantile(times, [0.0, 0.5, 0.9, 0.99, 1.0])
        slowest = rs[int(np.argmax(times))].rank
        losses = [r.loss for r in rs if r.loss is not None]
        tokens = [r.tokens for r in rs if r.tokens is not None]
        flops = [r.flops for r in rs if r.flops is not None]
        job_norms = [r.grad_norm for r in rs if r.grad_norm is not None]
        agent_norm, nonfinite = agent_grad_norms.get(step, (None, 0))
        total_flops = float(sum(flops)) if flops else None
        mfu = None
        if total_flops is not None and peak_flops_total and q[4] > 0:
            mfu = total_flops / (float(q[4]) * peak_flops_total)
        stages: dict[str, list[float]] = defaultdict(list)
        for r in rs:
            if r.pp_stage is not None:
                stages[str(r.pp_stage)].append(r.step_seconds)
        out.append(
            {
                "step": step,
                "ranks": len(rs),
                "ts": max(r.ts for r in rs),
                "step_seconds_min": float(q[0]),
                "step_seconds_p50": float(q[1]),
                "step_seconds_p90": float(q[2]),
                "step_seconds_p99": float(q[3]),
                "step_seconds_max": float(q[4]),
                "slowest_rank": slowest,
                "compute_seconds_p50": _median([r.compute_seconds for r in rs]),
                "wait_seconds_p50": _median([r.wait_seconds for r in rs]),
                "data_seconds_p50": _median([r.data_seconds for r in rs]),
                "loss": float(np.mean(losses)) if losses else None,
                # The job's own (pre-clip) total is what spikes show in; all ranks report the same one.
                "grad_norm": float(job_norms[0]) if job_norms else agent_norm,
                "agent_grad_norm": agent_norm,
                "grad_nonfinite": int(nonfinite),
                "tokens": float(sum(tokens)) if tokens else None,
                "flops": total_flops,
                "mfu": mfu,
                "stage_step_seconds_p50": {k: float(np.median(v)) for k, v in stages.items()} or None,
            }
        )
    return out


def summarize_rank_windows(rows: Sequence[StepIn], *, window: int) -> list[dict[str, Any]]:
    """Per (window, rank) statistics; windows are aligned at multiples of `window` steps."""
    groups: dict[tuple[int, int], list[StepIn]] = defaultdict(list)
    for r in newest_incarnation(rows):
        groups[(r.step // window * window, r.rank)].append(r)
    out = []
    for (start, rank), rs in sorted(groups.items()):
        t = np.array([r.step_seconds for r in rs])
        comp = [r.compute_seconds for r in rs if r.compute_seconds is not None]
        wait = [r.wait_seconds for r in rs if r.wait_seconds is not None]
        out.append(
            {
                "window_start": start,
                "rank": rank,
                "steps": len(rs),
                "pp_stage": rs[-1].pp_stage,
                "step_seconds_mean": float(t.mean()),
                "step_seconds_p50": float(np.median(t)),
                "step_seconds_max": float(t.max()),
                "compute_seconds_mean": float(np.mean(comp)) if comp else None,
                "wait_seconds_mean": float(np.mean(wait)) if wait else None,
            }
        )
    return out


def summarize_grads(
    rows: Iterable[tuple[int, int, int, str, float, float, int]],
    keep: set[tuple[int, int, int]] | None = None,
) -> list[dict[str, Any]]:
    """rows: (step, rank, incarnation, group, owned_sq, local_sq, nonfinite). `keep`: the
    (rank, step, incarnation) triples to use when restarts left duplicates (None: use all)."""
    acc: dict[tuple[int, str], list[float]] = {}
    for step, rank, inc, group, owned, local, nonfinite in rows:
        if keep is not None and (rank, step, inc) not in keep:
            continue
        a = acc.setdefault((step, group), [0.0, 0.0, np.inf, 0.0])
        a[0] += owned
        a[1] += nonfinite
        a[2] = min(a[2], local)
        a[3] = max(a[3], local)
    out = []
    for (step, group), (owned, nonfinite, lo, hi) in sorted(acc.items()):
        spread = hi / lo if lo > 0 and np.isfinite(lo) else None
        out.append(
            {
                "step": step,
                "group_name": group,
                "norm": float(np.sqrt(owned)) if owned >= 0 else float("nan"),
                "nonfinite": int(nonfinite),
                "replica_spread": spread,
            }
        )
    return out
