"""Dump every finding of the detector evaluation as JSON, to prove a refactor kept them.

    python benchmarks/findings_dump.py OUT.json [--seeds 10]

Two parts: `pure`, the findings of `detect()` on every scenario family x seed, and `replay`, the
findings the collector stores after `trainvitals replay` of a small-layout scenario into SQLite
(ingest, reduction, detector inputs and findings storage all on the path). Compare two dumps with
`diff` or json: equal files mean equal findings.

To dump an older commit with the installed environment: check it out in a git worktree, make a
folder `NS/trainvitals/` of symlinks to its agent, service, wire, migrations, examples (and
testing) folders, and run this script with TV_NS=NS: the editable install's import hook is then
bypassed and `trainvitals` comes from NS.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

if os.environ.get("TV_NS"):
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in (type(f).__module__ + type(f).__name__).lower()]
    sys.path.insert(0, os.environ["TV_NS"])

try:
    from trainvitals.testing.scenarios import FAULT_FAMILIES, HEALTHY_FAMILIES, Layout, make_scenario, to_wire_lines
except ImportError:  # commits before the scenarios moved to trainvitals.testing
    from trainvitals.service.detectors.scenarios import (  # type: ignore[no-redef]
        FAULT_FAMILIES,
        HEALTHY_FAMILIES,
        Layout,
        make_scenario,
        to_wire_lines,
    )
try:
    from trainvitals.service.ingest.replay import replay_files
except ImportError:  # commits before the collector was split into ingest/ and analysis/
    from trainvitals.service.replay import replay_files  # type: ignore[no-redef]
from trainvitals.service.detectors import DetectorConfig, detect
from trainvitals.service.store import db, queries


def pure(seeds: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    cfg = DetectorConfig()
    for fam in FAULT_FAMILIES + HEALTHY_FAMILIES:
        for seed in range(seeds):
            found = detect(make_scenario(fam, seed).series, config=cfg)
            out[f"{fam}/{seed}"] = sorted(
                repr((f.kind, f.severity, f.subject, f.onset_step, f.last_step, f.detected_step,
                      None if f.magnitude is None else round(f.magnitude, 9), f.summary))
                for f in found
            )
    return out


def replayed() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for fam in FAULT_FAMILIES + HEALTHY_FAMILIES[:2]:
        for seed in range(2):
            sc = make_scenario(fam, seed, layout=Layout(pp=2, dp=1, ranks_per_node=2, layers=3))
            work = tempfile.mkdtemp(prefix="tv_findings_")
            path = os.path.join(work, "run.jsonl")
            with open(path, "w") as fh:
                fh.writelines(line if line.endswith("\n") else line + "\n" for line in to_wire_lines(sc))
            url = f"sqlite:///{work}/t.db"
            db.upgrade(url)
            engine = db.make_engine(url)
            with db.make_sessionmaker(engine)() as session:
                # The key the replay stored: a scenario's registration names its project (`<project>/<run>`
                # since revision 0016); by the bare run id this read nothing and every list was empty.
                (key,) = replay_files(session, [path]).runs
                rows: list[dict[str, Any]] = queries.findings(session, run_id=key)
                out[f"{fam}/{seed}"] = sorted(
                    repr((r["kind"], r["severity"], r["subject"], r["onset_step"], r["last_step"],
                          r.get("magnitude"), r.get("summary")))
                    for r in rows
                )
            engine.dispose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out")
    parser.add_argument("--seeds", type=int, default=10)
    args = parser.parse_args()
    dump = {"pure": pure(args.seeds), "replay": replayed()}
    with open(args.out, "w") as fh:
        json.dump(dump, fh, indent=1, sort_keys=True)
    print(f"pure: {sum(map(len, dump['pure'].values()))} findings over {len(dump['pure'])} runs; "
          f"replay: {sum(map(len, dump['replay'].values()))} over {len(dump['replay'])} runs")


if __name__ == "__main__":
    main()
