"""Collector settings: one pydantic-settings object, from flags or TRAINVITALS_* variables."""

from __future__ import annotations

import difflib
import os
from typing import Any, Literal

from pydantic import Field, ValidationError, create_model
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainvitals.service.store.db import DEFAULT_SQLITE_URL
from trainvitals.wire.conventions import DEFAULT_DETECTOR_WARMUP_STEPS


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINVITALS_")

    db: str = Field(DEFAULT_SQLITE_URL, description="SQLAlchemy URL; postgresql+psycopg://... for PostgreSQL")
    host: str = Field("127.0.0.1", description="bind address; loopback unless you mean it")
    port: int = Field(8000, ge=1, le=65535)
    migrate_on_start: bool = True
    auth: bool = Field(True, description="require bearer tokens; off only for local demos (--insecure-no-auth)")
    token_cache_seconds: float = Field(30.0, ge=0, description="token lookups are cached this long")
    max_body_bytes: int = Field(32 * 1024 * 1024, description="larger requests get 413")
    max_large_bodies: int = Field(
        2, ge=1, description="ingest bodies over 1 MiB read and decoded at once per process; beyond, 503 (retry)"
    )
    header_timeout_seconds: float = Field(
        10.0, gt=0, description="a request's line and headers must arrive within this, else the connection closes"
    )
    body_timeout_seconds: float = Field(
        60.0, gt=0, description="a request's body must arrive within this after its headers, else 408"
    )
    keep_alive_seconds: int = Field(5, ge=1, description="idle keep-alive connections are closed after this")
    max_connections: int = Field(
        20_000,
        ge=1,
        description="open connections (or requests in progress) beyond which new requests get 503; "
        "16,384 ranks on one collector plus operators; the open-files limit (ulimit -n) must allow it",
    )
    api_docs: bool = Field(False, description="serve /docs and /openapi.json (--api-docs)")
    ingest_writer_threads: int | None = Field(
        None, ge=1, description="group-commit writer threads; default 2 on PostgreSQL, 1 on SQLite"
    )
    ingest_group_wait_ms: float | None = Field(
        None, ge=0, le=1000, description="how long a group-commit writer that found a small group waits for more "
        "batches before it writes (larger transactions cost the database less a record); default 5 on PostgreSQL, "
        "0 on SQLite; with the ingest journal, at least 50 for a group of batches acknowledged from it",
    )
    ingest_synchronous_commit: bool = Field(
        False,
        description="PostgreSQL: true, ingest commits keep the database's synchronous_commit (a batch is "
        "acknowledged once its WAL is on disk); false (default), they commit with synchronous_commit off: "
        "acknowledged at commit, on disk within ~0.6 s, so a collector crash loses nothing and a database "
        "crash the last fraction of a second (SQLite's WAL with synchronous=NORMAL is the same trade)",
    )
    ingest_journal_dir: str | None = Field(
        None,
        description="a directory for the ingest journal: a batch is acknowledged once appended there, before "
        "its database commit, while fewer than ingest_journal_ack_records records wait (a closed loop of senders "
        "carried 1.4-2x as much on PostgreSQL, 2 cores). A collector crash loses nothing (the next start "
        "replays it); a host crash or the directory's loss, what was not yet committed. Unset (default): "
        "acknowledged after commit",
    )
    ingest_journal_ack_records: int = Field(
        65_536, ge=1, description="with ingest_journal_dir: the writers' backlog under which batches are "
        "acknowledged from the journal; beyond it they wait for their commit",
    )
    max_pending_records: int = Field(
        2_000_000, ge=1, description="records accepted but not yet written; beyond this, 503 (retry)"
    )
    finished_run_grace_seconds: float = Field(300.0, description="finished runs stay in /metrics this long")
    idle_run_seconds: float = Field(3600.0, description="runs silent this long leave /metrics")
    top_k: int = Field(10, ge=1, le=100, description="worst tensors / slowest ranks exported per run")
    max_grad_groups: int = Field(256, ge=1, description="per-group gradient norms exported per run, at most")
    run_analysis: bool = Field(True, description="reduce + detect in a background thread")
    analysis_interval_seconds: float = Field(2.0, gt=0, description="reduce + detect cadence for live runs")
    settle_seconds: float = Field(30.0, ge=0, description="reduce a step once all ranks sent it or after this")
    detector_warmup_steps: int = Field(
        DEFAULT_DETECTOR_WARMUP_STEPS, ge=0, description="detectors stay quiet this many steps from the start"
    )
    rank_window_steps: int = Field(50, ge=1, description="steps per rank window (straggler view)")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="trainvitals and Uvicorn log level (service/logs.py); other libraries log warnings"
    )
    log_summary_seconds: float = Field(
        60.0, ge=0, description="one ingest summary line per this many seconds while there is traffic; 0: none"
    )

    @property
    def ingest_writer_thread_count(self) -> int:
        """The group-commit writer threads: the setting, else 2 on PostgreSQL (one group is sent
        while the server commits the other's) and 1 on SQLite (one writer at a time)."""
        return self.ingest_writer_threads or (1 if self.db.startswith("sqlite") else 2)

    @property
    def ingest_group_wait_s(self) -> float:
        """The writers' wait for a fuller group (service/ingest/batch_writer.py), in seconds: the
        setting, else 5 ms on PostgreSQL (a transaction's fixed work is most of what a small group
        costs the server) and 0 on SQLite (its one writer's groups fill while its last commit runs)."""
        ms = self.ingest_group_wait_ms
        if ms is None:
            ms = 0.0 if self.db.startswith("sqlite") else 5.0
        return ms / 1000

    def as_env(self) -> dict[str, str]:
        """These settings as TRAINVITALS_* variables (how `serve --workers` hands them to its processes)."""
        return {
            f"TRAINVITALS_{name.upper()}": str(value).lower() if isinstance(value, bool) else str(value)
            for name, value in self.model_dump().items()
            if value is not None
        }


class ConfigError(ValueError):
    """A setting that cannot work; the message names the variable or flag, the value and the fix."""


_FLAGS = {"db": "--db", "host": "--host", "port": "--port", "log_level": "--log-level"}
# Kubernetes gives every pod <SERVICE>_PORT=tcp://IP:PORT, <SERVICE>_SERVICE_HOST, ... for each
# Service in its namespace: a Service named `trainvitals` sets TRAINVITALS_PORT that way.
_KUBERNETES_LINK = ("_SERVICE_HOST", "_SERVICE_PORT", "_PORT_")
# Read by others, not settings: the agent's (agent/_config.py) and serve's hand-over to its child.
_NOT_SETTINGS = frozenset({
    "TRAINVITALS_COLLECTOR", "TRAINVITALS_TOKEN", "TRAINVITALS_PROJECT", "TRAINVITALS_DISABLE",
    "TRAINVITALS_SPILL_DIR", "TRAINVITALS_ANALYSE_PARENT_PID",
})  # fmt: skip
_MEANT = {  # names people guess, and serve's flags without a variable of the same name
    "TRAINVITALS_DATABASE_URL": "TRAINVITALS_DB",
    "TRAINVITALS_DATABASE": "TRAINVITALS_DB",
    "TRAINVITALS_DB_URL": "TRAINVITALS_DB",
    "TRAINVITALS_INSECURE_NO_AUTH": "TRAINVITALS_AUTH=false",
    "TRAINVITALS_WORKERS": "serve --workers N",
    "TRAINVITALS_ANALYSIS_THREAD": "serve --analysis-thread",
}


def load(**overrides: Any) -> Settings:
    """Settings from flags (`overrides`) over TRAINVITALS_* variables; ConfigError (one line per bad
    value: where it came from, what it must be) instead of pydantic's multi-line ValidationError."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError("; ".join(_problem(error, overrides) for error in exc.errors())) from None


class _OneSetting(BaseSettings):
    model_config = Settings.model_config


def load_one(name: str) -> Any:
    """One setting from its TRAINVITALS_* variable (else its default), checked as load() checks it,
    without reading the others: a command that needs one setting must not fail on another's value
    (`query runs` on serve's TRAINVITALS_PORT, which Kubernetes sets to tcp://IP:PORT)."""
    field = Settings.model_fields[name]
    definition: dict[str, Any] = {name: (field.annotation, field)}
    only = create_model(f"Only_{name}", __base__=_OneSetting, **definition)
    try:
        return getattr(only(), name)
    except ValidationError as exc:
        raise ConfigError("; ".join(_problem(error, {}) for error in exc.errors())) from None


def _problem(error: Any, overrides: dict[str, Any]) -> str:
    name = str(error["loc"][0]) if error["loc"] else "?"
    env = f"TRAINVITALS_{name.upper()}"
    source = _FLAGS.get(name, name) if name in overrides else env
    reason = str(error["msg"]).removeprefix("Input ").removeprefix("Value error, ")
    line = f"{source}={error['input']!r}: {reason[:1].lower()}{reason[1:]}"
    if source == env and name == "port" and str(error["input"]).startswith("tcp://"):
        return (f"{line} ({env} looks like Kubernetes' service link for a Service named trainvitals: pass --port, "
                "or set enableServiceLinks: false in the pod spec)")
    return line + (f": fix or unset {env}" if source == env else "")


def misspelt_variables(environ: dict[str, str] | None = None) -> list[str]:
    """TRAINVITALS_* variables that set nothing but look meant to (for a warning at start):
    `TRAINVITALS_MAX_BODY_SIZE (did you mean TRAINVITALS_MAX_BODY_BYTES?)`. Others' variables
    (the agent's, Kubernetes' service links) are left out, and so is anything not close to a setting."""
    fields = {name.upper(): f"TRAINVITALS_{name.upper()}" for name in Settings.model_fields}
    lines = []
    for var in sorted(environ if environ is not None else os.environ):
        suffix = var.removeprefix("TRAINVITALS_")
        if suffix == var or suffix in fields or var in _NOT_SETTINGS or any(k in var for k in _KUBERNETES_LINK):
            continue
        if var in _MEANT:
            lines.append(f"{var} (did you mean {_MEANT[var]}?)")
        elif close := difflib.get_close_matches(suffix, fields, n=1, cutoff=0.7):
            lines.append(f"{var} (did you mean {fields[close[0]]}?)")
    return lines
