"""What the agent tells the person running the job about delivery.

WARNING lines on the `trainvitals.agent` logger (with no logging configured, Python prints them
to stderr), each distinct message once per process, not once per batch: a misconfigured token
costs one line, not one every two seconds, and a new kind of trouble (another errno, another drop
reason) gets its own line however often an old one repeats. They name the collector (without
credentials), the collector's own reason, the files where data waits and the command that
delivers it; never a token. The texts are listed in docs/agent.md.
"""

from __future__ import annotations

import errno
import re
import shlex
import urllib.parse
from collections.abc import Mapping
from pathlib import Path

from trainvitals.agent._guard import logger
from trainvitals.agent._refusals import Verdict
from trainvitals.agent._spool import disk_full
from trainvitals.agent._transport import Reply

_TOKEN_LIKE = re.compile(r"tv_[A-Za-z0-9_-]{6,}")
_MAX_DISTINCT = 256  # distinct messages remembered; past it, one line says so and new ones are not printed

# What each drop reason (agent/_processor.py) means, in the exit message.
_DROP_CAUSES: dict[str, str] = {
    "queue_full": "the queue was full (queue_max_records)",
    "spool_full": "the spool had reached spill_max_bytes and memory was full or the job ended first",
    "spool_error": "the spool could not be written (the reason is above) and memory was full or the job ended first",
    "quarantine_full": "refused by the collector, and the quarantine file had reached spill_max_bytes",
    "quarantine_error": "refused by the collector, and the quarantine file could not be written",
    "exit_timeout": "still unsent when close() stopped waiting for the collector (flush_timeout_s)",
}


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
        self,
        *,
        collector: str,
        spool: Path,
        quarantine: Path,
        token: str | None,
        retry_backoff_s: float,
        hold_max_bytes: int = 64 << 20,
    ) -> None:
        self.url = display_url(collector)
        self._spool = spool
        self._quarantine = quarantine
        self._token = token
        self._backoff_s = retry_backoff_s
        self._hold = f"up to {hold_max_bytes / (1 << 20):g} MiB"
        self._said: set[tuple[str, ...]] = set()
        self._fenced = False  # the collector refused this process as another job (409 registration)
        # The collector refused this process's token (401, 403) and has not taken its registration
        # since: the spool's registration then names no project the collector chose, and a replay
        # without --project would store the run under the one it names, or 'default'.
        self._auth_refused = False

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
        elif reply.status == 404 and kind == "registration":
            # Not the collector's trouble: a URL with /v1 or another path, or another service's
            # (Prometheus, Grafana) answers 404 on every retry; the line has to name the fix.
            head += (
                " (TRAINVITALS_COLLECTOR must be the collector's base URL, http://host:8000: "
                "no /v1, not Prometheus' or Grafana's)"
            )
        if reply.status in (401, 403) and not leftover:
            self._auth_refused = True
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

    def older_collector(self, fields: list[str]) -> None:
        """The collector refused registration fields it is older than; the run registered without them."""
        losses = [
            text
            for names, text in (
                ({"model.experts", "model.active_experts"}, "takes the model as dense"),
                ({"model.shared_ffn_hidden"}, "leaves the MoE's shared experts out"),
                ({"model.head_dim"}, "counts its attention hidden wide, not heads x head_dim"),
                ({"model.attention_core_width"}, "counts its attention core hidden wide, not as wide as its heads"),
            )
            if names & set(fields)
        ]
        loss = " and ".join(losses) or "is made without them"
        self._say(
            ("older_collector", *fields),
            f"the collector at {self.url} is older than this agent: it does not know the registration field(s) "
            f"{', '.join(fields)}, so the run is registered without them (its MFU prediction {loss}). Upgrade the "
            "collector to the agent's version",
        )

    def registered(self) -> None:
        """The collector took this process's registration: its token works (again)."""
        self._auth_refused = False

    def cannot_write(self, path: Path, exc: OSError) -> None:
        """The spool, the quarantine or the record file could not be written; once per file and
        errno, so a full disk after a permission problem is said too."""
        code = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
        if path == self._spool:
            then = (
                f"batches the collector cannot take now are kept in memory ({self._hold}) and sent from "
                "there; past that, or at exit, they are dropped and counted"
            )
        elif path == self._quarantine:
            then = "batches the collector refuses for good are dropped and counted"
        else:
            then = "the record file misses these batches; delivery goes on"
        if path not in (self._spool, self._quarantine):
            fix = "fix the path of record_file"
        elif disk_full(exc):
            fix = (
                "free space on that file system, raise the quota or file-size limit, or set "
                "TRAINVITALS_SPILL_DIR to a node-local directory with room"
            )
        else:
            fix = "set TRAINVITALS_SPILL_DIR (AgentConfig.spill_dir) to a node-local directory this user can write"
        text = f"cannot write {path} ({type(exc).__name__}: {exc}); {then}. Fix: {fix}"
        self._say(("cannot_write", str(path), code), text)

    def file_full(self, path: Path, max_bytes: int) -> None:
        self._say(
            ("file_full", str(path)),
            f"{path} has reached spill_max_bytes ({max_bytes} bytes); "
            + (
                f"batches the collector cannot take now are kept in memory ({self._hold}); past that they are "
                "dropped and counted"
                if path == self._spool
                else "batches the collector refuses for good are dropped and counted"
            ),
        )

    def dropped(self, reason: str, items: int) -> None:
        """The first loss of each reason, when it happens (the totals come at exit)."""
        self._say(
            ("dropped", reason),
            f"dropped {items} record(s) ({reason}: {_DROP_CAUSES.get(reason, reason)}); every loss is counted "
            "in agent.stats(), sent to the collector as a 'dropped' event and totalled at exit",
        )

    def torn_tail(self, nbytes: int) -> None:
        self._say(
            ("torn_tail",),
            f"cut off a torn last line ({nbytes} bytes) of {self._spool}: an earlier process of this rank "
            "ended in the middle of writing it, and that batch is lost; the lines before it are delivered",
        )

    def exit_dropped(self, dropped: Mapping[str, int]) -> None:
        lost = {reason: n for reason, n in dropped.items() if n}
        if not lost:
            return
        why = "; ".join(f"{n} {reason} ({_DROP_CAUSES.get(reason, reason)})" for reason, n in lost.items())
        self._say(
            ("exit_dropped",),
            f"{sum(lost.values())} record(s) of this process were lost and never reach the collector: {why}",
        )

    def exit_wait(self, seconds: float, batches: int) -> None:
        self._say(
            ("exit_wait",),
            f"waiting up to {seconds:.1f} s (flush_timeout_s) for the collector at {self.url} to take "
            f"{batches} batch(es); what it does not take stays in {self._spool}",
        )

    def exit_report(self, *, waiting: int, set_aside: int) -> None:
        if waiting:
            then = (
                # `replay` has no token to say the project: the spool's registration names none (or
                # the refused one), so without --project the run would be stored under that or 'default'.
                "Fix the token (or the project) and rerun the job: the next start of this rank on this node "
                f"sends them; or store them with: {replay_command(self._spool, project=True)}"
                if self._auth_refused
                else f"The next start of this rank on this node sends them, or store them with: "
                f"{replay_command(self._spool)}"
            )
            self._say(
                ("exit_waiting",),
                f"{waiting} batch(es) were not delivered to the collector at {self.url}; they wait in "
                f"{self._spool}. {then}",
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
        if key in self._said or len(self._said) > _MAX_DISTINCT:
            return
        self._said.add(key)
        if len(self._said) > _MAX_DISTINCT:
            text = f"{_MAX_DISTINCT} distinct messages said; further ones are not printed (agent.stats() counts)"
        if self._token:
            text = text.replace(self._token, "<token>")
        logger.warning("trainvitals agent: %s", _TOKEN_LIKE.sub("tv_<redacted>", text))


def replay_command(path: Path, *, project: bool = False) -> str:
    """The command that stores a spool or quarantine file. The agent cannot know the collector's
    database (nor should a URL with its password reach a training log): the user adds it.
    project: the file's registration names no project the collector chose (an auth refusal)."""
    named = " --project <the run's project>" if project else ""
    return (
        f"trainvitals replay {shlex.quote(str(path))}{named} (add --db <the collector's database URL> "
        "unless it is $TRAINVITALS_DB or ./trainvitals.db)"
    )
