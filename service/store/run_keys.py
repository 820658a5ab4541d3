"""Run ids belong to their project: the key a run is stored under.

Two projects may each have a run `nightly`: rows are stored under the run's key, which is the
bare id for the `default` project and `<project>/<run>` for any other. A run id cannot contain
`/` (wire/v1.py), so the key is unambiguous, and the id is what follows the last `/`.

The default project keeps bare ids so that a single-project deployment (auth off, or one
project's tokens) stores, serves and labels runs exactly as before project scoping, and its
existing rows need no rewrite (migration 0016 rewrites only other projects' runs).

With auth on, the caller's token names the project, so a key is computed, never looked up. With
auth off nothing names it (a batch carries only the run id): `key_by_id` finds the default
project's run with that id, else the one other project's, and registration keeps ids unique across
projects while auth is off.
"""

from __future__ import annotations

from typing import Any

import msgspec
from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from trainvitals.service.store.models import RUN_KEY_LENGTH, Run
from trainvitals.wire.conventions import DEFAULT_PROJECT

SEPARATOR = "/"
assert RUN_KEY_LENGTH >= 256 + len(SEPARATOR) + 128  # project, separator, run id (wire/v1.py bounds)


class AmbiguousRunError(LookupError):
    """Auth is off and several projects have a run with this id: the caller must name one."""


def run_key(project: str, run: str) -> str:
    """The key `run` of `project` is stored under."""
    return run if project == DEFAULT_PROJECT else f"{project}{SEPARATOR}{run}"


def no_run_key(project: str | None) -> str:
    """The ingest_counts key of a project's batches that belong to no run of it: a deleted run's
    counts, and batches refused for a run the project has not registered. Never a run's key (a run
    id is not empty); '' when no project is known (auth off)."""
    return "" if project is None else f"{project}{SEPARATOR}"


def project_and_id(key: str) -> tuple[str | None, str]:
    """A key's project (None for a bare id: the default project's, or a label that names none) and
    run id. A run id never holds the separator, so a `/metrics` label `team-a/x` splits the same way."""
    project, separator, run = key.rpartition(SEPARATOR)
    return (project if separator else None), run


def run_id_of(key: str) -> str:
    """The run id a key stores (what users, URLs and metric labels name)."""
    return project_and_id(key)[1]


def keys_by_id(session: Session, run: str) -> list[str]:
    """The keys of the runs with id `run`, in any project."""
    rows = session.scalars(
        select(Run.run_id).where(or_(Run.run_id == run, Run.run_id.endswith(SEPARATOR + run, autoescape=True)))
    )
    return sorted(k for k in rows if run_id_of(k) == run)


def key_by_id(session: Session, run: str) -> str | None:
    """Auth off: the key of run id `run` (None: no such run). The default project's run of that id
    if there is one (a key lookup: the common case, and ingest's with auth off), else the one run
    of another project with it.

    Raises AmbiguousRunError naming the projects when several other projects have one (runs
    registered while auth was on): the caller then names the project."""
    if session.scalar(select(Run.run_id).where(Run.run_id == run)) is not None:
        return run
    keys = keys_by_id(session, run)
    if len(keys) > 1:
        projects = ", ".join(repr(project_and_id(k)[0]) for k in keys)
        raise AmbiguousRunError(f"run {run!r} exists in projects {projects}")
    return keys[0] if keys else None


def key_for(project: str, run: str) -> str:
    """`run_key`, where `run` may already be a key (a batch keyed on the request's thread)."""
    return run if SEPARATOR in run else run_key(project, run)


def resolve(session: Session, run: str, project: str | None) -> str | None:
    """The key of `run` in `project` (None: auth off, the one run with that id, see key_by_id).

    With a project the key is computed, so the run need not exist: the caller's lookup says."""
    return run_key(project, run) if project is not None else key_by_id(session, run)


def with_key(batch: Any, key: str) -> Any:
    """The batch (a pydantic wire Batch or the route's msgspec struct, both frozen) stored under
    `key`: its run field is the key from here on, so every row it becomes carries it."""
    if batch.run == key:
        return batch
    if hasattr(batch, "model_copy"):
        return batch.model_copy(update={"run": key})
    return msgspec.structs.replace(batch, run=key)
