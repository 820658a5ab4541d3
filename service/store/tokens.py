"""API token rows: SHA-256 digests with a project and a scope (service/auth.py makes the tokens,
hashes them and caches lookups; the token itself is never stored)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from trainvitals.service.store.models import ApiToken


def add_token(session: Session, *, digest: str, project: str, scope: str, name: str | None, now: float) -> None:
    """Store a new token's digest (committed)."""
    session.add(ApiToken(digest=digest, project=project, scope=scope, name=name, created_at=now))
    session.commit()


def token_by_digest(session: Session, *, digest: str) -> ApiToken | None:
    """The token row with this digest, revoked or not (None: no such token)."""
    return session.scalar(select(ApiToken).where(ApiToken.digest == digest))


def revoke_token(session: Session, *, digest: str) -> bool:
    """Mark the token revoked (committed); False when there is no such token."""
    row = token_by_digest(session, digest=digest)
    if row is None:
        return False
    row.revoked = True
    session.commit()
    return True


def list_tokens(session: Session, *, project: str | None = None) -> list[ApiToken]:
    """Every token row (digests included: callers show only the rest), oldest first."""
    q = select(ApiToken).order_by(ApiToken.created_at, ApiToken.id)
    if project is not None:
        q = q.where(ApiToken.project == project)
    return list(session.scalars(q))
