"""Bearer tokens scoped to one project and one scope (ingest | read | admin), stored as SHA-256 digests.

A token for project A can neither write nor read project B. Within its project an ingest token
writes (agents), a read token reads, and an admin token reads and deletes runs: neither of the
tokens handed to jobs or dashboards can destroy data. Lookups are cached in-process for
`cache_seconds` so ingest does not pay a query per batch; revocation takes effect within that time.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from trainvitals.service.store import tokens

SCOPES = ("ingest", "read", "admin")
# What each scope may do. admin reads too (an operator finds the run before deleting it), but does
# not ingest: agents hold ingest tokens, so an admin token never has to leave the operators.
_GRANTS = {"ingest": frozenset({"ingest"}), "read": frozenset({"read"}), "admin": frozenset({"admin", "read"})}
_PREFIX = "tv_"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts as; project None means auth is off (every project, every scope)."""

    project: str | None
    scope: str | None

    def may(self, scope: str, project: str) -> bool:
        if self.project is None:
            return True
        return self.project == project and scope in _GRANTS.get(self.scope or "", ())


ANONYMOUS = Principal(project=None, scope=None)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(session: Session, *, project: str, scope: str, name: str | None = None) -> str:
    """Store a new token's digest and return the token itself (shown once, never stored)."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    token = _PREFIX + secrets.token_urlsafe(32)
    tokens.add_token(session, digest=digest(token), project=project, scope=scope, name=name, now=time.time())
    return token


def revoke_token(session: Session, *, token: str) -> bool:
    """Revoke a token (effective within a verifier's cache_seconds); False when it is unknown."""
    return tokens.revoke_token(session, digest=digest(token))


class TokenVerifier:
    """Thread-safe, cached digest -> Principal lookups.

    Known and unknown tokens are cached apart, each bounded (least recently used out first): a
    stream of made-up tokens costs a query each, but cannot push the real ones out of the cache
    and make every agent's batch pay a query again."""

    MAX_ENTRIES = 10_000
    """Per cache: far more tokens than a collector's projects hand out."""

    def __init__(self, cache_seconds: float = 30.0) -> None:
        self._known: OrderedDict[str, tuple[float, Principal]] = OrderedDict()
        self._unknown: OrderedDict[str, tuple[float, None]] = OrderedDict()
        self._lock = threading.Lock()
        self._ttl = cache_seconds

    def cached(self, token: str, *, now: float | None = None) -> tuple[bool, Principal | None]:
        """(True, principal or None) when a fresh answer is cached; (False, None) otherwise.

        Lets an async route authenticate without a database round trip (or a thread hop) on
        every request; a miss goes through `verify` in a worker thread."""
        now = time.monotonic() if now is None else now
        key = digest(token)
        with self._lock:
            for cache in (self._known, self._unknown):
                hit = cache.get(key)
                if hit is not None and now - hit[0] < self._ttl:
                    cache.move_to_end(key)
                    return True, hit[1]
        return False, None

    def verify(self, session: Session, token: str, *, now: float | None = None) -> Principal | None:
        now = time.monotonic() if now is None else now
        found, principal = self.cached(token, now=now)
        if found:
            return principal
        key = digest(token)
        row = tokens.token_by_digest(session, digest=key)
        principal = None if row is None or row.revoked else Principal(project=row.project, scope=row.scope)
        with self._lock:
            self._known.pop(key, None)  # a revoked token leaves the known ones
            self._unknown.pop(key, None)
            if principal is None:
                _put(self._unknown, key, (now, None), self.MAX_ENTRIES)
            else:
                _put(self._known, key, (now, principal), self.MAX_ENTRIES)
        return principal


def _put(cache: OrderedDict[str, Any], key: str, value: Any, limit: int) -> None:
    cache[key] = value
    if len(cache) > limit:
        cache.popitem(last=False)
