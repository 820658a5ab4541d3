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

from trainvitals.service.store.db import DEFAULT_SQLITE_URL

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@contextmanager
def _session(url: str, *, migrate: bool = False) -> Iterator[Any]:
    from trainvitals.service.store import db

    if migrate:
        db.upgrade(url)
    engine = db.make_engine(url)
    try:
        with db.make_sessionmaker(engine)() as session:
            yield session
    finally:
        engine.dispose()


def _serve(args: argparse.Namespace) -> int:
    from trainvitals.service.settings import Settings

    overrides = {
        k: v for k, v in {"db": args.db, "host": args.host, "port": args.port}.items() if v is not None
    }
    if args.insecure_no_auth:
        overrides["auth"] = False
    settings = Settings(**overrides)
    if not settings.auth:
        print(
            "trainvitals: WARNING: authentication is OFF (--insecure-no-auth): anyone who can reach "
            f"{settings.host}:{settings.port} can write and read every run. Local demos only.",
            file=sys.stderr,
        )
    if settings.host not in _LOOPBACK:
        print(f"trainvitals: listening on {settings.host}: reachable beyond this machine", file=sys.stderr)
    if args.analysis_thread or not settings.run_analysis:
        return _run_uvicorn(args, settings)
    with _analysis_process(settings):
        return _run_uvicorn(args, settings.model_copy(update={"run_analysis": False}))


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

    if settings.migrate_on_start:
        db.upgrade(settings.db)  # before either process touches the schema

    def die_with_parent() -> None:
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    env = {**os.environ, **settings.model_copy(update={"migrate_on_start": False}).as_env()}
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

    from trainvitals.service.main import create_app

    if args.workers > 1:
        # Several processes accept on the one port, each with its own app built from the same
        # settings (handed over as TRAINVITALS_* variables): ingest scales with them, the counters
        # live in the database, and one process at a time holds the analysis lease.
        if settings.migrate_on_start:
            from trainvitals.service.store import db

            db.upgrade(settings.db)  # once, here: N processes migrating at the same time would race
        os.environ.update(settings.model_copy(update={"migrate_on_start": False}).as_env())
        uvicorn.run(
            "trainvitals.service.main:create_app",
            factory=True,
            workers=args.workers,
            host=settings.host,
            port=settings.port,
            log_level=args.log_level,
        )
        return 0
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=args.log_level)
    return 0


def _analyse(args: argparse.Namespace) -> int:
    """The analysis worker alone, until SIGTERM or SIGINT (settings from TRAINVITALS_* / --db)."""
    import signal
    import threading

    from trainvitals.service.analysis.worker import AnalysisWorker
    from trainvitals.service.settings import Settings
    from trainvitals.service.store import db
    from trainvitals.service.store.lease import AnalysisLease

    settings = Settings(**({"db": args.db} if args.db else {}))
    if settings.migrate_on_start:
        db.upgrade(settings.db)
    engine = db.make_engine(settings.db)
    worker = AnalysisWorker(db.make_sessionmaker(engine), settings, lease=AnalysisLease(engine))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    worker.start()
    stop.wait()
    worker.stop()
    engine.dispose()
    return 0


def _db(args: argparse.Namespace) -> int:
    from trainvitals.service.store import db

    if args.db_command == "upgrade":
        db.upgrade(args.db, args.revision)
    elif args.db_command == "downgrade":
        db.downgrade(args.db, args.revision)
    print(f"{args.db}: at revision {db.current_revision(args.db)}")
    return 0


def _token(args: argparse.Namespace) -> int:
    from trainvitals.service import auth

    with _session(args.db, migrate=True) as session:
        if args.token_command == "create":
            token = auth.create_token(session, project=args.project, scope=args.scope, name=args.name)
            print(token)
            print(
                f"(project {args.project!r}, scope {args.scope!r}: shown once, stored hashed)",
                file=sys.stderr,
            )
            return 0
        if not auth.revoke_token(session, token=args.token):
            print("no such token", file=sys.stderr)
            return 1
    print("revoked")
    return 0


def _emit(data: Any, fmt: str) -> None:
    from trainvitals.service.csv_output import to_csv

    if fmt == "csv":
        sys.stdout.write(to_csv(data))
    else:
        print(json.dumps(data, indent=2, default=str))


def _query(args: argparse.Namespace) -> int:
    from trainvitals.service.store import queries

    with _session(args.db) as session:
        if args.query_command == "runs":
            data: Any = [
                dataclasses.asdict(o)
                for r in queries.list_runs(session)
                if (o := queries.run_overview(session, run_id=r.run_id)) is not None
            ]
        elif (run := queries.get_run(session, run_id=args.run)) is None:
            print(f"no run {args.run!r} in {args.db}", file=sys.stderr)
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
                session, run_id=args.run, tensor=args.tensor, role=args.role, start=args.start, end=args.end
            )
        elif args.query_command == "worst-tensors":
            data = queries.worst_tensors(session, run_id=args.run, start=args.start, end=args.end, k=args.k)
        elif args.query_command == "step-times":
            data = queries.step_time_matrix(session, run_id=args.run, start=args.start, end=args.end)
        elif args.query_command == "findings":
            data = queries.findings(session, run_id=args.run, active_only=args.active)
        elif args.query_command == "checkpoints":
            data = queries.checkpoint_generations(session, run_id=args.run)
        else:
            data = queries.rollback_target(session, run_id=args.run, before_step=args.before_step)
    _emit(data, args.format)
    return 0


def _replay(args: argparse.Namespace) -> int:
    from trainvitals.service.ingest.replay import replay_files

    with _session(args.db, migrate=True) as session:
        report = replay_files(session, args.files, analyse=not args.no_analysis)
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
    from trainvitals.dashboards.alert_rules import Config
    from trainvitals.dashboards.generate import write

    urls = {"grafana_url": args.grafana_url, "runbook_base_url": args.runbook_base_url}
    try:
        config = Config(**{k: v for k, v in urls.items() if v is not None})
    except ValueError as e:
        print(f"trainvitals: {e}", file=sys.stderr)
        return 2
    for path in write(args.directory, config=config):
        print(path)
    return 0


def _add_db(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=DEFAULT_SQLITE_URL, help=f"SQLAlchemy URL (default {DEFAULT_SQLITE_URL})")


def _add_query(
    sub: Any,
    name: str,
    help_: str,
    *,
    run: bool = True,
    extra: Callable[[argparse.ArgumentParser], object] | None = None,
) -> None:
    p = sub.add_parser(name, help=help_)
    _add_db(p)
    if run:
        p.add_argument("--run", required=True)
    p.add_argument("--format", choices=("json", "csv"), default="json")
    if extra is not None:
        extra(p)
    p.set_defaults(func=_query)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainvitals", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve", help="run the collector (127.0.0.1:8000, SQLite in the working directory)"
    )
    serve.add_argument("--db", help=f"SQLAlchemy URL (default {DEFAULT_SQLITE_URL}; env TRAINVITALS_DB)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument(
        "--insecure-no-auth", action="store_true", help="accept requests without tokens (demos)"
    )
    serve.add_argument("--log-level", default="warning")
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help="collector processes sharing the port (ingest throughput scales with them on PostgreSQL)",
    )
    serve.add_argument(
        "--analysis-thread",
        action="store_true",
        help="run the analysis worker as a thread of the collector process, not as its own child process "
        "(`trainvitals analyse`, the default: analysis then does not take ingest's CPU and GIL)",
    )
    serve.set_defaults(func=_serve)

    analyse = sub.add_parser(
        "analyse", help="the analysis worker alone (reduce + detect), for a collector started without it"
    )
    analyse.add_argument("--db", help=f"SQLAlchemy URL (default {DEFAULT_SQLITE_URL}; env TRAINVITALS_DB)")
    analyse.set_defaults(func=_analyse)

    dbp = sub.add_parser("db", help="schema migrations")
    dbsub = dbp.add_subparsers(dest="db_command", required=True)
    for name, default in (("upgrade", "head"), ("downgrade", "base")):
        p = dbsub.add_parser(name)
        _add_db(p)
        p.add_argument("--revision", default=default)
    dbp.set_defaults(func=_db)

    token = sub.add_parser("token", help="bearer tokens scoped to a project")
    tsub = token.add_subparsers(dest="token_command", required=True)
    create = tsub.add_parser("create", help="print a new token (stored hashed)")
    _add_db(create)
    create.add_argument("--project", required=True)
    create.add_argument("--scope", choices=("ingest", "read"), required=True)
    create.add_argument("--name")
    revoke = tsub.add_parser("revoke")
    _add_db(revoke)
    revoke.add_argument("token")
    token.set_defaults(func=_token)

    query = sub.add_parser("query", help="post-mortem queries (JSON or CSV)")
    qsub = query.add_subparsers(dest="query_command", required=True)

    def step_range(p: argparse.ArgumentParser) -> None:
        p.add_argument("--start", type=int)
        p.add_argument("--end", type=int)

    def timeline(p: argparse.ArgumentParser) -> None:
        p.add_argument("--tensor", required=True, help="module name, e.g. layers.3.fc")
        p.add_argument("--role", choices=("input", "weight", "grad_output"))
        step_range(p)

    def worst(p: argparse.ArgumentParser) -> None:
        step_range(p)
        p.add_argument("-k", type=int, default=10)

    def matrix(p: argparse.ArgumentParser) -> None:
        p.add_argument("--start", type=int, required=True)
        p.add_argument("--end", type=int, required=True)

    _add_query(qsub, "runs", "every run with an overview", run=False)
    _add_query(qsub, "timeline", "a tensor's headroom and amax per step", extra=timeline)
    _add_query(qsub, "worst-tensors", "tensors with the least headroom in a step range", extra=worst)
    _add_query(qsub, "step-times", "per-rank step seconds for a step range", extra=matrix)
    _add_query(
        qsub,
        "findings",
        "detector findings with onset and detection steps",
        extra=lambda p: p.add_argument("--active", action="store_true"),
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
        extra=lambda p: p.add_argument("--before-step", type=int),
    )

    replay = sub.add_parser("replay", help="ingest recorded wire-format JSONL (agent spool/record files)")
    replay.add_argument("files", nargs="+")
    _add_db(replay)
    replay.add_argument("--no-analysis", action="store_true", help="store only; skip reduction and detectors")
    replay.set_defaults(func=_replay)

    demo = sub.add_parser("demo", help="collector + a multi-rank training job with the agent attached")
    demo.add_argument("--ranks", type=int, default=4)
    demo.add_argument("--seconds", type=float, default=60.0)
    demo.add_argument("--port", type=int, default=8000)
    demo.add_argument("--workdir", default="demo-out")
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
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
