"""A benchmark run's machine and headline numbers, as JSON beside its printed report.

Each script that issue 17 measures takes `--json PATH` and writes its headline numbers there with
`write_results`; `issue17_pass.py` runs them all and reads those files. The machine is part of every
number (the same code's have moved 1.8x between days on one host kind, more between kinds), so a
file names the CPU by family and model (`/proc/cpuinfo`; a KVM guest's model name is often only
"Intel(R) Xeon(R) Processor", which names no generation), its vector extensions, the cores and the
load.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

from trainvitals.service.json_output import to_json

# Vector and matrix extensions the FP8 tiers' cost follows (docs/performance-agent.md), in the order printed.
_EXTENSIONS = (("avx512f", "AVX512"), ("amx_tile", "AMX"), ("avx2", "AVX2"))


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    return fields


def machine() -> dict[str, Any]:
    """What the numbers depend on besides the code."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    extensions = [name for flag, name in _EXTENSIONS if flag in flags]
    if "AVX512" in extensions and "AVX2" in extensions:
        extensions.remove("AVX2")  # implied
    return {
        "cpu": info.get("model name", "unknown CPU"),
        "family": _int_or_none(info.get("cpu family")),
        "model": _int_or_none(info.get("model")),
        "stepping": _int_or_none(info.get("stepping")),
        "extensions": extensions,
        "hypervisor": "hypervisor" in flags,
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cores_online": os.cpu_count(),
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "commit": _commit(),
    }


def cpu_description(m: dict[str, Any]) -> str:
    """'Intel(R) Xeon(R) Processor (family 6 model 167 stepping 1, AVX512, AMX, VM)'."""
    parts = [f"family {m['family']} model {m['model']} stepping {m['stepping']}", *m["extensions"]]
    if m["hypervisor"]:
        parts.append("VM")
    return f"{m['cpu']} ({', '.join(parts)})"


def describe(m: dict[str, Any]) -> str:
    """The CPU and its usable cores, in one line."""
    return f"{cpu_description(m)}, {m['cores_usable']} cores"


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def _commit() -> str | None:
    """The checkout's commit, with '+changes' when its tracked files differ from it (None outside git)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if dirty else "")


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="also write the headline numbers and the machine to PATH")


def write_results(path: str | None, *, benchmark: str, command: list[str], results: dict[str, Any]) -> None:
    """Write {benchmark, command, finished, machine, results} to path (nothing when path is None)."""
    if path is None:
        return
    payload = {
        "benchmark": benchmark,
        "command": command,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "results": results,
    }
    Path(path).write_text(to_json(payload) + "\n")  # strict JSON: a NaN or infinity as null
