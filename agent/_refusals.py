"""What the delivery does with a collector's answer: count it delivered, retry it later, or set
it aside in the quarantine file so that later data flows (docs/agent.md, "When the collector
refuses").

Retrying the same bytes cannot fix a malformed message (400, 413, 422) or a refused registration
(409: another job's run id, or with auth off another project's); an operator can fix a token
while the job runs, so authentication refusals (401, 403) are retried for `auth_retry_s` first.
Everything else (5xx, 404, 429) is the collector's own trouble: retried until it answers. A 404
on the registration is more likely a wrong URL (with /v1, or Prometheus'); it is retried too, and
the notice names the fix (agent/_notices.py).
"""

from __future__ import annotations

import json
from typing import Literal

from trainvitals.agent._transport import Reply

Verdict = Literal["delivered", "retry", "set_aside"]

AUTH = frozenset({401, 403})
PERMANENT = frozenset({400, 409, 413, 422})
AUTH_BACKOFF_S = 10.0
"""Between retries of an auth refusal: a fixed token is picked up within this, and 16,384 ranks
refused at once cost a collector ~1.6k cached-token lookups a second, not ~8k."""


# Registration fields added to wire v1 after it shipped. A collector older than them refuses them as
# unknown (extra="forbid": a typo must not be dropped silently); the agent then registers without
# them rather than lose the run's data (agent/_delivery.py).
LATER_REGISTRATION_FIELDS: frozenset[tuple[str, str]] = frozenset(
    {
        ("model", "experts"),
        ("model", "active_experts"),
        ("model", "shared_ffn_hidden"),
        ("model", "head_dim"),
        ("model", "attention_core_width"),
    }
)


def without_absent_later_fields(registration: dict) -> dict:
    """The registration without the later fields it has no value for, removed in place (and the
    registration returned): sent as null they would only have a collector older than them refuse it
    once, and the notice name fields the model lacks."""
    for section, name in LATER_REGISTRATION_FIELDS:
        values = registration.get(section)
        if isinstance(values, dict) and name in values and values[name] is None:
            del values[name]
    return registration


def unknown_later_fields(reply: Reply) -> list[tuple[str, str]]:
    """The later registration fields a 422 refused as unknown, when they are all it refused;
    [] for any other answer (another error of the registration is the job's to fix)."""
    if reply.status != 422:
        return []
    try:
        detail = json.loads(reply.body).get("detail")
    except (ValueError, AttributeError):
        return []
    if not isinstance(detail, list) or not detail:
        return []
    fields = []
    for err in detail:
        loc = err.get("loc") if isinstance(err, dict) else None
        if not isinstance(loc, list) or len(loc) != 3 or loc[0] != "body" or err.get("type") != "extra_forbidden":
            return []
        field = (loc[1], loc[2])
        if field not in LATER_REGISTRATION_FIELDS:
            return []
        fields.append(field)
    return fields


def reason(reply: Reply) -> str:
    """The collector's own words for a refusal: FastAPI's `detail` (a string, or a 422's list of
    field errors), else the start of the body."""
    try:
        detail = json.loads(reply.body).get("detail")
    except (ValueError, AttributeError):
        detail = None
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        parts = [
            f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg', '')}"
            for err in detail[:3]
            if isinstance(err, dict)
        ]
        more = f" (+{len(detail) - 3} more)" if len(detail) > 3 else ""
        return "; ".join(parts) + more
    return reply.body[:200].decode("utf-8", "replace").strip() or "no reason given"


class AuthWindow:
    """How long authentication refusals are retried: `retry_s` from the first refusal since the
    collector last accepted a message; after that each refused message is set aside at once (and
    a message accepted again closes the window).

    Usage::

        window = AuthWindow(300.0)
        if window.refused(now):   # still inside the window: retry later
            ...
        window.accepted()
    """

    def __init__(self, retry_s: float) -> None:
        self.retry_s = retry_s
        self.since: float | None = None

    def refused(self, now: float) -> bool:
        """A refusal at `now`; True while it is still worth retrying."""
        if self.since is None:
            self.since = now
        return now - self.since < self.retry_s

    def accepted(self) -> None:
        self.since = None


def verdict(status: int, *, leftover: bool, window: AuthWindow, now: float) -> Verdict:
    """What to do with a message the collector answered `status`.

    leftover: the message is an earlier process's (a spool it left on this node). Its auth
    refusal is set aside at once: the window is for the running job's own data, and an old
    spool must not hold that data back for minutes.
    """
    if status < 300:
        window.accepted()
        return "delivered"
    if status in AUTH:
        return "retry" if not leftover and window.refused(now) else "set_aside"
    if status in PERMANENT:
        return "set_aside"
    return "retry"
