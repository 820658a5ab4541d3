"""SIGTERM as an orderly exit, so the agent's exit pass runs.

torchrun (and most schedulers) stop every rank of a job with SIGTERM when one rank fails or the
job is preempted. Python's default for SIGTERM ends the process at once, without atexit: the
records of the last send interval, the steps leading up to the failure that a post-mortem needs
most, would be lost and not even counted. Installed only where the job left SIGTERM at its
default and only from the main thread; the handler turns the signal into SystemExit(128 + 15),
the exit status a SIGTERM'd process reports to its shell, so the stack unwinds (finally blocks
run) and the agent's atexit close writes what is undelivered to the spool and delivers it within
`flush_timeout_s`. A second SIGTERM kills at once, as before.

A main thread blocked in a C call (a collective waiting for a dead peer) sees the signal only when
that call returns: the scheduler's SIGKILL then ends it as it always did.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

_installed = False


def _exit(signum: int, _frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the next SIGTERM is the default again: immediate
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
