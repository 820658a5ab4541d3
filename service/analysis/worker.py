"""Background analysis: every few seconds, reduce and run the detectors for each live run.

One daemon thread per collector process; with several processes on one database, only the holder
of the analysis lease (store/lease.py) runs cycles. Each run is processed in its own session and its own
try block, so one bad run cannot stop the others. A run whose analysis raises is retried every cycle,
and every failure is visible where someone looks: a log line naming the run (the traceback on the
first failure in a row, or when the error changes), an open `analysis_failed` finding of the run
(exported like any finding, its magnitude the failures in a row), and the errors counter. A cycle
that fails outside any run (the database unreachable) is logged, counted, and retried with backoff.

Each run's writes, its `analysis_failed` finding and the cycle's status row are fenced
(store/lease.py `fence`): a holder whose lease ended mid-cycle, or whose run was deleted
meanwhile, rolls them back rather than overwrite the new holder's.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from sqlalchemy.orm import Session

from trainvitals.service.analysis import pipeline
from trainvitals.service.analysis.detector_inputs import DetectorInputs
from trainvitals.service.settings import Settings
from trainvitals.service.store import analysis_status, detector_blocks, findings, queries, summaries
from trainvitals.service.store.lease import AnalysisLease, LeaseLost, RunGone, fence
from trainvitals.service.thread_names import name_this_thread

logger = logging.getLogger("trainvitals.service")


class AnalysisWorker:
    """Usage::

    worker = AnalysisWorker(sessionmaker, settings, lease=AnalysisLease(engine))
    worker.start()   # or worker.run_once() synchronously (tests, replay; takes the lease first, if one is asked)
    worker.stop()
    """

    def __init__(
        self,
        session_factory: Callable[[], Session],
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
        lease: AnalysisLease | None = None,
    ) -> None:
        self._session_factory = session_factory
        self._lease = lease
        self._settings = settings
        self._clock = clock
        self._config = pipeline.PipelineConfig(
            settle_seconds=settings.settle_seconds,
            rank_window_steps=settings.rank_window_steps,
            detector_warmup_steps=settings.detector_warmup_steps,
        )
        self._inputs: dict[str, DetectorInputs] = {}  # per live run, kept between cycles
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_error: dict[str, str] = {}  # per failing run: its newest error (logged in full when it changes)
        self.cycles = 0
        self.errors = 0
        self._holder = f"{socket.gethostname()}:{os.getpid()}"

    def run_once(self) -> int:
        """One pass over live runs, once this process holds the lease (when one is asked); returns
        steps reduced (0 while another process holds the lease)."""
        # Only the lease holder analyses; the others keep asking, to take over if it dies.
        if self._lease is not None:
            taken = self._lease.taken
            if not self._lease.acquire():
                self._inputs.clear()  # another process analyses meanwhile: what this one kept goes stale
                return 0
            if self._lease.taken != taken:  # taken anew: another process may have analysed since
                self._inputs.clear()
        return self._analyse_live_runs()

    def _analyse_live_runs(self) -> int:
        now = self._clock()
        started = time.perf_counter()
        errors_before = self.errors
        total = 0
        with self._session_factory() as session:
            fence(session, lease=self._lease, run_id=None)
            runs = queries.live_runs(
                session,
                now=now,
                finished_grace_seconds=self._settings.finished_run_grace_seconds,
                idle_seconds=self._settings.idle_run_seconds,
            )
            run_ids = [r.run_id for r in runs]
            detector_blocks.forget_runs_except(session, live=run_ids)
        for gone in self._inputs.keys() - set(run_ids):
            del self._inputs[gone]
        for run_id in run_ids:
            with self._session_factory() as session:
                try:
                    fence(session, lease=self._lease, run_id=run_id)
                    run = queries.get_run(session, run_id=run_id)
                    if run is not None:
                        inputs = self._inputs.setdefault(run_id, DetectorInputs(blocks=True))
                        total += pipeline.process_run(session, run, now=now, config=self._config, inputs=inputs)
                    self._last_error.pop(run_id, None)
                except RunGone:  # deleted meanwhile: its writes are dropped, and so is what was kept of it
                    session.rollback()
                    self._inputs.pop(run_id, None)
                except LeaseLost:  # the cycle ends here: _loop says so and lets the lease go
                    session.rollback()
                    raise
                except Exception as exc:  # noqa: BLE001 - keep analysing the other runs
                    session.rollback()
                    self._inputs.pop(run_id, None)  # read it whole next time
                    self.errors += 1
                    self._failed(run_id, exc, now)
        for gone in self._last_error.keys() - set(run_ids):
            del self._last_error[gone]
        self.cycles += 1
        self._record_cycle(time.perf_counter() - started, self.errors - errors_before)
        return total

    def _lease_lost(self) -> None:
        """Another process may have analysed since the lease ended: none of this cycle's later
        writes may overwrite its (store/lease.py fence). The next cycle asks for the lease again."""
        logger.warning(
            "analysis lease lost mid-cycle (%s): the rest of the cycle's writes were dropped; "
            "another collector process may be analysing",
            self._holder,
        )
        self._inputs.clear()
        if self._lease is not None:
            self._lease.release()

    def _failed(self, run_id: str, exc: Exception, now: float) -> None:
        """One run's analysis raised: its finding, then one log line naming it (every time)."""
        error = f"{type(exc).__name__}: {exc}"[:500]
        in_a_row = None
        try:
            with self._session_factory() as session:
                # Fenced like the run's analysis: a holder that lost the lease (or whose run was
                # deleted) must not open a failure on a run another holder analyses (or a reused id).
                fence(session, lease=self._lease, run_id=run_id)
                step = summaries.first_unreduced_step(session, run_id=run_id)
                in_a_row = findings.record_analysis_failure(session, run_id=run_id, step=step, error=error, now=now)
        except Exception:  # noqa: BLE001 - the database itself may be what failed; the log still says it
            logger.debug("recording the analysis failure of run %s failed", run_id, exc_info=True)
        times = f"{in_a_row} in a row" if in_a_row is not None else "not recorded as a finding"
        if self._last_error.get(run_id) != error:
            logger.error("analysis of run %s failed (%s); retried every cycle", run_id, times, exc_info=exc)
        else:  # the same error as the run's previous failure: its traceback is in the log already
            logger.error("analysis of run %s failed (%s): %s", run_id, times, error)
        self._last_error[run_id] = error

    def _record_cycle(self, seconds: float, errors: int) -> None:
        """The cycle's time and errors into the database, where every collector process exports them."""
        try:
            with self._session_factory() as session:
                fence(session, lease=self._lease, run_id=None)  # the status row is the holder's
                analysis_status.record_cycle(
                    session, seconds=seconds, errors=errors, now=self._clock(), holder=self._holder
                )
        except Exception:  # noqa: BLE001 - bookkeeping must never stop the analysis
            logger.debug("recording the analysis cycle failed", exc_info=True)

    def _loop(self) -> None:
        name_this_thread()
        interval = self._settings.analysis_interval_seconds
        pause = interval
        failures = 0  # cycles in a row that raised outside any run's analysis
        try:
            while not self._stop.wait(pause):
                started = time.monotonic()
                try:
                    self.run_once()
                    failures = 0
                except LeaseLost:
                    self._lease_lost()
                except Exception as exc:  # noqa: BLE001 - the database may be back next cycle
                    failures += 1
                    self._cycle_failed(exc, retry_in=backoff(interval, failures))
                pause = pause_after_cycle(interval, time.monotonic() - started)
                if failures:
                    pause = backoff(interval, failures)
        finally:
            if self._lease is not None:
                self._lease.release()

    def _cycle_failed(self, exc: Exception, *, retry_in: float) -> None:
        """A cycle raised outside any one run (the database unreachable, a dropped connection):
        one line, the errors counter, and a cycle after `retry_in` seconds."""
        self._inputs.clear()  # a cycle stopped half-way: read every run whole next time
        self.errors += 1
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        logger.error("analysis cycle failed (%s); retried in %.3g s", error, retry_in)
        try:
            with self._session_factory() as session:
                analysis_status.record_errors(session, errors=1)
        except Exception:  # noqa: BLE001 - most likely the same database error
            logger.debug("recording the analysis cycle's failure failed", exc_info=True)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="trainvitals-analysis", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._lease is not None:  # run_once called synchronously took it too: another process may analyse now
            self._lease.release()


MAX_BACKOFF_S = 60.0


def backoff(interval: float, failures: int) -> float:
    """The wait after `failures` failed cycles in a row: doubling from one interval, at most a minute."""
    return min(interval * 2 ** min(failures - 1, 16), max(MAX_BACKOFF_S, interval))


def pause_after_cycle(interval: float, cycle_seconds: float) -> float:
    """The wait before the next cycle: cycles start `interval` apart, so a step that completes just
    after a cycle read the steps is reduced one interval later, not an interval plus the rest of
    that cycle (the step-to-screen bound, docs/performance.md); after a cycle longer than half the
    interval, half an interval, so that a large run's long cycles do not run back to back."""
    return max(interval - cycle_seconds, interval / 2)
