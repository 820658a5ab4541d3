"""Post-mortem read routes: runs, tensor timelines, worst tensors, step-time matrix, findings, an
analysis on request (against a baseline run), checkpoint generations, rollback target. JSON by
default, `?format=csv` for CSV."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, HTTPException, Query, Request, Response, status
from pydantic import BaseModel
from sqlalchemy.orm import Session

from trainvitals.service.analysis import on_request
from trainvitals.service.api.deps import (
    MAX_STEP,
    RUN_ID_MAX_LENGTH,
    RUN_ID_PATTERN,
    DeletableRun,
    KnownQueryOnly,
    ReadableProject,
    ReadableRun,
    SessionDep,
    StepParam,
    TensorName,
)
from trainvitals.service.api.schemas import (
    AnalysisFindingPublic,
    CheckpointGenerationPublic,
    FindingPublic,
    RollbackPublic,
    RunOverviewPublic,
    RunPublic,
    StepTimeMatrixPublic,
    TensorStepPublic,
    WorstTensorPublic,
)
from trainvitals.service.csv_output import to_csv
from trainvitals.service.store import queries, run_keys

router = APIRouter(prefix="/v1/runs", tags=["post-mortem"], dependencies=[KnownQueryOnly])

Format = Literal["json", "csv"]
Reply = TypeVar("Reply", bound=BaseModel)
Row = TypeVar("Row", bound=BaseModel)

# Every route here can also answer text/csv: documented next to the JSON schema of its 200.
_CSV: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/csv": {"schema": {"type": "string"}}}, "description": "JSON, or CSV with ?format=csv"}
}


def _check_range(start: int | None, end: int | None) -> None:
    if start is not None and end is not None and end < start:
        raise HTTPException(422, f"start={start} is after end={end}: need start <= end")


def _reply_rows(model: type[Row], rows: Iterable[Any], fmt: Format) -> list[Row] | Response:
    """The rows as a list of the model (FastAPI renders the JSON), or as CSV: the model's fields as
    columns, in order, written even when there are no rows."""
    data = [model.model_validate(row) for row in rows]
    if fmt == "csv":
        plain = [row.model_dump() for row in data]
        return Response(to_csv(plain, columns=list(model.model_fields)), media_type="text/csv")
    return data


def _reply(data: Reply, fmt: Format) -> Reply | Response:
    """The model as JSON (FastAPI renders it), or as CSV key,value rows."""
    if fmt == "csv":
        return Response(to_csv(data.model_dump()), media_type="text/csv")
    return data


@router.get("", summary="List runs (of the token's project)", response_model=list[RunPublic], responses=_CSV)
def list_runs(session: SessionDep, project: ReadableProject, format: Format = "json") -> list[RunPublic] | Response:
    runs = [
        RunPublic(
            run=run_keys.run_id_of(r.run_id),
            project=r.project,
            status=r.status,
            world_size=r.world_size,
            created_at=r.created_at,
            last_seen_at=r.last_seen_at,
        )
        for r in queries.list_runs(session, project=project)
    ]
    return _reply_rows(RunPublic, runs, format)


@router.get(
    "/{run_id}", summary="One run: overview of what was stored", response_model=RunOverviewPublic, responses=_CSV
)
def get_run(
    run: ReadableRun, session: SessionDep, request: Request, format: Format = "json"
) -> RunOverviewPublic | Response:
    warmup = request.app.state.settings.detector_warmup_steps  # what the analysis applies
    overview = queries.run_overview(session, run_id=run.run_id, warmup_steps=warmup)
    assert overview is not None  # the run exists: ReadableRun loaded it in this session
    return _reply(RunOverviewPublic.model_validate(overview), format)


@router.delete("/{run_id}", status_code=status.HTTP_204_NO_CONTENT, summary="Delete a run and all its records")
def delete_run(run: DeletableRun, session: SessionDep) -> None:  # the admin scope: ingest and read cannot
    queries.delete_run(session, run_id=run.run_id)


@router.get(
    "/{run_id}/tensors/worst",
    summary="Tensors with the least FP8 headroom in a step range",
    response_model=list[WorstTensorPublic],
    responses=_CSV,
)
def worst_tensors(
    run: ReadableRun,
    session: SessionDep,
    start: StepParam = None,
    end: StepParam = None,
    k: int = Query(10, ge=1, le=1000),
    format: Format = "json",
) -> list[WorstTensorPublic] | Response:
    _check_range(start, end)
    rows = queries.worst_tensors(session, run_id=run.run_id, start=start, end=end, k=k)
    return _reply_rows(WorstTensorPublic, rows, format)


@router.get(
    "/{run_id}/tensors/{tensor}/timeline",
    summary="A tensor's headroom / amax per step",
    response_model=list[TensorStepPublic],
    responses=_CSV,
)
def tensor_timeline(
    run: ReadableRun,
    tensor: TensorName,
    session: SessionDep,
    role: Literal["input", "weight", "grad_output"] | None = None,
    start: StepParam = None,
    end: StepParam = None,
    format: Format = "json",
) -> list[TensorStepPublic] | Response:
    _check_range(start, end)
    try:
        rows = queries.tensor_timeline(session, run_id=run.run_id, tensor=tensor, role=role, start=start, end=end)
    except queries.TooManyRowsError as exc:
        raise HTTPException(422, str(exc)) from None
    if not rows:
        _check_tensor_and_role(session, run.run_id, tensor, role)
    return _reply_rows(TensorStepPublic, rows, format)


def _check_tensor_and_role(session: Session, run_key: str, tensor: str, role: str | None) -> None:
    """A 404 naming what is missing when the run has no such tensor, or the tensor not that role
    (an empty answer would read as "no data in this range"), as the CLI's timeline says it."""
    roles = queries.tensor_roles(session, run_id=run_key, tensor=tensor)
    run_name = run_keys.run_id_of(run_key)
    if not roles:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"run {run_name!r} has no tensor {tensor!r} (names are module names, e.g. layers.3.fc; "
            "/tensors/worst lists some)",
        )
    if role is not None and role not in roles:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"run {run_name!r}: tensor {tensor!r} has roles {', '.join(roles)}, not {role}: pass one of them "
            "as role, or leave role out",
        )


@router.get(
    "/{run_id}/ranks/step-times",
    summary="Per-rank step time matrix for a step range",
    response_model=StepTimeMatrixPublic,
    responses=_CSV,
)
def step_times(
    run: ReadableRun,
    session: SessionDep,
    start: int = Query(ge=0, le=MAX_STEP),
    end: int = Query(ge=0, le=MAX_STEP),
    format: Format = "json",
) -> StepTimeMatrixPublic | Response:
    _check_range(start, end)
    if end - start > 100_000:
        raise HTTPException(422, f"{end - start + 1} steps asked for: at most 100001 at a time")
    try:
        matrix = queries.step_time_matrix(session, run_id=run.run_id, start=start, end=end)
    except queries.TooManyRowsError as exc:
        raise HTTPException(422, str(exc)) from None
    return _reply(StepTimeMatrixPublic.model_validate(matrix), format)


@router.get(
    "/{run_id}/findings",
    summary="Detector findings with onset and detection steps",
    response_model=list[FindingPublic],
    responses=_CSV,
)
def findings(
    run: ReadableRun, session: SessionDep, active: bool = False, format: Format = "json"
) -> list[FindingPublic] | Response:
    rows = queries.findings(session, run_id=run.run_id, active_only=active)
    return _reply_rows(FindingPublic, rows, format)


@router.get(
    "/{run_id}/analysis",
    summary="The detectors run now over the stored run, against a baseline run if one is named (not stored)",
    response_model=list[AnalysisFindingPublic],
    responses={**_CSV, 404: {"description": "no such run, or the baseline is not a run of the same project"}},
)
def analysis(
    run: ReadableRun,
    session: SessionDep,
    baseline: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=RUN_ID_MAX_LENGTH,
            pattern=RUN_ID_PATTERN,
            description="run to compare with (same project); default: the registered baseline_run",
        ),
    ] = None,
    format: Format = "json",
) -> list[AnalysisFindingPublic] | Response:
    try:
        found = on_request.analyse_run(session, run, baseline=baseline)
    except on_request.UnknownBaselineError as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None
    return _reply_rows(AnalysisFindingPublic, found, format)


@router.get(
    "/{run_id}/checkpoints",
    summary="Checkpoint generations with status across ranks",
    response_model=list[CheckpointGenerationPublic],
    responses=_CSV,
)
def checkpoints(
    run: ReadableRun, session: SessionDep, format: Format = "json"
) -> list[CheckpointGenerationPublic] | Response:
    rows = queries.checkpoint_generations(session, run_id=run.run_id)
    return _reply_rows(CheckpointGenerationPublic, rows, format)


@router.get(
    "/{run_id}/rollback",
    summary="Which checkpoint generation to roll back to",
    response_model=RollbackPublic,
    responses=_CSV,
)
def rollback(
    run: ReadableRun, session: SessionDep, before_step: StepParam = None, format: Format = "json"
) -> RollbackPublic | Response:
    target = queries.rollback_target(session, run_id=run.run_id, before_step=before_step)
    return _reply(RollbackPublic.model_validate(target), format)
