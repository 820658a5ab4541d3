"""event()'s arguments as the wire's event record takes them.

The collector refuses a batch whole when one record breaks the wire's rules, so one event written
the way a user writes it cost every record of its send interval (a 422, set aside in the
quarantine, and refused again on replay): a kind of their own (`agent.event("eval")`), a failure's
traceback as its detail (past 4,096 characters), a node number as a domain value. Here each is
made to fit, with one warning per mistake that names the fix.
"""

from __future__ import annotations

from typing import Any, get_args

from trainvitals.agent._guard import warn_once
from trainvitals.wire.conventions import EventKind

KINDS: frozenset[str] = frozenset(get_args(EventKind))
MAX_DETAIL = 4096  # EventRecord.detail's max_length
MAX_DOMAINS = 16  # EventRecord.domains' max_length


def fit_event(
    kind: Any, detail: Any, domains: Any, said: set[tuple[str, str]]
) -> tuple[EventKind, str | None, dict[str, str] | None]:
    """(kind, detail, domains) the collector takes: an unknown kind becomes a 'note' whose detail
    starts with it, a detail past the limit keeps its end (where a traceback names the error),
    domains become strings and at most 16 of them. `said` (the agent's) holds what was warned."""
    if kind not in KINDS:
        kinds = ", ".join(sorted(KINDS - {"dropped"}))  # 'dropped' is the agent's own count of lost records
        warn_once(said, ("kind", str(kind)),
             f"event({kind!r}) is not a kind the collector takes ({kinds}): sent as a 'note' whose detail "
             f"starts with {kind!r}; for a marker of your own, use agent.event('note', detail=...)")  # fmt: skip
        detail = f"{kind}: {detail}" if detail is not None else str(kind)
        kind = "note"
    if detail is not None:
        detail = str(detail)
        if len(detail) > MAX_DETAIL:
            warn_once(said, ("detail", ""),
                 f"an event's detail of {len(detail):,} characters is cut to its last {MAX_DETAIL:,} (the wire's "
                 "limit), where a traceback names the error")  # fmt: skip
            detail = "..." + detail[-(MAX_DETAIL - 3) :]
    if domains:
        items = [(str(k), str(v)) for k, v in dict(domains).items()]
        if len(items) > MAX_DOMAINS:
            warn_once(said, ("domains", ""), f"an event's {len(items)} domains are cut to its first {MAX_DOMAINS}")
            items = items[:MAX_DOMAINS]
        domains = dict(items)
    return kind, detail, domains or None

