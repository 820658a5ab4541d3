"""One rank's exporter under a file-size limit (RLIMIT_FSIZE), as a full disk looks to the agent,
or (limit 0) under no limit, for a spool directory the process may not write.

Run by tests/agent/test_spool_faults.py: argv = collector URL, spill dir, the limit in bytes, the
memory hold in bytes. SIGXFSZ is ignored, so a write past the limit returns EFBIG instead of
killing the process. Driven over stdin/stdout so the parent can stop and start the collector:
  phase 1, collector down: 8 batches of 10 steps (steps 0-79), one pass each;
  prints {"spool": [its lines]} and waits for a line on stdin (the collector is back);
  phase 2: 1 batch (steps 80-89), one pass; phase 3: 3 batches (steps 90-119) left to the last
  pass (write-ahead) of shutdown; prints {"stats": ..., "log": [warnings]}.
"""

import json
import logging
import resource
import signal
import sys
import time
from pathlib import Path

from trainvitals.agent import AgentConfig
from trainvitals.agent._delivery import spooling_exporter


def _steps(exp: object, first: int, n: int) -> None:
    for i in range(first, first + n):
        exp.emit({"kind": "step", "step": i, "ts": 1.0, "step_seconds": 0.1})  # type: ignore[attr-defined]


def main() -> None:
    url, spill_dir, limit, hold = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("trainvitals.agent").addHandler(Keep())
    config = AgentConfig(
        collector=url, spill_dir=spill_dir, max_batch_records=10, retry_backoff_s=0.0, http_timeout_s=2.0
    )
    exp = spooling_exporter(
        config=config,
        run="fsize",
        rank=0,
        incarnation=1,
        registration={"run": "fsize", "parallelism": {"world_size": 1}},
        hold_max_bytes=hold,
    )
    for b in range(8):
        _steps(exp, b * 10, 10)
        exp.run_once(deadline=time.monotonic() + 5)
    spool = Path(spill_dir) / "fsize.rank0.jsonl"
    lines = spool.read_text().split("\n") if spool.exists() else None
    print(json.dumps({"spool": lines, "dropped": exp.stats.dropped}), flush=True)
    sys.stdin.readline()
    _steps(exp, 80, 10)
    exp.run_once(deadline=time.monotonic() + 10)
    _steps(exp, 90, 30)
    exp.shutdown(timeout=10)
    stats = {
        "delivered_records": exp.stats.delivered_records,
        "delivered_batches": exp.stats.delivered_batches,
        "emitted_records": exp.stats.emitted_records,
        "dropped": exp.stats.dropped,
        "spool_left": spool.exists(),
    }
    print(json.dumps({"stats": stats, "log": said}), flush=True)


if __name__ == "__main__":
    main()
