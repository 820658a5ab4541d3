"""The analysis lease: one holder per database among collector processes, taken over on release."""

import subprocess
import sys
import textwrap
import time

from trainvitals.service.store import db
from trainvitals.service.store.lease import AnalysisLease


def test_one_holder_at_a_time_and_takeover(db_url: str) -> None:
    engines = [db.make_engine(db_url) for _ in range(2)]
    first, second = (AnalysisLease(e) for e in engines)
    try:
        assert first.acquire()
        assert first.acquire()  # re-asking while holding is cheap and stays true
        assert not second.acquire()
        first.release()
        assert second.acquire()  # the next cycle of another process takes over
        assert not first.acquire()
    finally:
        first.release()
        second.release()
        for e in engines:
            e.dispose()


def test_a_killed_holder_releases_the_lease(db_url: str) -> None:
    """The holder dies without releasing (SIGKILL): the database or the kernel lets go."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from trainvitals.service.store.lease import AnalysisLease
                from trainvitals.service.store import db
                lease = AnalysisLease(db.make_engine({db_url!r}))
                assert lease.acquire()
                print("held", flush=True)
                time.sleep(60)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    engine = db.make_engine(db_url)
    lease = AnalysisLease(engine)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert not lease.acquire()
        holder.kill()
        holder.wait(10)
        for _ in range(50):  # PostgreSQL notices the closed socket within moments
            if lease.acquire():
                break
            time.sleep(0.1)
        assert lease.held
    finally:
        holder.kill()
        lease.release()
        engine.dispose()
