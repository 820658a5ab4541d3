"""The `trainvitals` console script: serve, db, token, query, replay, demo, plan, advise."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from trainvitals.service import db_url
from trainvitals.service.store.db import DEFAULT_SQLITE_URL

_LOOPBACK = ("127.0.0.1", "localhost", "::1")
ANALYSE_PARENT_ENV = "TRAINVITALS_ANALYSE_PARENT_PID"
"""Set by `serve` for its analysis child: the child stops when that process is gone."""
_LOG_LEVELS = ("debug", "info", "warning", "error")  # service/logs.py LEVELS (not imported: it loads SQLAlchemy)


@contextmanager
def _session(url: str, *, migrate: bool = False) -> Iterator[Any]:
    """A session on the database; migrate=True creates it (and its tables) when missing, which only
    commands that write may do: a reading command on a missing database says so instead."""
    from trainvitals.service.store import db

    if migrate:
        db.upgrade(url)
    else:
        db_url.check_exists(url)
        if (problem := db.schema_problem(url)) is not None:  # first: tables without a revision are not "no tables"
            raise db_url.DbUrlError(f"{db_url.describe(url)}: {problem}")
        if db.current_revision(url) is None:
            raise db_url.DbUrlError(
                f"{db_url.describe(url)} has no trainvitals tables: point --db / {db_url.ENV} at the collector's "
                f"database, or create them with `trainvitals db upgrade --db URL`"
            )
    engine = db.make_engine(url)
    try:
        with db.make_sessionmaker(engine)() as session:
            yield session
    finally:
        engine.dispose()


def _serve(args: argparse.Namespace) -> int:
    import logging

    from sqlalchemy import make_url

    from trainvitals.service import logs
    from trainvitals.service.ingest.journal import IngestJournal
    from trainvitals.service.settings import load as load_settings

    flags = {"db": args.db, "host": args.host, "port": args.port, "log_level": args.log_level}
    overrides = {k: v for k, v in flags.items() if v is not None}
    if args.insecure_no_auth:
        overrides["auth"] = False
    if args.api_docs:
        overrides["api_docs"] = True
    if args.ingest_journal:
        overrides["ingest_journal_dir"] = args.ingest_journal
    settings = load_settings(**overrides)
    if settings.ingest_journal_dir and (problem := IngestJournal.problem(settings.ingest_journal_dir)):
        print(f"trainvitals: {problem}", file=sys.stderr)
        return 2
    if (taken := _port_taken(settings.host, settings.port)) is not None:
        print(f"trainvitals: {taken}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level)
    log = logging.getLogger("trainvitals.serve")
    analysis = "off" if not settings.run_analysis else "thread" if args.analysis_thread else "process"
    # PostgreSQL only (SQLite's durability is fixed, store/db.py): whether a batch's acknowledgement
    # waits for the WAL flush (TRAINVITALS_INGEST_SYNCHRONOUS_COMMIT). None: not logged.
    commit = None
    if make_url(settings.db).get_backend_name() == "postgresql":
        commit = "sync" if settings.ingest_synchronous_commit else "async"
    group_wait_ms = f"{1000 * settings.ingest_group_wait_s:g}"  # the writers' wait for a fuller group
    # What an operator checks first: where, which database (password hidden), auth, who analyses.
    logs.log_event(
        log, "serve", listen=f"http://{settings.host}:{settings.port}", db=db_url.describe(settings.db),
        auth="on" if settings.auth else "off", workers=args.workers, analysis=analysis, ingest_commit=commit,
        ingest_group_wait_ms=group_wait_ms, ingest_journal=settings.ingest_journal_dir or "off",
        log_level=settings.log_level, summary_every_s=settings.log_summary_seconds,
    )  # fmt: skip
    _warn_misspelt(log)
    if not settings.auth:
        logs.log_event(
            log, "auth_off", level=logging.WARNING,
            msg=f"authentication is OFF (--insecure-no-auth): anyone who can reach {settings.host}:{settings.port} "
            "can write and read every run. Local demos only.",
        )  # fmt: skip
    if settings.host not in _LOOPBACK:
        reachable = f"listening on {settings.host}: reachable beyond this machine"
        logs.log_event(log, "not_loopback", level=logging.WARNING, msg=reachable)
    if args.analysis_thread or not settings.run_analysis:
        return _run_uvicorn(args, settings)
    with _analysis_process(settings):
        return _run_uvicorn(args, settings.model_copy(update={"run_analysis": False}))


def _warn_misspelt(log: Any) -> None:
    """A TRAINVITALS_* variable that looks meant as a setting but sets nothing: said, not ignored."""
    import logging

    from trainvitals.service import logs, settings

    for line in settings.misspelt_variables():
        logs.log_event(log, "unknown_setting", level=logging.WARNING, msg=f"{line}: ignored, it sets nothing")


def _port_taken(host: str, port: int) -> str | None:
    """The line that says why serve cannot listen on host:port, or None when it can. Checked before
    migrations and the analysis child: uvicorn finds out only after starting up, and its line names
    no fix (a collector still running from the README's recipe is the usual cause)."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot listen on {host!r} ({exc.strerror}): --host / TRAINVITALS_HOST takes an address of this machine"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (
                    f"{host}:{port} is already in use (another collector? `ss -ltnp 'sport = :{port}'` shows "
                    "which process): stop it, or serve on another port with --port / TRAINVITALS_PORT"
                )
            if exc.errno == errno.EACCES:
                return f"no permission to listen on port {port} (below 1024 needs root): choose --port 1024 or above"
            return f"cannot listen on {host}:{port} ({exc.strerror}): check --host / --port"
    return None


@contextmanager
def _analysis_process(settings: Any) -> Iterator[None]:
    """`trainvitals analyse` as a child process for the duration of `serve` (the default).

    Analysis is Python and numpy work of its own (seconds per cycle at 16,384 ranks); in its own
    process it does not take the ingest process's GIL, so batch latency and ingest throughput stay
    near what they are without it (docs/performance.md), and ingest does not starve it. The child
    gets SIGTERM if this process dies without cleaning up; the analysis lease keeps it the only
    analyser, whatever else runs on the database.
    """
    import signal
    import subprocess

    from trainvitals.service.store import db

    db.prepare(settings.db, migrate=settings.migrate_on_start)  # before either process touches the schema

    def die_with_parent() -> None:
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    env = {**os.environ, **settings.model_copy(update={"migrate_on_start": False}).as_env()}
    env[ANALYSE_PARENT_ENV] = str(os.getpid())
    child = subprocess.Popen(
        [sys.executable, "-m", "trainvitals.service.cli", "analyse"], env=env, preexec_fn=die_with_parent
    )
    try:
        yield
    finally:
        child.terminate()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _run_uvicorn(args: argparse.Namespace, settings: Any) -> int:
    import uvicorn

    from trainvitals.service.http_limits import HeaderDeadlineProtocol
    from trainvitals.service.logs import log_config
    from trainvitals.service.main import create_app

    # Uvicorn applies the config itself, in every process of --workers too; log_level=None so that
    # it keeps our levels (it would set uvicorn.access to the same level as everything else).
    # What a connection may hold (service/http_limits.py): its headers and body are read against
    # deadlines, idle keep-alive connections close, and past max_connections new requests get 503.
    uvicorn_kwargs: dict[str, Any] = {
        "log_config": log_config(settings.log_level),
        "log_level": None,
        "http": HeaderDeadlineProtocol,
        # asyncio's own event loop, not uvloop: its socket reads and writes release the GIL, which
        # the batch writer's thread waits for; uvloop's hold it through the system call. SQLite
        # ingest faster in 8 of 8 alternating rounds (1-29%), PostgreSQL unchanged (docs/performance.md).
        "loop": "asyncio",
        "timeout_keep_alive": settings.keep_alive_seconds,
        "limit_concurrency": settings.max_connections,
    }

    if args.workers > 1:
        # Several processes accept on the one port, each with its own app built from the same
        # settings (handed over as TRAINVITALS_* variables): ingest scales with them, the counters
        # live in the database, and one process at a time holds the analysis lease.
        from trainvitals.service.store import db

        # Once, here, or the check without migrating: each worker would otherwise fail on its own.
        db.prepare(settings.db, migrate=settings.migrate_on_start)
        os.environ.update(settings.model_copy(update={"migrate_on_start": False}).as_env())
        uvicorn.run(
            "trainvitals.service.main:create_app",
            factory=True,
            workers=args.workers,
            host=settings.host,
            port=settings.port,
            **uvicorn_kwargs,
        )
        return 0
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, **uvicorn_kwargs)
    return 0


def _analyse(args: argparse.Namespace) -> int:
    """The analysis worker alone, until SIGTERM or SIGINT (settings from TRAINVITALS_* / --db)."""
    import logging
    import signal
    import time

    from trainvitals.service import logs
    from trainvitals.service.analysis.memory_pages import small_pages_for_numpy
    from trainvitals.service.analysis.worker import AnalysisWorker
    from trainvitals.service.gc_policy import serving_gc
    from trainvitals.service.settings import load
    from trainvitals.service.store import db
    from trainvitals.service.store.lease import AnalysisLease

    settings = load(db=args.db)  # the rest from TRAINVITALS_* (serve hands its settings over so)
    logs.configure(settings.log_level)
    huge_pages = small_pages_for_numpy()
    log = logging.getLogger("trainvitals.analyse")
    logs.log_event(
        log, "analyse", db=db_url.describe(settings.db),
        interval_s=settings.analysis_interval_seconds, numpy_huge_pages=huge_pages,
    )  # fmt: skip
    if ANALYSE_PARENT_ENV not in os.environ:  # serve's child: serve has said it
        _warn_misspelt(log)
    db.prepare(settings.db, migrate=settings.migrate_on_start)
    engine = db.make_engine(settings.db, application_name=db.ANALYSE_APPLICATION_NAME)
    worker = AnalysisWorker(db.make_sessionmaker(engine), settings, lease=AnalysisLease(engine))
    # The main thread polls rather than blocking in Event.wait(): a signal the kernel delivers to
    # the worker's thread does not wake a lock wait in this one, so the Python handler never ran
    # and the child outlived serve (seen in CI, and as an orphaned `trainvitals analyse`).
    signalled: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: signalled.append(signum))
    parent = os.environ.get(ANALYSE_PARENT_ENV)
    # The reduction reads hundreds of thousands of rows a cycle: at CPython's default GC thresholds,
    # collecting took 12% of this process's profile under ingest load (service/gc_policy.py).
    with serving_gc():
        worker.start()
        # serve's child also stops once serve is gone, should the death signal not come (it is sent
        # when the thread that started the child ends): it is then someone else's child.
        while not signalled and (parent is None or str(os.getppid()) == parent):
            time.sleep(0.5)
        worker.stop()
    engine.dispose()
    return 0


def _db(args: argparse.Namespace) -> int:
    from trainvitals.service.store import db

    if args.db_command == "upgrade":
        db.upgrade(args.db, args.revision)
    elif args.db_command == "downgrade":
        db.downgrade(args.db, args.revision)
    print(f"{db_url.describe(args.db)}: at revision {db.current_revision(args.db)}")
    return 0


def _token(args: argparse.Namespace) -> int:
    from trainvitals.service import auth

    if args.token_command == "list":
        from datetime import UTC, datetime

        from trainvitals.service.store import tokens

        with _session(args.db) as session:
            rows = tokens.list_tokens(session, project=args.project)
        # Only the digest of a token is stored; it is not shown either (it identifies the token).
        data = [
            {"id": t.id, "project": t.project, "scope": t.scope, "name": t.name,
             "created": datetime.fromtimestamp(t.created_at, UTC).isoformat(timespec="seconds"),
             "revoked": t.revoked}
            for t in rows
        ]  # fmt: skip
        _emit(data, args.format, columns=("id", "project", "scope", "name", "created", "revoked"))
        return 0
    # Creating the first token may create the database (before the first `serve`); revoking may not.
    # Which one it wrote to is said: run in another directory, it made a new ./trainvitals.db that
    # no collector reads, and the agents' batches were then refused as an unknown token (401).
    created = False
    if args.token_command == "create":
        from trainvitals.service.store import db

        sqlite = db_url.sqlite_path(args.db)  # no file yet, or no trainvitals tables in it: a new database
        created = (sqlite is not None and not sqlite.is_file()) or db.current_revision(args.db) is None
    with _session(args.db, migrate=args.token_command == "create") as session:
        if args.token_command == "create":
            token = auth.create_token(session, project=args.project, scope=args.scope, name=args.name)
            print(token)
            where = db_url.describe(args.db)  # the password hidden
            if created:
                where += ", a new database created just now: the collector must serve this one (--db / TRAINVITALS_DB)"
            print(
                f"(project {args.project!r}, scope {args.scope!r}: shown once, stored hashed in {where})",
                file=sys.stderr,
            )
            return 0
        if not auth.revoke_token(session, token=args.token):
            print(f"trainvitals: no such token in {db_url.describe(args.db)}: pass it as `token create` printed it",
                  file=sys.stderr)  # fmt: skip
            return 1
    print("revoked")
    return 0


def _emit(data: Any, fmt: str, columns: Sequence[str] = ()) -> None:
    """data as strict JSON (non-finite numbers null) or CSV (`columns` head it even without rows)."""
    from trainvitals.service.csv_output import to_csv
    from trainvitals.service.json_output import to_json

    if fmt == "csv":
        sys.stdout.write(to_csv(data, columns=columns))
    else:
        print(to_json(data))


def _columns(query: str) -> list[str]:
    """A query's columns, in the HTTP answer's order (service/api/schemas.py, which the tests keep
    in step with the queries); [] for the queries that answer one object."""
    from trainvitals.service.api import schemas
    from trainvitals.service.store import queries

    if query == "runs":
        return [f.name for f in dataclasses.fields(queries.RunOverview)]
    if query == "steps":
        return list(queries.STEP_HISTORY_COLUMNS)
    models: dict[str, Any] = {
        "timeline": schemas.TensorStepPublic,
        "worst-tensors": schemas.WorstTensorPublic,
        "findings": schemas.FindingPublic,
        "analysis": schemas.AnalysisFindingPublic,
        "checkpoints": schemas.CheckpointGenerationPublic,
    }
    return list(models[query].model_fields) if query in models else []


def _query(args: argparse.Namespace) -> int:
    from trainvitals.service.store import queries

    if getattr(args, "start", None) is not None and getattr(args, "end", None) is not None and args.end < args.start:
        print(f"trainvitals: --start {args.start} is after --end {args.end}: need start <= end", file=sys.stderr)
        return 2
    try:
        return _answer_query(args)
    except queries.TooManyRowsError as exc:
        print(f"trainvitals: {exc} (--start/--end)", file=sys.stderr)
        return 1


def _answer_query(args: argparse.Namespace) -> int:
    from trainvitals.service import settings
    from trainvitals.service.store import queries

    with _session(args.db) as session:
        if args.query_command == "runs":
            # The warm-up the collector's analysis applies; that setting alone: a query must not fail
            # on serve's (Kubernetes sets TRAINVITALS_PORT=tcp://... for a Service named trainvitals).
            warmup = settings.load_one("detector_warmup_steps")
            data: Any = [
                dataclasses.asdict(o)
                for r in queries.list_runs(session)
                if (o := queries.run_overview(session, run_id=r.run_id, warmup_steps=warmup)) is not None
            ]
        elif isinstance(run := _run_of(session, args), str):
            print(f"trainvitals: {run}", file=sys.stderr)
            return 1
        elif args.query_command == "analysis":
            from trainvitals.service.analysis.on_request import UnknownBaselineError, analyse_run

            try:
                found = analyse_run(session, run, baseline=args.baseline)
            except UnknownBaselineError as exc:
                print(f"trainvitals: {exc}", file=sys.stderr)
                return 1
            # The HTTP route's columns: the finding without its run.
            data = [{k: v for k, v in dataclasses.asdict(f).items() if k != "run"} for f in found]
        elif args.query_command == "timeline":
            data = queries.tensor_timeline(
                session, run_id=run.run_id, tensor=args.tensor, role=args.role, start=args.start, end=args.end
            )
            if not data and (missing := _missing_tensor(session, args, run.run_id)) is not None:
                print(f"trainvitals: {missing}", file=sys.stderr)
                return 1
        elif args.query_command == "worst-tensors":
            data = queries.worst_tensors(session, run_id=run.run_id, start=args.start, end=args.end, k=args.k)
        elif args.query_command == "step-times":
            data = queries.step_time_matrix(session, run_id=run.run_id, start=args.start, end=args.end)
        elif args.query_command == "steps":
            data = queries.step_history(session, run_id=run.run_id, start=args.start, end=args.end)
        elif args.query_command == "findings":
            data = queries.findings(session, run_id=run.run_id, active_only=args.active)
        elif args.query_command == "checkpoints":
            data = queries.checkpoint_generations(session, run_id=run.run_id)
        else:
            data = queries.rollback_target(session, run_id=run.run_id, before_step=args.before_step)
        if hasattr(args, "start") and not (data["steps"] if isinstance(data, dict) else data):
            # An empty step range is an answer, not an error: the empty result on stdout, why on stderr.
            print(f"trainvitals: {_empty_range(session, args, run.run_id)}", file=sys.stderr)
    _emit(data, args.format, columns=_columns(args.query_command))
    return 0


def _run_of(session: Any, args: argparse.Namespace) -> Any:
    """The run `--run` names in `--project` (default: the `default` project's run of that id, else the
    one run with that id in any project), or why there is none (store/run_keys.py)."""
    from trainvitals.service.store import queries, run_keys

    # A scrape of every project (auth off) labels another project's run by its key, `team-a/x`:
    # what on-call copies from an alert. From here on --run is the id, --project its project.
    project, run_id = run_keys.project_and_id(args.run)
    if project is not None:
        if args.project is not None and args.project != project:
            return f"--run {args.run!r} names project {project!r} and --project names {args.project!r}: drop one"
        args.run, args.project = run_id, project
    try:
        key = run_keys.resolve(session, args.run, args.project)
    except run_keys.AmbiguousRunError as exc:
        return f"{exc}: name one with --project"
    run = None if key is None else queries.get_run(session, run_id=key)
    if run is None:
        where = "" if args.project is None else f" of project {args.project!r}"
        return f"no run {args.run!r}{where} in {db_url.describe(args.db)}"
    return run


def _missing_tensor(session: Any, args: argparse.Namespace, key: str) -> str | None:
    """Why the run has no timeline for `--tensor` (and `--role`) at all, or None: it has one."""
    from trainvitals.service.store import queries

    roles = queries.tensor_roles(session, run_id=key, tensor=args.tensor)
    if not roles:
        return (
            f"run {args.run!r} has no tensor {args.tensor!r} (names are module names, e.g. layers.3.fc; "
            f"`trainvitals query worst-tensors --run {args.run}` lists some)"
        )
    if args.role is not None and args.role not in roles:
        return (
            f"run {args.run!r}: tensor {args.tensor!r} has roles {', '.join(roles)}, not {args.role}: "
            "pass one of them to --role, or leave --role out"
        )
    return None


def _empty_range(session: Any, args: argparse.Namespace, key: str) -> str:
    """The line for a query that found nothing: what it asked for, and what the run has of the data
    that query reads (reduced steps, rank step times or FP8 statistics)."""
    from trainvitals.service.store import queries

    bounds = ("" if b is None else str(b) for b in (args.start, args.end))
    asked = "any step" if args.start is None and args.end is None else "steps " + "..".join(bounds)
    where = f"run {args.run!r}"
    if args.query_command == "steps":
        have = queries.reduced_step_range(session, run_id=key)
        what, none = "the run has reduced steps", "no step of the run is reduced yet"
    elif args.query_command == "step-times":
        have = queries.stored_step_range(session, run_id=key)
        what, none = "the run has step times for steps", "the run has no step times yet"
    elif args.query_command == "timeline":
        where += f", tensor {args.tensor!r}" + ("" if args.role is None else f" ({args.role})")
        have = queries.tensor_step_range(session, run_id=key, tensor=args.tensor, role=args.role)
        what, none = "the tensor has FP8 statistics for steps", "the tensor has no FP8 statistics"
    else:  # worst-tensors
        have = queries.tensor_step_range(session, run_id=key)
        what = "the run has FP8 statistics for steps"
        none = "the run has no FP8 tensor statistics (none sent, or none reduced yet)"
    if have is None:
        return f"nothing for {where} in {asked}: {none}"
    return f"nothing for {where} in {asked}; {what} {have[0]}..{have[1]}"


def _replay(args: argparse.Namespace) -> int:
    from trainvitals.service.ingest.replay import replay_files

    config = None
    if args.catch_up_steps is not None:
        from trainvitals.service.analysis.pipeline import PipelineConfig

        config = PipelineConfig(catch_up_steps=args.catch_up_steps)
    if missing := [f for f in args.files if not os.path.isfile(f)]:
        # A shell pattern that matched nothing reaches here as itself: say so, and where spools are.
        pattern = " (a pattern that matched no file)" if any(c in missing[0] for c in "*?[") else ""
        print(f"trainvitals: no file {missing[0]!r}{pattern}: replay takes the agent's spool or record files "
              "(.jsonl); a job's spools are <run>.rank<r>.jsonl on the node that ran it, in "
              "${TMPDIR:-/tmp}/trainvitals-spool-$USER/ unless the job set TRAINVITALS_SPILL_DIR",
              file=sys.stderr)  # fmt: skip
        return 2
    with _session(args.db, migrate=True) as session:
        report = replay_files(
            session, args.files, analyse=not args.no_analysis, config=config, project=args.project
        )
    print(json.dumps(dataclasses.asdict(report), indent=2))
    return 0 if report.rejected_lines == 0 else 1


def _demo(args: argparse.Namespace) -> int:
    from trainvitals.examples.demo import run_demo

    return run_demo(
        ranks=args.ranks,
        seconds=args.seconds,
        port=args.port,
        workdir=args.workdir,
        keep_serving=args.keep_serving,
    )


def _dashboards(args: argparse.Namespace) -> int:
    # The SDK is the optional `dashboards` extra: imported here, not at the top of the CLI.
    try:
        from trainvitals.dashboards.alert_rules import Config
        from trainvitals.dashboards.generate import write
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("grafana_foundation_sdk"):
            raise
        print("trainvitals: dashboards need the grafana-foundation-sdk: pip install 'trainvitals[dashboards]'",
              file=sys.stderr)  # fmt: skip
        return 2

    urls = {"grafana_url": args.grafana_url, "runbook_base_url": args.runbook_base_url}
    try:
        config = Config(**{k: v for k, v in urls.items() if v is not None})
    except ValueError as e:
        print(f"trainvitals: {e}", file=sys.stderr)
        return 2
    for path in write(args.directory, config=config):
        print(path)
    return 0


class _HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default: the value, "off" for a switch, or "required"
    (flags whose default is worked out elsewhere name it in their own help)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default is argparse.SUPPRESS:
            return text
        if action.required:
            return f"{text} (required)".strip()
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)".strip()
        default = "not set" if action.default is None else "%(default)s"
        return f"{text} (default: {default})".strip()


class _Parser(argparse.ArgumentParser):
    """Subparsers are made with the parent's class, so this carries the formatter to all of them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number of 1 or more, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def _add_db(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--db",
        help=f"SQLAlchemy URL: sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DATABASE "
        f"(default: ${db_url.ENV}, else {DEFAULT_SQLITE_URL} in the working directory)",
    )


def _add_format(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=("json", "csv"), default="json", help="output format")


def _add_query(
    sub: Any,
    name: str,
    help_: str,
    *,
    run: bool = True,
    extra: Callable[[argparse.ArgumentParser], object] | None = None,
) -> None:
    p = sub.add_parser(name, help=help_, description=help_)
    _add_db(p)
    if run:
        p.add_argument("--run", required=True, help="run id, or project/run as /metrics labels another project's run")
        p.add_argument(
            "--project",
            help="the run's project (default: the `default` project's run of that id, else the one run with that "
            "id in any project)",
        )
    _add_format(p)
    if extra is not None:
        extra(p)
    p.set_defaults(func=_query)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="trainvitals", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the collector (127.0.0.1:8000, SQLite in the working directory)")
    _add_db(serve)
    serve.add_argument("--host", help="bind address (default: $TRAINVITALS_HOST, else 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: $TRAINVITALS_PORT, else 8000)")
    serve.add_argument(
        "--insecure-no-auth", action="store_true", help="accept requests without tokens (local demos only)"
    )
    serve.add_argument(
        "--api-docs",
        action="store_true",
        help="serve /docs and /openapi.json (default: $TRAINVITALS_API_DOCS, else off)",
    )
    serve.add_argument(
        "--log-level",
        choices=_LOG_LEVELS,
        help="trainvitals and Uvicorn log level; debug logs every request (default: $TRAINVITALS_LOG_LEVEL, else info)",
    )
    serve.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="collector processes sharing the port (ingest throughput scales with them on PostgreSQL)",
    )
    serve.add_argument(
        "--ingest-journal",
        metavar="DIR",
        help="acknowledge batches once appended to a journal in DIR, before their commit (faster senders; a host "
        "crash loses the uncommitted tail, docs/deployment.md) (default: $TRAINVITALS_INGEST_JOURNAL_DIR, else off)",
    )
    serve.add_argument(
        "--analysis-thread",
        action="store_true",
        help="run the analysis worker as a thread of the collector process (default: off, a child process, "
        "`trainvitals analyse`, so that analysis does not take ingest's CPU and GIL)",
    )
    serve.set_defaults(func=_serve)

    analyse = sub.add_parser(
        "analyse", help="the analysis worker alone (reduce + detect), for a collector started without it"
    )
    _add_db(analyse)
    analyse.set_defaults(func=_analyse)

    dbp = sub.add_parser("db", help="schema migrations")
    dbsub = dbp.add_subparsers(dest="db_command", required=True)
    up = dbsub.add_parser("upgrade", help="migrate the schema up to a revision (creates the database)")
    _add_db(up)
    up.add_argument("--revision", default="head", help="a revision (0005), +N, or head (the default)")
    down = dbsub.add_parser("downgrade", help="migrate the schema down to a revision (drops what later ones added)")
    _add_db(down)
    # Required: `base` drops every table and its rows, so it is never a default.
    down.add_argument(
        "--revision", required=True, help="(required) a revision (0015), -N, or base, which drops every table"
    )
    dbp.set_defaults(func=_db)

    token = sub.add_parser("token", help="bearer tokens scoped to a project")
    tsub = token.add_subparsers(dest="token_command", required=True)
    create = tsub.add_parser("create", help="print a new token (stored hashed; creates the database if missing)")
    _add_db(create)
    create.add_argument("--project", required=True, help="the project the token may write or read")
    create.add_argument(
        "--scope",
        choices=("ingest", "read", "admin"),
        required=True,
        help="ingest (agents), read (dashboards, queries) or admin (read, and delete runs)",
    )
    create.add_argument("--name", help="a label for people (who or what uses it)")
    revoke = tsub.add_parser("revoke", help="revoke a token (effective within the collector's token cache time)")
    _add_db(revoke)
    revoke.add_argument("token", help="the token itself, as `token create` printed it")
    tlist = tsub.add_parser("list", help="every token's project, scope, name, creation time and revocation")
    _add_db(tlist)
    tlist.add_argument("--project", help="only this project's tokens (default: every project)")
    _add_format(tlist)
    token.set_defaults(func=_token)

    query = sub.add_parser(
        "query",
        help="post-mortem queries (JSON or CSV)",
        description="Post-mortem queries. An unknown run or tensor is an error (exit code 1); a step range "
        "without data prints the empty result and says so on stderr (exit code 0).",
    )
    qsub = query.add_subparsers(dest="query_command", required=True)

    def step_range(p: argparse.ArgumentParser) -> None:
        p.add_argument("--start", type=int, help="first step (default: the first)")
        p.add_argument("--end", type=int, help="last step, inclusive (default: the last)")

    def timeline(p: argparse.ArgumentParser) -> None:
        p.add_argument("--tensor", required=True, help="module name, e.g. layers.3.fc")
        p.add_argument("--role", choices=("input", "weight", "grad_output"), help="default: every role")
        step_range(p)

    def worst(p: argparse.ArgumentParser) -> None:
        step_range(p)
        p.add_argument("-k", type=_positive_int, default=10, help="how many tensors")

    def matrix(p: argparse.ArgumentParser) -> None:
        p.add_argument("--start", type=int, required=True, help="first step")
        p.add_argument("--end", type=int, required=True, help="last step, inclusive")

    _add_query(qsub, "runs", "every run with an overview", run=False)
    _add_query(
        qsub,
        "steps",
        "per-step loss, gradient norm, tokens, step time (median and slowest rank) and MFU, reduced over ranks",
        extra=step_range,
    )
    _add_query(qsub, "timeline", "a tensor's headroom and amax per step", extra=timeline)
    _add_query(qsub, "worst-tensors", "tensors with the least headroom in a step range", extra=worst)
    _add_query(qsub, "step-times", "per-rank step seconds for a step range", extra=matrix)
    _add_query(
        qsub,
        "findings",
        "detector findings with onset and detection steps",
        extra=lambda p: p.add_argument("--active", action="store_true", help="only findings still open"),
    )
    _add_query(
        qsub,
        "analysis",
        "run the detectors now over the stored run (not stored), against a baseline run if named",
        extra=lambda p: p.add_argument(
            "--baseline", help="run of the same project to compare with (default: the registered baseline_run)"
        ),
    )
    _add_query(qsub, "checkpoints", "checkpoint generations and their status")
    _add_query(
        qsub,
        "rollback",
        "the generation to roll back to",
        extra=lambda p: p.add_argument(
            "--before-step",
            type=int,
            help="newest usable generation before this step "
            "(default: before the onset of the first open page or ticket finding on the loss, gradients or FP8)",
        ),  # fmt: skip
    )

    replay = sub.add_parser("replay", help="ingest recorded wire-format JSONL (agent spool/record files)")
    replay.add_argument("files", nargs="+", help="JSONL files")
    _add_db(replay)
    replay.add_argument("--no-analysis", action="store_true", help="store only; skip reduction and detectors")
    replay.add_argument(
        "--project",
        help="store the runs in this project, whatever their registrations name (a job that named the wrong one); "
        "default: the registrations' own, or for a file without one the run with that id",
    )
    replay.add_argument(
        "--catch-up-steps",
        type=_positive_int,
        metavar="N",
        help="steps per analysis cycle as the recording's history is walked (default: 50, the straggler "
        "detectors' window: what a collector cycling every 50 steps stores). Larger is faster but coarser: 300 "
        "takes about 2.5x less time on a 100,000-step recording (docs/performance.md) and still finds every "
        "episode shorter than about half the lookback, but can miss a finding that exists for less than a "
        "cycle (an intermittent-straggler ticket that becomes a page within 50 steps)",
    )
    replay.set_defaults(func=_replay)

    demo = sub.add_parser("demo", help="collector + a multi-rank training job with the agent attached")
    demo.add_argument("--ranks", type=int, default=4, help="training processes")
    demo.add_argument("--seconds", type=float, default=None, help="cap on the training time (default: none; 250 steps)")
    demo.add_argument("--port", type=int, default=0, help="the collector's port (0: a free one)")
    demo.add_argument("--workdir", default="demo-out", help="database, logs and spool files")
    demo.add_argument("--keep-serving", action="store_true", help="leave the collector running afterwards")
    demo.set_defaults(func=_demo)

    dash = sub.add_parser("dashboards", help="Grafana dashboards as code (needs the `dashboards` extra)")
    dsub = dash.add_subparsers(dest="dashboards_command", required=True)
    dwrite = dsub.add_parser(
        "write",
        help="write each dashboard's JSON as DIR/<uid>.json and the alert rules as DIR/trainvitals-alerts.yml "
        "(without DIR: the repository's dashboards/generated/ and dashboards/alerts/)",
    )
    dwrite.add_argument("directory", nargs="?", default=None, metavar="DIR")
    dwrite.add_argument(
        "--grafana-url", help="Grafana root URL for the alerts' dashboard_url (default: a placeholder to replace)"
    )
    dwrite.add_argument(
        "--runbook-base-url",
        help="URL of the rendered docs/runbooks.md for the alerts' runbook_url (default: a placeholder to replace)",
    )
    dash.set_defaults(func=_dashboards)

    from trainvitals.service.advisors.cli import add_advise_parser, add_plan_parser

    add_plan_parser(sub)
    add_advise_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "db"):  # every command that touches the database: one resolution, one check
            args.db = db_url.resolve(args.db)
            db_url.check(args.db)
        return int(args.func(args))
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly. stdout is pointed at /dev/null so that
        # the interpreter's final flush does not print the same error again; 141 is what a
        # process killed by SIGPIPE reports, as coreutils do in the same pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:
        from trainvitals.service.settings import ConfigError

        if isinstance(exc, ConfigError):  # a bad flag or TRAINVITALS_* value: which, and what it must be
            print(f"trainvitals: {exc}", file=sys.stderr)
            return 2
        # A database mistake (URL, missing database or file, unreachable server) is one line naming
        # the problem and the fix, exit code 2, as argparse does for a usage error; anything else
        # is a bug and keeps its traceback.
        if (line := db_url.explain(exc, getattr(args, "db", ""))) is None:
            raise
        print(f"trainvitals: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
