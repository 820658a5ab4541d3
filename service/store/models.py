"""SQLAlchemy 2 models: the whole schema in one place (docs/schema.md describes it).

Every record table is keyed by run and step first, because every post-mortem question is "this
run, these steps". Rows are append-only; idempotency lives in `batches` (one row per delivered
(run, rank, incarnation, seq)), so record tables need no unique constraints and bulk inserts stay
cheap.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from trainvitals.service.store.types import Real

RUN_KEY_LENGTH = 385
"""A run's key: its project (256), "/" and its run id (128); store/run_keys.py."""

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL wants BIGINT for big tables.
_BigId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"

    run_id: Mapped[str] = mapped_column(String(RUN_KEY_LENGTH), primary_key=True)
    project: Mapped[str] = mapped_column(String(256), index=True)
    registration: Mapped[dict[str, Any]] = mapped_column(JSON)
    world_size: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default="running")  # running | finished
    created_at: Mapped[float] = mapped_column(Real)
    last_seen_at: Mapped[float] = mapped_column(Real)
    last_step_at: Mapped[float | None] = mapped_column(Real)
    """When the collector last stored a step record of the run, on its own clock (at most a second
    stale, as last_seen_at); NULL before the first since revision 0018. The stall age of /metrics."""


class RefusedIncarnation(Base):
    """A process whose registration was refused as another job reusing the run id
    (store/batches.py `register_run`): its batches are refused too, so none of its steps land in
    the run's history. Only a registration that names its incarnation can be fenced."""

    __tablename__ = "refused_incarnations"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True)
    incarnation: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    refused_at: Mapped[float] = mapped_column(Real)
    reason: Mapped[str] = mapped_column(Text)
    """The registration's refusal, repeated to each refused batch."""


class DeliveredBatch(Base):
    """One row per accepted batch: the primary key is the idempotency key."""

    __tablename__ = "batches"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    incarnation: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    received_at: Mapped[float] = mapped_column(Real)
    records: Mapped[int] = mapped_column(Integer)


class StepRow(Base):
    __tablename__ = "steps"
    # ts last: the analysis's settle test (store/summaries.py reducible_upto, every cycle) and the
    # scrape's newest-step age (store/snapshot.py) read it from the index, without a row lookup each
    # (revision 0022; on PostgreSQL as far as the visibility map lets an index-only scan).
    __table_args__ = (Index("ix_steps_run_step_rank_ts", "run_id", "step", "rank", "ts"),)

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(RUN_KEY_LENGTH))
    rank: Mapped[int] = mapped_column(Integer)
    incarnation: Mapped[int] = mapped_column(BigInteger)
    step: Mapped[int] = mapped_column(BigInteger)
    ts: Mapped[float] = mapped_column(Real)
    step_seconds: Mapped[float] = mapped_column(Real)
    compute_seconds: Mapped[float | None] = mapped_column(Real)
    wait_seconds: Mapped[float | None] = mapped_column(Real)
    data_seconds: Mapped[float | None] = mapped_column(Real)
    loss: Mapped[float | None] = mapped_column(Real)
    tokens: Mapped[int | None] = mapped_column(BigInteger)
    flops: Mapped[float | None] = mapped_column(Real)
    lr: Mapped[float | None] = mapped_column(Real)
    grad_norm: Mapped[float | None] = mapped_column(Real)
    pp_stage: Mapped[int | None] = mapped_column(Integer)
    tp_rank: Mapped[int | None] = mapped_column(Integer)
    dp_rank: Mapped[int | None] = mapped_column(Integer)
    skipped: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """The optimizer did not apply the step's update (a loss scaler's inf/NaN skip) (0017)."""


class TensorStatRow(Base):
    __tablename__ = "tensor_stats"
    __table_args__ = (
        # Only (run, step): the reducer's range scan. Per-tensor queries read tensor_summaries.
        Index("ix_tensor_stats_run_step", "run_id", "step"),
    )

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(RUN_KEY_LENGTH))
    rank: Mapped[int] = mapped_column(Integer)
    incarnation: Mapped[int] = mapped_column(BigInteger)
    step: Mapped[int] = mapped_column(BigInteger)
    tensor: Mapped[str] = mapped_column(String(256))
    role: Mapped[str] = mapped_column(String(16))
    format: Mapped[str] = mapped_column(String(8))
    amax: Mapped[float] = mapped_column(Real)
    scale: Mapped[float | None] = mapped_column(Real)
    headroom_bits: Mapped[float | None] = mapped_column(Real)
    lag_bits: Mapped[float | None] = mapped_column(Real)
    staleness_steps: Mapped[int | None] = mapped_column(Integer)
    sat_frac: Mapped[float | None] = mapped_column(Real)
    underflow_frac: Mapped[float | None] = mapped_column(Real)
    crest_bits: Mapped[float | None] = mapped_column(Real)
    nonfinite: Mapped[int | None] = mapped_column(BigInteger)
    shadow: Mapped[bool] = mapped_column(Boolean, default=False)


class GradStatRow(Base):
    __tablename__ = "grad_stats"
    __table_args__ = (Index("ix_grad_stats_run_step", "run_id", "step"),)

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(RUN_KEY_LENGTH))
    rank: Mapped[int] = mapped_column(Integer)
    incarnation: Mapped[int] = mapped_column(BigInteger)
    step: Mapped[int] = mapped_column(BigInteger)
    group_name: Mapped[str] = mapped_column(String(256))
    owned_sq: Mapped[float] = mapped_column(Real)
    local_sq: Mapped[float] = mapped_column(Real)
    nonfinite: Mapped[int] = mapped_column(BigInteger, default=0)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        Index("ix_checkpoints_run_generation", "run_id", "generation"),
        Index("ix_checkpoints_run_status_step", "run_id", "status", "step"),
    )

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(RUN_KEY_LENGTH))
    rank: Mapped[int] = mapped_column(Integer)
    incarnation: Mapped[int] = mapped_column(BigInteger)
    step: Mapped[int] = mapped_column(BigInteger)
    generation: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    ts: Mapped[float] = mapped_column(Real)
    path: Mapped[str | None] = mapped_column(Text)
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    stall_seconds: Mapped[float | None] = mapped_column(Real)
    persist_seconds: Mapped[float | None] = mapped_column(Real)
    checksum: Mapped[str | None] = mapped_column(String(128))
    error: Mapped[str | None] = mapped_column(Text)


class EventRow(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_ts", "run_id", "ts"),)

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(RUN_KEY_LENGTH))
    rank: Mapped[int] = mapped_column(Integer)
    incarnation: Mapped[int] = mapped_column(BigInteger)
    ts: Mapped[float] = mapped_column(Real)
    step: Mapped[int | None] = mapped_column(BigInteger)
    event: Mapped[str] = mapped_column(String(32))
    detail: Mapped[str | None] = mapped_column(Text)
    domains: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)


def table_of(model: type[Base]) -> Table:
    """A model's Table (`Model.__table__` is typed as a FromClause, which Core DML does not take)."""
    return Base.metadata.tables[model.__tablename__]


# Which table each wire record kind lands in; the ingest path and replay share it.
RECORD_TABLES = {
    "step": table_of(StepRow),
    "tensor": table_of(TensorStatRow),
    "grad": table_of(GradStatRow),
    "checkpoint": table_of(CheckpointRow),
    "event": table_of(EventRow),
}


# --------------------------------------------------------------------------- reduced (cross-rank)


class StepSummary(Base):
    """One step of a run reduced over ranks (newest incarnation per rank)."""

    __tablename__ = "step_summaries"

    run_id: Mapped[str] = mapped_column(String(RUN_KEY_LENGTH), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    ranks: Mapped[int] = mapped_column(Integer)
    ts: Mapped[float] = mapped_column(Real)
    step_seconds_min: Mapped[float] = mapped_column(Real)
    step_seconds_p50: Mapped[float] = mapped_column(Real)
    step_seconds_p90: Mapped[float] = mapped_column(Real)
    step_seconds_p99: Mapped[float] = mapped_column(Real)
    step_seconds_max: Mapped[float] = mapped_column(Real)
    slowest_rank: Mapped[int] = mapped_column(Integer)
    compute_seconds_p50: Mapped[float | None] = mapped_column(Real)
    wait_seconds_p50: Mapped[float | None] = mapped_column(Real)
    data_seconds_p50: Mapped[float | None] = mapped_column(Real)
    loss: Mapped[float | None] = mapped_column(Real)
    """Mean over the ranks that reported a finite loss."""
    loss_nonfinite: Mapped[int] = mapped_column(Integer, default=0)
    """Ranks that reported a NaN/inf loss (kept apart: a mean would hide or be poisoned by them)."""
    grad_norm: Mapped[float | None] = mapped_column(Real)
    """Job-reported (pre-clip) total when present, else sqrt of summed owned squares."""
    agent_grad_norm: Mapped[float | None] = mapped_column(Real)
    """sqrt(sum over ranks of owned_sq): the gradients the optimizer applied."""
    grad_nonfinite: Mapped[int] = mapped_column(BigInteger, default=0)
    skipped_ranks: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Ranks whose optimizer did not apply the step's update (a loss scaler's skip) (0017)."""
    tokens: Mapped[float | None] = mapped_column(Real)
    flops: Mapped[float | None] = mapped_column(Real)
    mfu: Mapped[float | None] = mapped_column(Real)
    """flops / (step_seconds_max x peak_flops_total): computed once, by the reduction."""
    peak_flops_total: Mapped[float | None] = mapped_column(Real)
    """The run's peak FLOP/s summed over its devices (registration), the MFU's denominator; stored
    so that readers (the window MFU of /metrics) divide by it instead of inverting `mfu` (0008)."""
    stage_step_seconds_p50: Mapped[dict[str, float] | None] = mapped_column(JSON)
    """Per pipeline stage (key: stage number) median step time, when stages are known."""


class TensorSummary(Base):
    """One monitored tensor at one step, reduced over ranks and TP shards."""

    __tablename__ = "tensor_summaries"
    __table_args__ = (
        Index("ix_tensor_summaries_run_step", "run_id", "step"),
        # The rows with a crest, measured on the agent's expensive steps only (every 200th by
        # default): the scrape finds the newest such step by a seek, not by reading back over every
        # tensor of every step since (0019). Small: one step in 200 has entries.
        Index(
            "ix_tensor_summaries_run_crest_step",
            "run_id",
            "step",
            sqlite_where=text("crest_bits IS NOT NULL"),
            postgresql_where=text("crest_bits IS NOT NULL"),
        ),
    )

    run_id: Mapped[str] = mapped_column(String(RUN_KEY_LENGTH), primary_key=True)
    tensor: Mapped[str] = mapped_column(String(256), primary_key=True)
    role: Mapped[str] = mapped_column(String(16), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    format: Mapped[str] = mapped_column(String(8))
    amax: Mapped[float] = mapped_column(Real)  # max over ranks
    headroom_bits: Mapped[float | None] = mapped_column(Real)  # min over ranks
    lag_bits: Mapped[float | None] = mapped_column(Real)  # max
    staleness_steps: Mapped[int | None] = mapped_column(Integer)  # max
    sat_frac: Mapped[float | None] = mapped_column(Real)  # max
    underflow_frac: Mapped[float | None] = mapped_column(Real)  # max
    crest_bits: Mapped[float | None] = mapped_column(Real)  # max
    nonfinite: Mapped[int | None] = mapped_column(BigInteger)  # sum
    shadow: Mapped[bool] = mapped_column(Boolean, default=False)


class GradSummary(Base):
    """Per parameter group gradient norm at one step: sqrt(sum over ranks of owned_sq)."""

    __tablename__ = "grad_summaries"
    __table_args__ = (Index("ix_grad_summaries_run_step", "run_id", "step"),)

    run_id: Mapped[str] = mapped_column(String(RUN_KEY_LENGTH), primary_key=True)
    group_name: Mapped[str] = mapped_column(String(256), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    norm: Mapped[float] = mapped_column(Real)
    nonfinite: Mapped[int] = mapped_column(BigInteger, default=0)
    replica_spread: Mapped[float | None] = mapped_column(Real)
    """max/min of local_sq over ranks holding the same replica (DDP): != 1 means replicas disagree."""


class RankWindow(Base):
    """Per rank, a window of `steps` consecutive steps: the straggler view at bounded size."""

    __tablename__ = "rank_windows"
    __table_args__ = (Index("ix_rank_windows_run_rank", "run_id", "rank", "window_start"),)

    run_id: Mapped[str] = mapped_column(String(RUN_KEY_LENGTH), primary_key=True)
    window_start: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    steps: Mapped[int] = mapped_column(Integer)
    pp_stage: Mapped[int | None] = mapped_column(Integer)
    step_seconds_mean: Mapped[float] = mapped_column(Real)
    step_seconds_p50: Mapped[float] = mapped_column(Real)
    step_seconds_max: Mapped[float] = mapped_column(Real)
    compute_seconds_mean: Mapped[float | None] = mapped_column(Real)
    wait_seconds_mean: Mapped[float | None] = mapped_column(Real)


class ReductionState(Base):
    """How far each run has been reduced, and from where late data forces a redo."""

    __tablename__ = "reduction_state"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True)
    reduced_upto: Mapped[int] = mapped_column(BigInteger, default=-1)
    dirty_from: Mapped[int | None] = mapped_column(BigInteger)
    # The claim protocol between ingest and the reduction (store/summaries.py, revision 0014).
    claimed_upto: Mapped[int] = mapped_column(BigInteger, default=-1, server_default="-1")
    """Newest step a reduction has claimed (ahead of reduced_upto while one runs): ingest re-dirties
    a step at or below it."""
    dirty_marks: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    """Bumped by every ingest that re-dirties a step: a reduction clears dirty_from only if none came
    while it ran."""


class FindingRow(Base):
    """A detector finding; one row per (run, kind, subject), updated as it evolves."""

    __tablename__ = "findings"
    __table_args__ = (
        Index("ux_findings_identity", "run_id", "kind", "subject_kind", "subject", unique=True),
    )

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(RUN_KEY_LENGTH))
    kind: Mapped[str] = mapped_column(String(64))
    severity: Mapped[str] = mapped_column(String(8))
    subject_kind: Mapped[str] = mapped_column(String(16))
    subject: Mapped[str] = mapped_column(String(256))
    onset_step: Mapped[int] = mapped_column(BigInteger)
    # The step the finding was first raised at; None for findings stored before revision 0009.
    # Both are kept while the finding stays open (store/findings.py: the onset only moves earlier).
    detected_step: Mapped[int | None] = mapped_column(BigInteger)
    # The first step the episode was a page, kept like detected_step; None if it never paged, or
    # stored before revision 0020. Declared here, where the API's columns have it (the table holds
    # it last: 0020 adds it).
    paged_step: Mapped[int | None] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    magnitude: Mapped[float] = mapped_column(Real)
    summary: Mapped[str] = mapped_column(Text)
    active: Mapped[bool] = mapped_column(Boolean, default=True)
    first_seen_at: Mapped[float] = mapped_column(Real)
    updated_at: Mapped[float] = mapped_column(Real)


class ApiToken(Base):
    """Bearer tokens, stored as SHA-256 digests; scoped to one project and one scope."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(_BigId, primary_key=True, autoincrement=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True)
    project: Mapped[str] = mapped_column(String(256))
    scope: Mapped[str] = mapped_column(String(16))  # ingest | read
    name: Mapped[str | None] = mapped_column(String(256))
    created_at: Mapped[float] = mapped_column(Real)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)


class IngestCount(Base):
    """Batches and records by outcome, per run and per writer thread of every collector process.

    Updated inside the transaction that stores the batches, so the counts are exact; one row per
    writer (not one per run) so concurrent transactions never wait on each other's counter row.
    Summed at scrape time: any collector process sharing the database exports the same totals.
    """

    __tablename__ = "ingest_counts"

    run_id: Mapped[str] = mapped_column(String(RUN_KEY_LENGTH), primary_key=True)  # '' for batches of unknown runs
    outcome: Mapped[str] = mapped_column(String(16), primary_key=True)  # stored | duplicate | rejected
    writer: Mapped[str] = mapped_column(String(128), primary_key=True)  # host:pid:thread
    batches: Mapped[int] = mapped_column(BigInteger, default=0)
    records: Mapped[int] = mapped_column(BigInteger, default=0)
    # Stored records per kind (revision 0006): the run overview's counts without scanning raw tables.
    step_records: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    tensor_records: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    grad_records: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    checkpoint_records: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    event_records: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class AnalysisStatus(Base):
    """The analysis worker's own counters, one row, written after every cycle by the process that
    holds the analysis lease (often not the one that serves /metrics: `serve` analyses in a child
    process). Cumulative across processes and restarts, so they export as counters (0010)."""

    __tablename__ = "analysis_status"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)  # always 1
    cycles: Mapped[int] = mapped_column(BigInteger, default=0)
    cycle_seconds_total: Mapped[float] = mapped_column(Real, default=0.0)
    errors: Mapped[int] = mapped_column(BigInteger, default=0)
    """Runs whose analysis raised (each is retried in the next cycle)."""
    last_cycle_seconds: Mapped[float | None] = mapped_column(Real)
    last_cycle_at: Mapped[float | None] = mapped_column(Real)
    """Unix seconds at the end of the newest cycle."""
    holder: Mapped[str | None] = mapped_column(String(256))
    """host:pid of the process that ran the newest cycle."""


class DetectorBlock(Base):
    """The detectors' input for a fixed range of steps as numpy arrays (0015): what the analysis
    worker read for those steps, kept so that the first cycle after a collector start or a lease
    takeover loads a few hundred MB instead of converting 17M rows (store/detector_blocks.py).
    Deleted with the range's summaries whenever the reduction rewrites a step in it."""

    __tablename__ = "detector_blocks"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True)
    source: Mapped[str] = mapped_column(String(16), primary_key=True)  # tensors | timing
    first_step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    last_step: Mapped[int] = mapped_column(BigInteger)
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    """np.savez of the block's arrays (no pickles)."""
