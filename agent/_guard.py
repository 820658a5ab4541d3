"""The agent never raises into the job: every hook body runs under `guarded`, errors are counted
and logged at most once per interval."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

logger = logging.getLogger("trainvitals.agent")

P = ParamSpec("P")
R = TypeVar("R")


_MAX_KINDS = 64  # (where, exception type) pairs rate-limited apart; past it they share one limit


class ErrorBudget:
    """Counts agent-internal errors and rate-limits their log lines, per kind (where it happened
    and the exception's type): a repeating error never hides a new one."""

    def __init__(self, log_every_s: float = 60.0) -> None:
        self.errors = 0
        self._log_every_s = log_every_s
        self._last_log: dict[tuple[str, str], float] = {}

    def record(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        now = time.monotonic()
        key = (where, type(exc).__name__)
        if key not in self._last_log and len(self._last_log) >= _MAX_KINDS:
            key = ("", "")
        if now - self._last_log.get(key, -float("inf")) >= self._log_every_s:
            self._last_log[key] = now
            logger.warning(
                "trainvitals agent error in %s (%d so far; training continues): %s",
                where,
                self.errors,
                _exception_line(exc),
            )


def warn_once(said: set[tuple[str, str]], key: tuple[str, str], text: str) -> None:
    """One WARNING line per key for the life of `said` (the agent's): a mistake in what the job
    passes is said once, however often the job repeats it."""
    if key not in said:
        said.add(key)
        logger.warning("trainvitals agent: %s", text)


def _exception_line(exc: BaseException, limit: int = 300) -> str:
    """The exception's type and the first line of its message: torch's dispatcher errors run to
    10 KB and a hundred lines (every backend it has a kernel for), in the job's log each interval."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def guarded(
    budget_attr: str = "_errors", default: object = None
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Method decorator: exceptions are recorded in `self.<budget_attr>` and swallowed."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def inner(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the job must never see agent errors
                getattr(args[0], budget_attr).record(fn.__qualname__, exc)
                return default  # type: ignore[return-value]

        return inner

    return wrap
