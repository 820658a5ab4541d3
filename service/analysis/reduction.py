"""Cross-rank reduction of raw per-rank rows into per-step summaries (pure functions, no I/O).

Rules (DESIGN.md "Shape"):
- a (rank, step) reported by several incarnations (a restart that replayed steps) counts once,
  from the newest incarnation (service/store/incarnations.py: the rule, in SQL and in memory);
- step time: distribution over ranks; the job's pace is the slowest rank (synchronous training);
- amax: max over ranks and TP shards; headroom: min; gradient norms: sqrt of the sum over ranks of
  owned sums of squares (each element counted once);
- tokens: each batch once. Every rank of a tensor-parallel group and every pipeline stage reports
  the batch it worked on, so the ranks' sum is divided by the registered tp x pp (`batch_copies`);
  FLOPs are summed as they are, each rank's being its own part (the agent reports 1/(tp x pp) of
  the batch's, agent/_position.py). A job running TP or PP without registering it counts its
  tokens (and, with the agent's FLOPs, its MFU) tp x pp times: docs/agent.md says to register them;
- MFU: job FLOPs of the step / (slowest rank's step time x total peak FLOP/s). Computed here
  only; the summary stores it with its denominator (`peak_flops_total`) for every other reader.

The FP8 tensor and gradient rules run in the database instead, as GROUP BYs over every rank's rows
(service/store/summaries.py `tensor_summaries`, `grad_summaries`): those rows never reach Python.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from trainvitals.service.store.incarnations import newest_incarnation


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
    skipped: bool


STEP_IN_COLUMNS = tuple(f.name for f in fields(StepIn))
"""The raw step columns the reducer reads, in StepIn's order."""


def peak_flops_total(registration: dict[str, Any]) -> float | None:
    """The run's peak FLOP/s summed over its devices: the declared per-device peak, else the
    advisors' table for its GPU type (bf16 dense), times the device count. None: no MFU."""
    hw = registration.get("hardware") or {}
    count = hw.get("gpu_count") or (registration.get("parallelism") or {}).get("world_size")
    peak = hw.get("peak_flops")
    if peak is None and hw.get("gpu_type"):
        from trainvitals.service.advisors.hardware import gpu_spec

        try:
            peak = gpu_spec(str(hw["gpu_type"])).peak_bf16_tflops * 1e12
        except ValueError:  # 'cpu' or an unknown type: no MFU without a declared peak
            peak = None
    return float(peak) * int(count) if peak and count else None


def batch_copies(registration: dict[str, Any]) -> int:
    """Ranks that report the same batch: tp x pp of the registration (1 where it gives none)."""
    par = registration.get("parallelism") or {}
    return max(1, int(par.get("tp") or 1) * int(par.get("pp") or 1))


def _col(rows: Sequence[StepIn], name: str) -> np.ndarray:
    return np.array([np.nan if (v := getattr(r, name)) is None else v for r in rows], dtype=np.float64)


def _group_reduce(values: np.ndarray, starts: np.ndarray, counts: np.ndarray, how: str) -> np.ndarray:
    """Per-group nan-aware reductions over contiguous groups (vectorised with reduceat)."""
    present = ~np.isnan(values)
    n = np.add.reduceat(present.astype(np.int64), starts)
    if how == "sum":
        out = np.add.reduceat(np.where(present, values, 0.0), starts)
    elif how == "mean":
        out = np.add.reduceat(np.where(present, values, 0.0), starts) / np.maximum(n, 1)
    elif how == "max":
        out = np.maximum.reduceat(np.where(present, values, -np.inf), starts)
    else:
        raise ValueError(how)
    return np.where(n > 0, out, np.nan)


def _group_quantiles(values: np.ndarray, starts: np.ndarray, counts: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """[len(qs), groups] nan-aware quantiles. Groups of the most common size (every rank reported:
    nearly all steps) go through one vectorised call; only the odd ones are looped."""
    out = np.empty((len(qs), len(counts)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN groups give NaN, which is the answer
        sizes, freq = np.unique(counts, return_counts=True)
        common = sizes[np.argmax(freq)]
        sel = np.flatnonzero(counts == common)
        idx = starts[sel][:, None] + np.arange(common)[None, :]
        out[:, sel] = np.nanquantile(values[idx], qs, axis=1)
        for g in np.flatnonzero(counts != common):
            out[:, g] = np.nanquantile(values[starts[g] : starts[g] + counts[g]], qs)
    return out


def summarize_steps(rows: Sequence[StepIn], *, peak_flops_total: float | None,
                    agent_grad_norms: dict[int, tuple[float, int]] | None = None,
                    batch_copies: int = 1) -> list[dict[str, Any]]:
    """One summary dict per step (keys = StepSummary columns except run_id); `batch_copies`: the
    ranks that report one batch (module docstring, tokens)."""
    kept = sorted(newest_incarnation(rows), key=lambda r: (r.step, r.rank))
    if not kept:
        return []
    agent_grad_norms = agent_grad_norms or {}
    steps = np.array([r.step for r in kept], dtype=np.int64)
    ranks = np.array([r.rank for r in kept], dtype=np.int64)
    uniq, starts, counts = np.unique(steps, return_index=True, return_counts=True)
    secs = _col(kept, "step_seconds")
    q = _group_quantiles(secs, starts, counts, (0.0, 0.5, 0.9, 0.99, 1.0))
    # Slowest rank per step: index of the group maximum (groups are contiguous).
    slowest = np.array([ranks[a + int(np.argmax(secs[a : a + c]))] for a, c in zip(starts, counts, strict=True)])
    medians = {name: _group_quantiles(_col(kept, name), starts, counts, (0.5,))[0]
               for name in ("compute_seconds", "wait_seconds", "data_seconds")}
    raw_loss = _col(kept, "loss")
    bad_loss = np.isinf(raw_loss) | np.array([r.loss is not None and r.loss != r.loss for r in kept])
    loss = _group_reduce(np.where(bad_loss, np.nan, raw_loss), starts, counts, "mean")
    loss_nonfinite = np.add.reduceat(bad_loss.astype(np.int64), starts)
    skipped_ranks = np.add.reduceat(_col(kept, "skipped"), starts)  # never NULL: a count
    tokens = _group_reduce(_col(kept, "tokens"), starts, counts, "sum") / batch_copies
    flops = _group_reduce(_col(kept, "flops"), starts, counts, "sum")
    ts = _group_reduce(_col(kept, "ts"), starts, counts, "max")
    # The job's own (pre-clip) total: every rank reports the same one, take any.
    job_norm = _group_reduce(_col(kept, "grad_norm"), starts, counts, "max")
    # ... and a NaN it reported, which _col reads as an absent one: a non-finite gradient all the same.
    job_nan = np.add.reduceat(np.array([r.grad_norm is not None and r.grad_norm != r.grad_norm for r in kept]), starts)
    has_stages = any(r.pp_stage is not None for r in kept)

    def opt(x: float) -> float | None:
        return None if np.isnan(x) else float(x)

    out = []
    for i, step in enumerate(uniq.tolist()):
        agent_norm, nonfinite = agent_grad_norms.get(step, (None, 0))
        norm = opt(job_norm[i]) if not np.isnan(job_norm[i]) else agent_norm
        if (norm is not None and not np.isfinite(norm)) or job_nan[i]:
            nonfinite = max(nonfinite, 1)  # a NaN/inf total is a non-finite gradient even if unattributed
        mfu = None
        if not np.isnan(flops[i]) and peak_flops_total and q[4, i] > 0:
            mfu = float(flops[i]) / (float(q[4, i]) * peak_flops_total)
        stages = None
        if has_stages:
            by_stage: dict[str, list[float]] = defaultdict(list)
            for r in kept[starts[i] : starts[i] + counts[i]]:
                if r.pp_stage is not None:
                    by_stage[str(r.pp_stage)].append(r.step_seconds)
            # A JSON column: no Infinity (finite step times can still overflow a median's mean).
            medians_by_stage = {k: float(np.median(v)) for k, v in by_stage.items()}
            stages = {k: m for k, m in medians_by_stage.items() if np.isfinite(m)} or None
        out.append({
            "step": step,
            "ranks": int(counts[i]),
            "ts": float(ts[i]),
            "step_seconds_min": float(q[0, i]),
            "step_seconds_p50": float(q[1, i]),
            "step_seconds_p90": float(q[2, i]),
            "step_seconds_p99": float(q[3, i]),
            "step_seconds_max": float(q[4, i]),
            "slowest_rank": int(slowest[i]),
            "compute_seconds_p50": opt(medians["compute_seconds"][i]),
            "wait_seconds_p50": opt(medians["wait_seconds"][i]),
            "data_seconds_p50": opt(medians["data_seconds"][i]),
            "loss": opt(loss[i]),
            "loss_nonfinite": int(loss_nonfinite[i]),
            "grad_norm": norm,
            "agent_grad_norm": agent_norm,
            "grad_nonfinite": int(nonfinite),
            "skipped_ranks": int(skipped_ranks[i]),
            "tokens": opt(tokens[i]),
            "flops": opt(flops[i]),
            "mfu": mfu,
            "peak_flops_total": peak_flops_total,
            "stage_step_seconds_p50": stages,
        })
    return out


def summarize_rank_windows(rows: Sequence[StepIn], *, window: int) -> list[dict[str, Any]]:
    """Per (window, rank) statistics; windows are aligned at multiples of `window` steps. On whole
    arrays: a cycle at 16,384 ranks has 16,384 groups, and a loop over them cost ~1 s a cycle."""
    kept = newest_incarnation(rows)
    if not kept:
        return []
    n = len(kept)
    start = np.fromiter((r.step for r in kept), np.int64, n) // window * window
    rank = np.fromiter((r.rank for r in kept), np.int64, n)
    secs = np.fromiter((r.step_seconds for r in kept), np.float64, n)
    # Stable: within a group the rows keep their order, so its last row gives the stage, as before.
    order = np.lexsort((rank, start))
    start, rank, secs = start[order], rank[order], secs[order]
    first = np.flatnonzero(np.concatenate([[True], (start[1:] != start[:-1]) | (rank[1:] != rank[:-1])]))
    counts = np.diff(np.append(first, n))
    last = first + counts - 1
    mean = np.add.reduceat(secs, first) / counts
    p50 = _sorted_group_medians(secs, start, rank, first, counts)
    peak = np.maximum.reduceat(secs, first)  # NaN propagates, as ndarray.max does
    comp = _present_mean(kept, "compute_seconds", order, first)
    wait = _present_mean(kept, "wait_seconds", order, first)
    stages = [kept[i].pp_stage for i in order[last].tolist()]
    return [
        {
            "window_start": s,
            "rank": r,
            "steps": c,
            "pp_stage": stage,
            "step_seconds_mean": m,
            "step_seconds_p50": med,
            "step_seconds_max": mx,
            "compute_seconds_mean": cm,
            "wait_seconds_mean": wm,
        }
        for s, r, c, stage, m, med, mx, cm, wm in zip(
            start[first].tolist(), rank[first].tolist(), counts.tolist(), stages, mean.tolist(), p50.tolist(),
            peak.tolist(), comp, wait, strict=True,
        )  # fmt: skip
    ]


def _sorted_group_medians(
    values: np.ndarray, start: np.ndarray, rank: np.ndarray, first: np.ndarray, counts: np.ndarray
) -> np.ndarray:
    """np.median of each contiguous group (NaN if the group holds one, as np.median gives): the
    values sorted within their groups, then the middle one or the mean of the middle two."""
    by_value = np.lexsort((values, rank, start))  # groups stay where they are; NaN sorts last
    v = values[by_value]
    lo, hi = v[first + (counts - 1) // 2], v[first + counts // 2]
    has_nan = np.isnan(v[first + counts - 1])
    with np.errstate(over="ignore"):  # two values near the float limit: inf, as np.median gives
        middle = np.where(counts % 2 == 1, lo, (lo + hi) / 2)  # odd: the value itself, never rounded
    return np.where(has_nan, np.nan, middle)


def _present_mean(rows: Sequence[StepIn], name: str, order: np.ndarray, first: np.ndarray) -> list[float | None]:
    """Per group of rows[order], the mean of the field's values that are not None (NaN counts, and
    makes it NaN); None where a group has none."""
    n = len(rows)
    present = np.fromiter((getattr(r, name) is not None for r in rows), bool, n)[order]
    x = np.fromiter((0.0 if (v := getattr(r, name)) is None else v for r in rows), np.float64, n)[order]
    k = np.add.reduceat(present.astype(np.int64), first)
    means = np.add.reduceat(x, first) / np.maximum(k, 1)
    return [m if c else None for m, c in zip(means.tolist(), k.tolist(), strict=True)]
