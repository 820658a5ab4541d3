"""The detectors' input for one run (`RunSeries`), read from the summary tables and kept between
analysis cycles (the reads themselves are service/store/detector_reads.py).

A cycle re-reads only the steps its reduction (re)wrote. Everything older is unchanged in the
store: late data re-dirties the steps it lands on and the reduction rewrites them, which lowers the
step this cache reloads from. So a 16,384-rank run costs the rows of its new steps per cycle, not
its whole lookback again (600 steps x 16,384 ranks of timing and 20,000 steps of every monitored
tensor: tens of millions of rows, minutes per cycle). A fresh instance loads the whole lookback,
which is what replay does, through this code. The live worker's inputs (`blocks=True`) also store
each completed range of steps as arrays (store/detector_blocks.py: 1,000 steps of step summaries
and gradient-group norms, 1,000 of tensors, 50 of timing), so the first cycle after a collector
start or a lease takeover loads those and reads rows only for the steps no block holds: seconds
instead of two minutes at 16,384 ranks.

A run that names a baseline run (registration `baseline_run`) gets that run's loss and gradient
norm over the same steps as `RunSeries.baseline` (service/detectors/baseline.py compares them),
read the same incremental way. Only a run of the same project serves: a run never reads another
project's data; while it names none, that is logged once and the run is judged against itself.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from trainvitals.service.analysis import expectations
from trainvitals.service.detectors.findings import Finding
from trainvitals.service.detectors.series import (
    CheckpointEvent,
    GroupGradNorms,
    RankSteps,
    RunEvent,
    RunSeries,
    RunSteps,
    TensorSeries,
)
from trainvitals.service.store import detector_blocks, detector_reads, queries, run_keys
from trainvitals.service.store.detector_reads import I64, STEP_DTYPES, TENSOR_DTYPES
from trainvitals.service.store.models import Run

log = logging.getLogger(__name__)


def _frozen(a: np.ndarray) -> np.ndarray:
    # Kept arrays go to the detectors as they are, cycle after cycle: one that wrote into its input
    # would corrupt the next cycle's, so writing raises instead.
    a.flags.writeable = False
    return a


class _Columns:
    """One source's rows as numpy columns, ascending by their first column (the step)."""

    def __init__(self, dtypes: Sequence[Any]) -> None:
        self.dtypes = tuple(dtypes)
        self.cols = [np.empty(0, dtype=d) for d in self.dtypes]

    @property
    def steps(self) -> np.ndarray:
        return self.cols[0]

    def cut(self, *, after: float, upto: float) -> None:
        """Keep the rows with after < step <= upto (views, no copy)."""
        lo = int(np.searchsorted(self.steps, after, side="right"))
        hi = int(np.searchsorted(self.steps, upto, side="right"))
        self.cols = [c[lo:hi] for c in self.cols]

    def append(self, columns: Sequence[np.ndarray]) -> None:
        if not len(columns[0]):
            return
        if not len(self.cols[0]):
            # Nothing held (a first load): the new columns themselves. A copy here was a second
            # copy of a restart's ~430 MB of tensor series, into fresh pages (0.7 s under cProfile).
            self.cols = [_frozen(np.asarray(new, dtype=d)) for new, d in zip(columns, self.dtypes, strict=True)]
            return
        self.cols = [_frozen(np.concatenate([c, new])) for c, new in zip(self.cols, columns, strict=True)]


_SPARE_ROWS = 64
"""Steps of room a rank matrix keeps after its newest (25 MB at 16,384 ranks): a copy of the
lookback every 64 new steps instead of every cycle."""


class _RankMatrix:
    """Per-step x per-rank timing, extended by the rows of new steps.

    The matrices are read-only views of buffers with room for `_SPARE_ROWS` more steps: a cycle's
    new steps are written into that room, not appended by copying the whole lookback (600 steps x
    16,384 ranks x 3 matrices, 0.6 s of a restart's first cycle under cProfile). Rows a view ever
    showed are never written again (a cut of the newest steps gives up the room), so a series
    handed to the detectors does not change under them."""

    def __init__(self) -> None:
        self.steps = np.empty(0, dtype=I64)
        self.ranks = np.empty(0, dtype=I64)
        self.mats = [np.empty((0, 0)) for _ in range(3)]  # step, compute, wait seconds
        self.stage = np.empty(0, dtype=I64)
        self._bufs: list[np.ndarray] | None = None  # what self.mats view, rows _lo.._lo+len(steps)-1
        self._lo = 0

    def cut(self, *, after: float, upto: float) -> None:
        lo = int(np.searchsorted(self.steps, after, side="right"))
        hi = int(np.searchsorted(self.steps, upto, side="right"))
        if hi < len(self.steps):  # the newest steps go (to be read again): their rows are not reused
            self._bufs = None
        self._lo += lo
        self.steps = self.steps[lo:hi]
        self.mats = [m[lo:hi] for m in self.mats]
        # A rank that has no step left in the window is not part of it (as in a fresh read).
        present = ~np.all(np.isnan(self.mats[0]), axis=0) if len(self.steps) else np.zeros(len(self.ranks), bool)
        if not present.all():
            self.ranks, self.stage = self.ranks[present], self.stage[present]
            self.mats = [m[:, present] for m in self.mats]
            self._bufs = None

    def _widen(self, ranks: np.ndarray) -> None:
        """Add columns (NaN) for ranks seen for the first time, keeping the ranks sorted."""
        union = np.union1d(self.ranks, ranks)
        if len(union) == len(self.ranks):
            return
        at = np.searchsorted(union, self.ranks)
        mats = []
        for m in self.mats:
            wide = np.full((m.shape[0], len(union)), np.nan)
            wide[:, at] = m
            mats.append(wide)
        stage = np.full(len(union), -1, dtype=I64)
        stage[at] = self.stage
        self.ranks, self.mats, self.stage = union, mats, stage
        self._bufs = None

    def _room(self, rows: int) -> int:
        """Make room for `rows` more steps after the held ones (NaN); returns the buffer row where
        they start. Copies the held rows only when the buffers are full (every ~_SPARE_ROWS steps)."""
        held = len(self.steps)
        end = self._lo + held
        if self._bufs is None or end + rows > len(self._bufs[0]):
            bufs = [np.empty((held + rows + max(_SPARE_ROWS, rows), len(self.ranks))) for _ in self.mats]
            for buf, m in zip(bufs, self.mats, strict=True):
                buf[:held] = m
            self._bufs, self._lo, end = bufs, 0, held
        for buf in self._bufs:
            buf[end : end + rows] = np.nan
        return end

    def _show(self, new_steps: np.ndarray) -> None:
        """The held steps followed by new_steps, whose rows were written into the buffers."""
        assert self._bufs is not None
        self.steps = np.concatenate([self.steps, new_steps])
        self.mats = [_frozen(buf[self._lo : self._lo + len(self.steps)]) for buf in self._bufs]

    def append(self, columns: Sequence[np.ndarray]) -> None:
        """columns (detector_reads.RANK_DTYPES) of steps newer than every held step: one row per
        (step, rank), the store having applied the newest-incarnation rule; ordered by step, so
        a rank's stage is written last from its newest step."""
        step_a, rank_a, total, comp, wait, pp = columns
        if not len(step_a):
            return
        self._widen(_distinct(rank_a))
        # step_a ascends: its distinct values in one pass (np.unique would sort 10M rows again).
        new_steps = step_a[np.concatenate([[True], step_a[1:] != step_a[:-1]])]
        si = np.searchsorted(new_steps, step_a)
        ri = np.searchsorted(self.ranks, rank_a)
        row = self._room(len(new_steps))
        assert self._bufs is not None
        for buf, values in zip(self._bufs, (total, comp, wait), strict=True):
            buf[row + si, ri] = values
        self._show(new_steps)
        known = ~np.isnan(pp)
        self.stage[ri[known]] = pp[known].astype(I64)

    def block(self, first: int, last: int) -> dict[str, np.ndarray]:
        """Steps first..last as a stored block: the ranks with a step there, their timing, and
        their stage as kept now (a later block or row overwrites it, as a newer row does)."""
        lo = int(np.searchsorted(self.steps, first, side="left"))
        hi = int(np.searchsorted(self.steps, last, side="right"))
        mats = [m[lo:hi] for m in self.mats]
        present = ~np.all(np.isnan(mats[0]), axis=0) if hi > lo else np.zeros(len(self.ranks), bool)
        arrays = {"steps": self.steps[lo:hi], "ranks": self.ranks[present], "stage": self.stage[present]}
        arrays.update({name: m[:, present] for name, m in zip(_TIMING_MATS, mats, strict=True)})
        return arrays

    def append_blocks(self, blocks: Sequence[dict[str, np.ndarray]], *, after: int) -> None:
        """Stored blocks (`block`), ascending, of steps newer than every held step; their rows at
        or below `after` are left out (the lookback starts inside the first block)."""
        parts = []
        for b in blocks:
            keep = b["steps"] > after
            # Slices, not copies, where the block is kept whole (the usual case): a load at 16,384
            # ranks is ~240 MB of timing (the old final concatenation alone: 0.7 s under cProfile).
            rows = slice(None) if keep.all() else keep
            mats = [b[name][rows] for name in _TIMING_MATS]
            present = ~np.all(np.isnan(mats[0]), axis=0) if keep.any() else np.zeros(len(b["ranks"]), bool)
            cols = slice(None) if present.all() else present
            parts.append((b["steps"][keep], b["ranks"][cols], [m[:, cols] for m in mats], b["stage"][cols]))
        if not any(len(steps) for steps, *_ in parts):
            return
        self._widen(np.unique(np.concatenate([ranks for _, ranks, *_ in parts])))
        row = self._room(sum(len(steps) for steps, *_ in parts))
        assert self._bufs is not None
        for steps, ranks, mats, stage in parts:
            at = np.searchsorted(self.ranks, ranks)
            whole = len(at) == len(self.ranks)  # then at is every column, in order
            for buf, m in zip(self._bufs, mats, strict=True):
                if whole:
                    buf[row : row + len(steps)] = m
                else:
                    buf[row : row + len(steps), at] = m
            known = stage >= 0
            self.stage[at[known]] = stage[known]
            row += len(steps)
        self._show(np.concatenate([steps for steps, *_ in parts]))

    def series(self) -> RankSteps | None:
        if not len(self.steps):
            return None
        return RankSteps(
            steps=self.steps,
            ranks=self.ranks,
            step_seconds=self.mats[0],
            compute_seconds=self.mats[1],
            wait_seconds=self.mats[2],
            pp_stage=self.stage.copy(),
        )


_TIMING_MATS = ("step_seconds", "compute_seconds", "wait_seconds")
_SUMMARIES, _TENSORS, _TIMING = "summaries", "tensors", "timing"
BLOCK_STEPS = {_SUMMARIES: 1_000, _TENSORS: 1_000, _TIMING: 50}
"""Steps per stored block: a block is written once its steps are reduced. At the benchmark's size
(store/detector_blocks.py packs what is mostly empty): summaries, 1,000 step rows and 33,000 group
norms, 0.4 MB; tensors, 384 x 1,000 x 7 values, 11 MB; timing, 3 x 50 x 16,384 values, 20 MB."""
_SAVES_PER_CYCLE = 2
"""Blocks written per source and cycle, newest first: a run first seen with a long history gets its
blocks over a few cycles instead of adding ~700 MB of writes to one."""


def _tensor_column(block: dict[str, np.ndarray], i: int) -> np.ndarray:
    """Tensor column i of a stored block; NaN (not measured) for a column the block predates
    (crest_bits, added after the first blocks were stored): a restart still loads them."""
    column = block.get(f"c{i}")
    if column is None:
        return np.full(len(block["c0"]), np.nan, dtype=TENSOR_DTYPES[i])
    return column


def _block_run(stored: set[int], size: int, *, after: int, upto: int) -> tuple[int, int] | None:
    """(first, last) step of the newest run of consecutive stored blocks that end at or before
    `upto` and hold steps above `after` (the first may start at or below it); None: no such block."""
    k = (upto + 1) // size - 1  # the newest block that ends at or before upto
    while k >= 0 and (k + 1) * size - 1 > after and k * size not in stored:
        k -= 1
    if k < 0 or (k + 1) * size - 1 <= after:
        return None
    newest = k
    while k > 0 and (k - 1) * size in stored and k * size - 1 > after:
        k -= 1
    return k * size, (newest + 1) * size - 1


def _distinct(ranks: np.ndarray) -> np.ndarray:
    """The sorted distinct ranks: by a presence table when they are a job's 0..world_size-1 (a
    first read has 16,384 ranks x 600 steps: np.unique would sort 10M values), else np.unique."""
    if len(ranks) and 0 <= ranks.min() and ranks.max() < 4 * len(ranks) + 1024:
        present = np.zeros(int(ranks.max()) + 1, dtype=bool)
        present[ranks] = True
        return np.flatnonzero(present).astype(I64)
    return np.unique(ranks)


class DetectorInputs:
    """Usage::

    inputs = DetectorInputs()          # one per run, kept by the analysis worker
    series = inputs.build(session, run, rewritten_from=first_step_reduced_this_cycle, ...)

    `rewritten_from`: the lowest step whose summaries (or raw timing rows) changed since the last
    build (None: nothing changed). Rows below it are kept, rows from it on are read again.
    `baseline_run`: compare with this run instead of the one the registration names (a
    post-mortem's choice; the caller checked that it is in the run's project).
    `upto` (build): the view ends at this step instead of the newest reduced one; a walk over a
    stored run's history raises it cycle by cycle and reads only the steps each cycle adds.
    `blocks`: load and store blocks of the input (store/detector_blocks.py): the live worker's
    choice, whose reduction deletes the blocks of the steps it rewrites.
    """

    def __init__(self, *, baseline_run: str | None = None, blocks: bool = False) -> None:
        self.loaded_upto: int | None = None  # newest step read (None: nothing read yet)
        self._blocks = blocks
        self._stored: dict[str, set[int]] | None = None  # first steps of the run's stored blocks
        self._steps = _Columns(STEP_DTYPES)
        self._groups = _Columns((I64, np.int32, np.float64))  # step, group code, norm
        self._group_names: list[str] = []
        self._group_code: dict[str, int] = {}
        self._tensors: dict[tuple[str, str], tuple[str, bool, _Columns]] = {}
        self._ranks = _RankMatrix()
        self._baseline_run = baseline_run
        self._baseline_ok: set[str] = set()  # baseline runs found in the project (a miss is checked again)
        self._baseline_warned: set[str] = set()
        self._baseline = _Columns(STEP_DTYPES)
        self._baseline_upto = -1  # newest baseline step read
        self.same_data = False
        """Whether the last build's arrays hold what the build before it gave: no step was added,
        rewritten or dropped, and the baseline read nothing new (the events are read every build)."""
        self.kept_findings: tuple[tuple[object, ...], list[Finding]] | None = None
        """The detectors' answer on the data (pipeline.detect_cycle), with what it was computed under."""

    def build(
        self,
        session: Session,
        run: Run,
        *,
        rewritten_from: int | None,
        now: float,
        lookback_steps: int,
        rank_lookback_steps: int,
        upto: int | None = None,
    ) -> RunSeries:
        """upto: the view's newest step (the analysis on request walks a run's history with it);
        None: the newest summary's."""
        rid = run.run_id
        newest = detector_reads.newest_summary(session, run_id=rid)
        latest, peak_flops_total = (-1, None) if newest is None else newest
        if upto is not None:
            latest = min(latest, upto)
        before = (self.loaded_upto, self._baseline_upto)
        if self.loaded_upto is not None and latest < self.loaded_upto:
            # The view moved back (a walk started again): its lookback reaches below the kept rows.
            self.loaded_upto, self._baseline_upto = None, -1
        since = -1 if self.loaded_upto is None else self.loaded_upto  # rows above this step are read
        if rewritten_from is not None:
            since = min(since, rewritten_from - 1)
        lo, rank_lo = latest - lookback_steps, latest - rank_lookback_steps
        if self._blocks:
            self._forget_rewritten(session, rid, rewritten_from)
        # Drop what is re-read and what left the lookback; then read (max(since, lo), latest].
        self._cut(after=lo, upto=since, rank_after=rank_lo)
        self._read(session, rid, after=max(since, lo), upto=latest, rank_after=max(since, rank_lo))
        self.loaded_upto = latest
        if self._blocks:
            self._save_blocks(session, rid, after={_SUMMARIES: lo, _TENSORS: lo, _TIMING: rank_lo}, upto=latest)
        series = self._series(session, run, now=now, peak_flops_total=peak_flops_total)
        series.baseline = self._baseline_series(session, run, after=lo, upto=latest)
        # The same newest step means the same lookback, so nothing was cut and nothing read.
        self.same_data = rewritten_from is None and before == (latest, self._baseline_upto)
        return series

    def _baseline_series(self, session: Session, run: Run, *, after: int, upto: int) -> RunSeries | None:
        """The baseline's steps after < step <= upto (the run's lookback), or None without a usable one.

        A baseline is normally a finished run whose summaries no longer change: each build reads
        only the steps it had not reduced at the previous one (the run's late data does not concern
        it; late data of a baseline still running is not re-read)."""
        name = self._baseline_run or (run.registration or {}).get("baseline_run")
        if not name:
            return None
        key = run_keys.run_key(run.project, name)  # a run id of the run's own project
        if name not in self._baseline_ok:
            # Checked again each cycle until found (one key lookup): a baseline may be registered later.
            if key == run.run_id or not detector_reads.run_in_project(session, run_id=key, project=run.project):
                if name not in self._baseline_warned:
                    self._baseline_warned.add(name)
                    log.warning(
                        "run %s names baseline run %s, which is not a run of project %s: judged against itself",
                        run.run_id, name, run.project,
                    )  # fmt: skip
                return None
            self._baseline_ok.add(name)
        newest = detector_reads.newest_summary(session, run_id=key)
        have = self._baseline_upto
        self._baseline.cut(after=after, upto=have)
        reach = min(upto, -1 if newest is None else newest[0])
        self._baseline.append(detector_reads.step_columns(session, run_id=key, after=max(have, after), upto=reach))
        self._baseline_upto = max(have, reach)
        return RunSeries(run=name, steps=_run_steps(self._baseline.cols, with_mfu=False))

    def _cut(self, *, after: int, upto: int, rank_after: int) -> None:
        self._steps.cut(after=after, upto=upto)
        self._groups.cut(after=after, upto=upto)
        for key, (*_, cols) in list(self._tensors.items()):
            cols.cut(after=after, upto=upto)
            if not len(cols.steps):  # left the window: a fresh read would not list it
                del self._tensors[key]
        self._ranks.cut(after=rank_after, upto=upto)

    def _forget_rewritten(self, session: Session, rid: str, rewritten_from: int | None) -> None:
        """List the stored blocks once; forget those the reduction deleted (rewritten steps)."""
        if self._stored is None:
            self._stored = {src: detector_blocks.stored(session, run_id=rid, source=src) for src in BLOCK_STEPS}
        elif rewritten_from is not None:
            for src, size in BLOCK_STEPS.items():
                self._stored[src] = {f for f in self._stored[src] if f + size - 1 < rewritten_from}

    def _save_blocks(self, session: Session, rid: str, *, after: dict[str, int], upto: int) -> None:
        """Store the newest blocks not stored yet that the kept input holds whole; delete those
        that left the lookback. Committed at once: on SQLite an open write would hold off ingest
        while the detectors run (the cycle's reduction is committed already). Every block is built
        and encoded before the first write: on SQLite that write takes the database's one write
        lock until the commit, and ingest's writer waits for it (a block is about 20 MB at 16,384
        ranks)."""
        assert self._stored is not None
        builders = {_SUMMARIES: self._summary_block, _TENSORS: self._tensor_block, _TIMING: self._ranks.block}
        saves: list[tuple[str, int, int, bytes]] = []
        forgets: list[tuple[str, set[int]]] = []
        for src, size in BLOCK_STEPS.items():
            stored, saved = self._stored[src], 0
            k = (upto + 1) // size - 1
            while k >= 0 and k * size > after[src] and saved < _SAVES_PER_CYCLE:
                first, last = k * size, (k + 1) * size - 1
                if first not in stored:
                    arrays = builders[src](first, last)
                    saves.append((src, first, last, detector_blocks.encode(arrays)))
                    saved += 1
                k -= 1
            gone = {f for f in stored if f + size - 1 <= after[src]}
            if gone:
                forgets.append((src, gone))
        for src, first, last, payload in saves:
            detector_blocks.save(session, run_id=rid, source=src, first=first, last=last, payload=payload)
            self._stored[src].add(first)
        for src, gone in forgets:
            detector_blocks.forget_upto(session, run_id=rid, source=src, step=after[src])
            self._stored[src] -= gone
        if saves or forgets:
            session.commit()

    def _tensor_block(self, first: int, last: int) -> dict[str, np.ndarray]:
        keys, formats, shadows, counts, parts = [], [], [], [], []
        for key, (fmt, shadow, cols) in sorted(self._tensors.items()):
            lo = int(np.searchsorted(cols.steps, first, side="left"))
            hi = int(np.searchsorted(cols.steps, last, side="right"))
            if hi > lo:
                keys.append(key)
                formats.append(fmt)
                shadows.append(shadow)
                counts.append(hi - lo)
                parts.append([c[lo:hi] for c in cols.cols])
        arrays = {
            "tensor": np.array([t for t, _ in keys], dtype=str),
            "role": np.array([r for _, r in keys], dtype=str),
            "format": np.array(formats, dtype=str),
            "shadow": np.array(shadows, dtype=bool),
            "count": np.array(counts, dtype=I64),
        }
        for i, dtype in enumerate(TENSOR_DTYPES):
            arrays[f"c{i}"] = np.concatenate([p[i] for p in parts]) if parts else np.empty(0, dtype=dtype)
        return arrays

    def _spans(self, src: str, *, after: int, upto: int) -> list[tuple[int, int, bool]]:
        """(after, upto] as consecutive (after, upto, from blocks) spans: rows below the newest run
        of stored blocks, the blocks, rows above them."""
        size = BLOCK_STEPS[src]
        run = None
        if self._blocks and self._stored is not None and upto - after > size:
            run = _block_run(self._stored[src], size, after=after, upto=upto)
        if run is None:
            return [(after, upto, False)]
        first, last = run
        spans = [(after, first - 1, False), (max(after, first - 1), last, True), (last, upto, False)]
        return [(a, b, blk) for a, b, blk in spans if b > a]

    def _read(self, session: Session, rid: str, *, after: int, upto: int, rank_after: int) -> None:
        if upto <= after and upto <= rank_after:
            return
        for a, b, from_blocks in self._spans(_SUMMARIES, after=after, upto=upto):
            if from_blocks:
                self._load_summary_blocks(session, rid, after=a, upto=b)
            else:
                self._steps.append(detector_reads.step_columns(session, run_id=rid, after=a, upto=b))
                gsteps, names, norms = detector_reads.group_norm_columns(session, run_id=rid, after=a, upto=b)
                self._groups.append([gsteps, self._codes(names), norms])

        for a, b, from_blocks in self._spans(_TENSORS, after=after, upto=upto):
            if from_blocks:
                self._load_tensor_blocks(session, rid, after=a, upto=b)
            else:
                self._read_tensors(session, rid, after=a, upto=b)

        for a, b, from_blocks in self._spans(_TIMING, after=rank_after, upto=upto):
            if from_blocks:
                blocks = detector_blocks.load(session, run_id=rid, source=_TIMING, first=a + 1 - BLOCK_STEPS[_TIMING],
                                              last=b)  # fmt: skip
                self._ranks.append_blocks(blocks, after=a)
            else:
                self._ranks.append(detector_reads.rank_timing_columns(session, run_id=rid, after=a, upto=b))

    def _codes(self, names: Sequence[str] | np.ndarray) -> np.ndarray:
        """The kept codes of these group names, new names given the next codes."""
        code = self._group_code
        for name in sorted(set(names) - code.keys()):
            code[name] = len(self._group_names)
            self._group_names.append(name)
        return np.array([code[n] for n in names], dtype=np.int32)

    def _summary_block(self, first: int, last: int) -> dict[str, np.ndarray]:
        """Steps first..last of the step summaries and gradient-group norms as a stored block (the
        group codes are this instance's: the block carries their names)."""
        arrays = {}
        for prefix, cols in (("step", self._steps), ("group", self._groups)):
            lo = int(np.searchsorted(cols.steps, first, side="left"))
            hi = int(np.searchsorted(cols.steps, last, side="right"))
            arrays.update({f"{prefix}_c{i}": c[lo:hi] for i, c in enumerate(cols.cols)})
        arrays["group_names"] = np.array(self._group_names, dtype=str)
        return arrays

    def _load_summary_blocks(self, session: Session, rid: str, *, after: int, upto: int) -> None:
        """Stored summary blocks of (after, upto]: the step and group columns appended at once."""
        held = {"step": self._steps, "group": self._groups}  # by the blocks' array prefix
        parts: dict[str, list[list[np.ndarray]]] = {prefix: [] for prefix in held}
        first = after + 1 - BLOCK_STEPS[_SUMMARIES]  # the first block may start at or below after
        for b in detector_blocks.load(session, run_id=rid, source=_SUMMARIES, first=first, last=upto):
            for prefix, kept in held.items():
                cols = [b[f"{prefix}_c{i}"] for i in range(len(kept.dtypes))]
                lo = int(np.searchsorted(cols[0], after, side="right"))
                parts[prefix].append([c[lo:] for c in cols])
            group = parts["group"][-1]
            group[1] = self._codes(b["group_names"].tolist())[group[1]]  # the block's codes -> ours
        for prefix, kept in held.items():
            if parts[prefix]:
                kept.append([np.concatenate(c) for c in zip(*parts[prefix], strict=True)])

    def _load_tensor_blocks(self, session: Session, rid: str, *, after: int, upto: int) -> None:
        """Stored tensor blocks of (after, upto], each tensor's rows appended at once."""
        pieces: dict[tuple[str, str], list[list[np.ndarray]]] = {}
        first = after + 1 - BLOCK_STEPS[_TENSORS]  # the first block may start at or below after
        for b in detector_blocks.load(session, run_id=rid, source=_TENSORS, first=first, last=upto):
            ends = np.cumsum(b["count"])
            cols = [_tensor_column(b, i) for i in range(len(TENSOR_DTYPES))]
            for i, key in enumerate(zip(b["tensor"].tolist(), b["role"].tolist(), strict=True)):
                lo, hi = int(ends[i] - b["count"][i]), int(ends[i])
                lo += int(np.searchsorted(cols[0][lo:hi], after, side="right"))
                if hi > lo:
                    if key not in self._tensors:
                        self._tensors[key] = (str(b["format"][i]), bool(b["shadow"][i]), _Columns(TENSOR_DTYPES))
                    pieces.setdefault(key, []).append([c[lo:hi] for c in cols])
        for key, parts in pieces.items():
            self._tensors[key][2].append([np.concatenate(c) for c in zip(*parts, strict=True)])

    def _read_tensors(self, session: Session, rid: str, *, after: int, upto: int) -> None:
        """Tensor summaries, each tensor's rows appended to its columns."""
        for rows in detector_reads.tensor_rows(session, run_id=rid, after=after, upto=upto):
            if rows.key not in self._tensors:
                self._tensors[rows.key] = (rows.format, rows.shadow, _Columns(TENSOR_DTYPES))
            self._tensors[rows.key][2].append(rows.columns)

    def _series(self, session: Session, run: Run, *, now: float, peak_flops_total: float | None) -> RunSeries:
        steps = _run_steps(self._steps.cols, with_mfu=bool(peak_flops_total))
        groups = None
        if len(self._groups.steps):
            gsteps, codes, norms = self._groups.cols
            present = np.unique(codes)
            names = sorted(self._group_names[k] for k in present)
            column = np.full(len(self._group_names), -1, dtype=np.int64)
            column[[self._group_code[n] for n in names]] = np.arange(len(names))
            steps_u, row = np.unique(gsteps, return_inverse=True)
            matrix = np.full((len(steps_u), len(names)), np.nan)
            matrix[row, column[codes]] = norms
            groups = GroupGradNorms(steps=steps_u, groups=names, norms=matrix)

        reg = run.registration or {}
        recipe = reg.get("fp8") or {}
        history_len = recipe.get("history_len")
        tensors = []
        for (name, role), (fmt, shadow, cols) in sorted(self._tensors.items()):
            st, amax, headroom, lag, sat, under, nonfinite, crest = cols.cols
            tensors.append(
                TensorSeries(
                    tensor=name,
                    role=role,
                    format=fmt,
                    shadow=shadow,
                    steps=st,
                    amax=amax,
                    headroom_bits=headroom,
                    lag_bits=lag,
                    sat_frac=sat,
                    underflow_frac=under,
                    nonfinite=nonfinite,
                    crest_bits=crest,
                    history_len=history_len,
                )  # fmt: skip
            )
        rid = run.run_id
        expected = expectations.mfu_expectation(reg)  # the cost model once, not per field
        checkpoints = generation_events(queries.checkpoint_generations(session, run_id=rid))
        events = [
            RunEvent(event=e.event, ts=e.ts, step=e.step, detail=e.detail, rank=e.rank)
            for e in detector_reads.events(session, run_id=rid)
        ]
        return RunSeries(
            run=rid,
            steps=steps,
            groups=groups,
            tensors=tensors,
            ranks=self._ranks.series(),
            checkpoints=checkpoints,
            events=events,
            expected_mfu=None if expected is None else expected.predicted,
            expected_mfu_low=None if expected is None else expected.low,
            mfu_convention=None if expected is None else expected.convention,
            peak_flops_total=peak_flops_total,
            # Registered so, or seen: a tensor read from an FP8 recipe (not a shadow) trains in FP8.
            fp8_training=bool(recipe.get("enabled")) or any(not t.shadow for t in tensors),
            checkpoint_interval_seconds=(reg.get("checkpoint") or {}).get("interval_seconds"),
            warmup_steps=reg.get("detector_warmup_steps"),
            now=now,
        )


def _run_steps(c: list[np.ndarray], *, with_mfu: bool) -> RunSteps:
    """RunSteps from step_columns (STEP_DTYPES)."""
    return RunSteps(
        steps=c[0],
        loss=c[1],
        grad_norm=c[2],
        grad_nonfinite=c[3],
        step_seconds=c[4],
        ts=c[5],
        tokens=c[6],
        flops=c[7],
        loss_nonfinite=c[8],
        mfu=c[9] if with_mfu else None,
        skipped=c[10] > 0,
    )


def generation_events(generations: Sequence[dict[str, Any]]) -> list[CheckpointEvent]:
    """The checkpoint detectors' events, one per generation (`queries.checkpoint_generations`:
    failed if any rank failed, persisted only once every rank that started it did), by time. Not
    each rank's records: the detectors judged those one at a time, so one rank's 'persisted' made a
    generation another rank failed a rollback target, and hid its failure. A deleted generation is
    its save followed by the deletion, as a single rank's records say it."""
    out = []
    for g in generations:
        common = {
            "generation": g["generation"],
            "step": g["step"],
            "ts": g["ts"],
            "stall_seconds": g["stall_seconds"],
            "persist_seconds": g["persist_seconds"],
            "incarnation": g["incarnation"],
        }
        if g["status"] == "deleted":
            out.append(CheckpointEvent(status="persisted", **common))
        out.append(CheckpointEvent(status=g["status"], **common))
    return sorted(out, key=lambda e: e.ts)
