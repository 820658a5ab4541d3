"""What the agent tells the person running the job about delivery.

WARNING lines on the `trainvitals.agent` logger (with no logging configured, Python prints them
to stderr), each distinct message once per process, not once per batch: a misconfigured token
costs one line, not one every two seconds. They name the collector (without credentials), the
collector's own reason, the files where data waits and the command that delivers it; never a
token. The texts are listed in docs/agent.md.
"""

from __future__ import annotations

import re
import shlex
import urllib.parse
from pathlib import Path

from trainvitals.agent._guard import logger
from trainvitals.agent._refusals import Verdict
from trainvitals.agent._transport import Reply

_TOKEN_LIKE = re.compile(r"tv_[A-Za-z0-9_-]{6,}")
_MAX_DISTINCT = 256  # distinct messages remembered; past it new ones are not printed


def display_url(url: str) -> str:
    """The collector URL as printed: no user:password@, no query."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class Notices:
    """The delivery's messages, each said once.

    Usage::

        notices = Notices(collector=url, spool=path, quarantine=qpath, token=cfg.token,
                          retry_backoff_s=2.0)
        notices.refused("batch", reply, "set_aside", reason="...")
    """

    def __init__(
        self, *, collector: str, spool: Path, quarantine: Path, token: str | None, retry_backoff_s: float
    ) -> None:
        self.url = display_url(collector)
        self._spool = spool
        self._quarantine = quarantine
        self._token = token
        self._backoff_s = retry_backoff_s
        self._said: set[tuple[str, ...]] = set()
        self._fenced = False  # the collector refused this process as another job (409 registration)

    def unreachable(self, exc: OSError) -> None:
        self._say(
            ("unreachable", type(exc).__name__),
            f"cannot reach the collector at {self.url} ({type(exc).__name__}: {exc}); training continues, "
            f"batches wait in {self._spool} and are retried every {self._backoff_s:g} s",
        )

    def refused(
        self,
        kind: str,
        reply: Reply,
        verdict: Verdict,
        *,
        reason: str,
        leftover: bool,
        retry_for_s: float | None,
        project_named: bool,
    ) -> None:
        """kind: 'registration' or 'batch'; retry_for_s: what is left of the auth window;
        project_named: this process's registration names a project (else it takes the token's)."""
        what = "the run registration" if kind == "registration" else "a batch"
        if leftover:
            what = f"{what} an earlier process of this rank left in the spool"
        head = f"the collector at {self.url} refused {what} ({reply.status}): {reason}"
        if reply.status == 401:
            head += " (TRAINVITALS_TOKEN: an ingest token of this collector, `trainvitals token create --scope ingest`)"
        elif reply.status == 403 and project_named and not leftover:
            head += " (the project comes from attach(project=) or TRAINVITALS_PROJECT; without either, the token's)"
        if verdict == "set_aside" and reply.status == 409 and kind == "registration":
            # Another job under this run id: the collector fences this process, so replaying the
            # set-aside batches would be refused the same way; they are kept for the record only.
            text = f"{head}. Set aside in {self._quarantine} (kept for the record); later data keeps flowing"
            self._fenced = True
        elif verdict == "set_aside":
            text = (
                f"{head}. Set aside in {self._quarantine}; later data keeps flowing. Once the cause is "
                f"fixed: {replay_command(self._quarantine)}"
            )
        elif retry_for_s is not None:
            text = (
                f"{head}. Training continues; batches wait in {self._spool} and are retried for "
                f"{retry_for_s:.0f} s more (a fixed token is picked up), then set aside in {self._quarantine}"
            )
        else:
            text = f"{head}. Training continues; batches wait in {self._spool} and are retried"
        # One line per distinct reason: a 422's field paths and run ids repeat, its indices may not.
        self._say((verdict, kind, str(reply.status), str(leftover), re.sub(r"\d+", "#", reason)), text)

    def exit_wait(self, seconds: float, batches: int) -> None:
        self._say(
            ("exit_wait",),
            f"waiting up to {seconds:.1f} s (flush_timeout_s) for the collector at {self.url} to take "
            f"{batches} batch(es); what it does not take stays in {self._spool}",
        )

    def exit_report(self, *, waiting: int, set_aside: int) -> None:
        if waiting:
            self._say(
                ("exit_waiting",),
                f"{waiting} batch(es) were not delivered to the collector at {self.url}; they wait in "
                f"{self._spool}. The next start of this rank on this node sends them, or store them with: "
                f"{replay_command(self._spool)}",
            )
        if set_aside:
            fix = (
                "To keep this job's data, rerun it under its own run id"
                if self._fenced
                else f"Once it is fixed, store them with: {replay_command(self._quarantine)}"
            )
            self._say(
                ("exit_set_aside",),
                f"{set_aside} batch(es) the collector refused are set aside in {self._quarantine} (the "
                f"reason is above). {fix}",
            )

    def _say(self, key: tuple[str, ...], text: str) -> None:
        if key in self._said or len(self._said) >= _MAX_DISTINCT:
            return
        self._said.add(key)
        if self._token:
            text = text.replace(self._token, "<token>")
        logger.warning("trainvitals agent: %s", _TOKEN_LIKE.sub("tv_<redacted>", text))


def replay_command(path: Path) -> str:
    """The command that stores a spool or quarantine file. The agent cannot know the collector's
    database (nor should a URL with its password reach a training log): the user adds it."""
    return (
        f"trainvitals replay {shlex.quote(str(path))} (add --db <the collector's database URL> "
        "unless it is $TRAINVITALS_DB or ./trainvitals.db)"
    )
