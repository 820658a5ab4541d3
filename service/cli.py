"""The `trainvitals` console script: serve, db, query, replay, demo (plan/advise from the advisors)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from trainvitals.service.store.db import DEFAULT_SQLITE_URL


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from trainvitals.service.main import create_app
    from trainvitals.service.settings import Settings

    overrides = {
        k: v for k, v in {"db": args.db, "host": args.host, "port": args.port}.items() if v is not None
    }
    settings = Settings(**overrides)
    if settings.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"trainvitals: listening on {settings.host}: reachable beyond this machine", file=sys.stderr)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=args.log_level)
    return 0


def _db(args: argparse.Namespace) -> int:
    from trainvitals.service.store import db

    if args.db_command == "upgrade":
        db.upgrade(args.db, args.revision)
    elif args.db_command == "downgrade":
        db.downgrade(args.db, args.revision)
    print(f"{args.db}: at revision {db.current_revision(args.db)}")
    return 0


def _query_runs(args: argparse.Namespace) -> int:
    import dataclasses

    from trainvitals.service.store import db, queries

    engine = db.make_engine(args.db)
    with db.make_sessionmaker(engine)() as session:
        out = [
            dataclasses.asdict(o)
            for r in queries.list_runs(session)
            if (o := queries.run_overview(session, run_id=r.run_id)) is not None
        ]
    engine.dispose()
    print(json.dumps(out, indent=2))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from trainvitals.service.demo import run_demo

    return run_demo(
        ranks=args.ranks,
        seconds=args.seconds,
        port=args.port,
        workdir=args.workdir,
        keep_serving=args.keep_serving,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainvitals", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve", help="run the collector (127.0.0.1:8000, SQLite in the working directory)"
    )
    serve.add_argument("--db", help=f"SQLAlchemy URL (default {DEFAULT_SQLITE_URL}; env TRAINVITALS_DB)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument("--log-level", default="warning")
    serve.set_defaults(func=_serve)

    dbp = sub.add_parser("db", help="schema migrations")
    dbsub = dbp.add_subparsers(dest="db_command", required=True)
    for name, default in (("upgrade", "head"), ("downgrade", "base")):
        p = dbsub.add_parser(name)
        p.add_argument("--db", default=DEFAULT_SQLITE_URL)
        p.add_argument("--revision", default=default)
    dbp.set_defaults(func=_db)

    query = sub.add_parser("query", help="post-mortem queries")
    qsub = query.add_subparsers(dest="query_command", required=True)
    q_runs = qsub.add_parser("runs", help="every run with an overview")
    q_runs.add_argument("--db", default=DEFAULT_SQLITE_URL)
    q_runs.set_defaults(func=_query_runs)

    demo = sub.add_parser("demo", help="collector + a multi-rank training job with the agent attached")
    demo.add_argument("--ranks", type=int, default=4)
    demo.add_argument("--seconds", type=float, default=60.0)
    demo.add_argument("--port", type=int, default=8000)
    demo.add_argument("--workdir", default="demo-out")
    demo.add_argument("--keep-serving", action="store_true", help="leave the collector running afterwards")
    demo.set_defaults(func=_demo)

    from trainvitals.service.advisors.cli import add_advise_parser, add_plan_parser

    add_plan_parser(sub)
    add_advise_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
