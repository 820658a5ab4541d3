"""SIGTERM as an orderly exit, so the agent's exit pass runs.

torchrun (and most schedulers) stop every rank of a job with SIGTERM when one rank fails or the
job is preempted. Python's default for SIGTERM ends the process at once, without atexit: the
records of the last send interval, the steps leading up to the failure that a post-mortem needs
most, would be lost and not even counted. Installed only where the job left SIGTERM at its
default and only from the main thread; the handler turns the signal into SystemExit(128 + 15),
the exit status a SIGTERM'd process reports to its shell, so the stack unwinds (finally blocks
run) and the agent's atexit close writes what is undelivered to the spool and delivers it within
`flush_timeout_s`. A second SIGTERM kills at once, as before.

A SIGTERM that arrives while the agent is already in that exit pass (`exit_pass`: the process is
ending on an exception of its own, or the job closed the agent) waits for it, then ends the process
as it would have (in the atexit close the process is ending already and keeps its own status).
torchrun sends its SIGTERM moments after one rank fails, when the other ranks have usually raised
the collective's error already and are delivering their last records: raised there, SystemExit cut
the delivery short and those records, the run up to the failure, were lost.

A main thread blocked in a C call (a collective waiting for a dead peer) sees the signal only when
that call returns: the scheduler's SIGKILL then ends it as it always did.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_installed = False
_in_exit_pass = False
_deferred: int | None = None  # a signal that arrived during the exit pass


def _exit(signum: int, _frame: FrameType | None) -> None:
    global _deferred
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the next SIGTERM is the default again: immediate
    if _in_exit_pass:
        _deferred = signum  # the exit pass is delivering: the process ends when it is done
        return
    raise SystemExit(128 + signum)


@contextmanager
def exit_pass() -> Iterator[None]:
    """The agent's exit pass (close): a SIGTERM during it is held until the pass ends (within
    `flush_timeout_s`), then raised as SystemExit as it would have been. Only where `install`
    installed the handler, and only on the main thread, where Python runs signal handlers."""
    global _in_exit_pass, _deferred
    if not _installed or _in_exit_pass or threading.current_thread() is not threading.main_thread():
        yield
        return
    _in_exit_pass = True
    try:
        yield
    finally:
        _in_exit_pass = False
        signum, _deferred = _deferred, None
        if signum is not None:
            raise SystemExit(128 + signum)


def install() -> bool:
    """Make SIGTERM an orderly exit; False (nothing changed) when the job handles SIGTERM itself,
    this is not the main thread, or the platform has no SIGTERM handling."""
    global _installed
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return False  # the job's own handler (or SIG_IGN) stays
        signal.signal(signal.SIGTERM, _exit)
    except (ValueError, OSError, AttributeError):
        return False
    _installed = True
    return True
