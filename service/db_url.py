"""The database URL a user gives (--db / TRAINVITALS_DB): resolved the same way by every command,
checked before anything connects or creates a file, shown with its password hidden, and, when
the database itself refuses, explained in one line that names the problem and the fix.

Usage::

    url = resolve(args.db)          # --db, else TRAINVITALS_DB, else ./trainvitals.db
    check(url)                      # raises DbUrlError (message: problem and fix)
    try:
        ...
    except Exception as exc:
        if (line := explain(exc, url)) is None:
            raise
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from trainvitals.service.store.db import DEFAULT_SQLITE_URL, SchemaError

ENV = "TRAINVITALS_DB"
_FIX = "use sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DATABASE"


class DbUrlError(ValueError):
    """A database URL that cannot work; the message names the problem and the fix (one line)."""


def resolve(flag: str | None) -> str:
    """--db when given, else TRAINVITALS_DB, else SQLite in the working directory."""
    return flag or os.environ.get(ENV) or DEFAULT_SQLITE_URL


def redact(url: str) -> str:
    """The URL with its password replaced by ***; also for strings SQLAlchemy cannot parse."""
    from sqlalchemy import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - unparsable: hide whatever sits between user: and @
        return re.sub(r"(//[^:/@]*:)[^@]*@", r"\1***@", url)


def describe(url: str) -> str:
    """For logs: redacted, and a relative SQLite path made absolute (which file it really is)."""
    path = sqlite_path(url)
    return f"sqlite:///{path.resolve()}" if path is not None else redact(url)


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL (None: not SQLite, in memory, or a file: URI)."""
    from sqlalchemy import make_url

    parsed = make_url(url)
    name = parsed.database
    if parsed.get_backend_name() != "sqlite" or not name or name == ":memory:" or name.startswith("file:"):
        return None
    return Path(name)


def check(url: str) -> None:
    """Raise DbUrlError for a URL that cannot work, without connecting or creating anything."""
    from sqlalchemy import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        detail = "" if isinstance(exc, ArgumentError) else f" ({exc})"  # ArgumentError says only "could not parse"
        raise DbUrlError(f"cannot parse the database URL {redact(url)!r}{detail}: {_FIX}") from None
    if parsed.drivername in ("postgres", "postgres+psycopg"):  # Heroku / libpq spelling
        fixed = parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=True)
        raise DbUrlError(f"the database URL scheme 'postgres://' is not SQLAlchemy's: use {fixed}")
    try:
        parsed.get_dialect().import_dbapi()  # the driver module, without connecting
    except (NoSuchModuleError, ImportError) as exc:
        raise DbUrlError(f"no database driver for {parsed.drivername!r} ({exc}): {_FIX}") from None
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise DbUrlError(f"trainvitals stores in SQLite or PostgreSQL, not {parsed.get_backend_name()}: {_FIX}")
    path = sqlite_path(url)
    if path is not None and not path.parent.is_dir():
        raise DbUrlError(
            f"no directory {path.parent} for the SQLite file {path.name}: "
            f"create it (mkdir -p {path.parent}) or point --db / {ENV} elsewhere"
        )


def check_exists(url: str) -> None:
    """For commands that only read: a missing SQLite file is an error, not a new empty database."""
    path = sqlite_path(url)
    if path is not None and not path.is_file():
        raise DbUrlError(
            f"no SQLite database at {path.resolve()} (reading does not create one): "
            f"check --db / {ENV}, or create it with `trainvitals serve` or `trainvitals db upgrade`"
        )


def explain(exc: BaseException, url: str) -> str | None:
    """One line for an error the database raised when connecting, or for its schema; None when `exc`
    is not one."""
    from sqlalchemy import make_url
    from sqlalchemy.exc import OperationalError

    if isinstance(exc, DbUrlError | SchemaError):
        return str(exc)
    if not isinstance(exc, OperationalError):
        return None
    reason = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else str(exc)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return f"cannot use the SQLite database {describe(url)}: {reason} (is the file a database, writable?)"
    host, port, user = parsed.host or "localhost", parsed.port or 5432, parsed.username or "postgres"
    short = re.split(r"failed:\s*", reason)[-1].removeprefix("FATAL:").strip()  # without psycopg's preambles
    if (m := re.search(r'database "([^"]+)" does not exist', reason)) is not None:
        return f"database {m[1]!r} does not exist on {host}:{port}: create it (createdb -h {host} -p {port} -U {user} {m[1]}) or fix --db / {ENV}"  # noqa: E501
    if re.search(r"refused|could not connect|timeout|timed out|no route|not known|resolve", reason, re.I):
        return f"cannot reach PostgreSQL at {host}:{port} ({short}): is it running, with that host and port?"
    if re.search(r"password|authentication|role .* does not exist|pg_hba", reason, re.I):
        return f"PostgreSQL at {host}:{port} refused user {user!r} ({short}): fix the user or password in --db / {ENV}"
    return f"cannot use the database {redact(url)}: {reason}"
