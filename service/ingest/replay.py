"""`trainvitals replay FILE...`: ingest recorded wire-format JSONL through the live ingest path
(register_run / store_batch), then analyse each run over its whole history: the pipeline walks
it in the cycles a live collector would have run (pipeline.process_run), so a fault early in a run
longer than the detectors' lookback is found with its own onset, as it would have been live.

Input lines are run registrations or batches (an agent's spool or record_file is such a file).
A malformed line is counted and reported, never half-stored; the rest of the file still loads.
Replaying the same file twice stores nothing new (batches are idempotent).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError
from sqlalchemy.orm import Session

from trainvitals.service.analysis import pipeline
from trainvitals.service.store import batches, queries, run_keys
from trainvitals.service.store.lease import AnalysisLease
from trainvitals.wire import Batch, RunRegistration


@dataclass(kw_only=True, slots=True)
class ReplayReport:
    lines: int = 0
    registrations: int = 0
    batches: int = 0
    duplicates: int = 0
    records: int = 0
    rejected_lines: int = 0
    errors: list[str] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    steps_reduced: int = 0
    analysis: str = "not asked"


def replay_lines(
    session: Session, lines: Iterable[tuple[str, int, bytes]], report: ReplayReport, *, project: str | None = None
) -> None:
    """project: store every run in this project, whatever the registrations name (a job that
    named the wrong one); None: the registrations' own."""
    runs = set(report.runs)  # keys (store/run_keys.py)
    projects: dict[str, str] = {}  # run id -> project, from the registrations read so far
    keys: dict[tuple[str, str | None], str] = {}  # (run id, project named) -> key, looked up once
    for source, lineno, raw in lines:
        if not raw.strip():
            continue
        report.lines += 1
        try:
            body = json.loads(raw)
            if isinstance(body, dict) and "records" in body:
                batch = Batch.model_validate(body)
                # A batch names no project: its registration's in this file, else the one run with its id.
                named = project or projects.get(batch.run)
                ack = batches.store_batch(session, batch, project=named)
                report.batches += 1
                report.duplicates += int(ack.duplicate)
                report.records += ack.accepted
                if (batch.run, named) not in keys:
                    keys[batch.run, named] = run_keys.resolve(session, batch.run, named) or batch.run
                runs.add(keys[batch.run, named])
            else:
                reg = RunRegistration.model_validate(body)
                if project is not None:
                    reg = reg.model_copy(update={"project": project})
                batches.register_run(session, reg)
                report.registrations += 1
                projects[reg.run] = reg.project
                runs.add(run_keys.run_key(reg.project, reg.run))
        except (ValueError, ValidationError, LookupError) as exc:  # JSON, schema, unknown run, project
            session.rollback()
            report.rejected_lines += 1
            if len(report.errors) < 10:
                report.errors.append(f"{source}:{lineno}: {str(exc).splitlines()[0][:300]}")
    report.runs = sorted(runs)


def replay_files(
    session: Session,
    files: Iterable[str],
    *,
    analyse: bool = True,
    config: pipeline.PipelineConfig | None = None,
    project: str | None = None,
) -> ReplayReport:
    """Store every line of `files` (in `project`, see replay_lines), then (analyse) analyse each
    run they touched over its whole history, with `config` (None: the defaults, as `trainvitals
    replay` uses)."""
    report = ReplayReport()

    def lines() -> Iterable[tuple[str, int, bytes]]:
        for name in files:
            with open(Path(name), "rb") as fh:
                for i, raw in enumerate(fh, 1):
                    yield name, i, raw

    replay_lines(session, lines(), report, project=project)
    config = config or pipeline.PipelineConfig()
    if not analyse:
        return report
    # A collector's analysis process may hold the lease on this database: two analysers would race
    # on the same summaries and findings, so the replayed runs are then left to it.
    lease = AnalysisLease(session.get_bind().engine)
    if not lease.acquire():
        report.analysis = (
            "skipped: a collector holds the analysis lease on this database and analyses the replayed runs "
            "at its next cycle (judged as of now); stop it first to analyse them here as of their own end"
        )
        return report
    try:
        for run_id in report.runs:
            run = queries.get_run(session, run_id=run_id)
            if run is not None:
                # A recording is judged as of its own end, not today: an old run is not "stalled".
                # Its end plus the settle time: a step a rank never sent (the ranks that died with
                # the job) has waited its whole settle time, so the tail is reduced and analysed.
                end = queries.last_step_time(session, run_id=run_id)
                now = end + pipeline.settle_seconds_for(run, config) if end is not None else time.time()
                report.steps_reduced += pipeline.process_run(session, run, now=now, config=config)
    finally:
        lease.release()
    report.analysis = "done"
    return report
