"""Where this process sits in the job, read without collectives."""

from __future__ import annotations

import os
import re
import socket
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch.distributed as dist

RankSource = Literal["process group", "environment", "assumed"]
"""Where a rank came from: init_process_group, torchrun's RANK, or nowhere (0 of 1 taken)."""


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    world_size: int
    hostname: str
    restart_count: int
    source: RankSource = "assumed"


def process_group_exists() -> bool:
    """init_process_group has run (a local read: no collective)."""
    return dist.is_available() and dist.is_initialized()


def rank_info() -> RankInfo:
    source: RankSource
    if process_group_exists():
        rank, world, source = dist.get_rank(), dist.get_world_size(), "process group"
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        source = "environment" if "RANK" in os.environ else "assumed"
    return RankInfo(
        rank=rank,
        world_size=world,
        hostname=socket.gethostname(),
        restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        source=source,
    )


@dataclass(frozen=True, slots=True)
class RunId:
    value: str
    derived: str | None
    """Where an id nobody named came from and who else gets it (the attach line); None: named."""


def default_run_id(world_size: int) -> RunId:
    """The run id of a job that names none, one every rank derives identically and without a
    collective: $TRAINVITALS_RUN, torchrun's rendezvous id, the Slurm job's id, or the master."""
    explicit = os.environ.get("TRAINVITALS_RUN")
    if explicit:
        return RunId(explicit, None)
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID")
    if rdzv and rdzv != "none":
        # --rdzv-id names the job; without it a one-node torchrun (--standalone or not) draws a uuid4
        # per launch, which nobody knows to look for.
        drawn = "torchrun's rendezvous id, drawn afresh for each launch"
        return RunId(rdzv, drawn if _is_uuid(rdzv) else None)
    slurm = os.environ.get("SLURM_JOB_ID")
    if slurm:
        # Every rank of the job sees it and a requeue keeps it; the master's address and port are
        # shared by every job whose first node and port are the same (a sweep's jobs).
        return RunId(f"slurm-{slurm}", "from $SLURM_JOB_ID (a requeue of the job continues it)")
    after = "(the next one continues its history, or is refused where its model's dims differ)"
    if world_size > 1 or "MASTER_PORT" in os.environ:
        master = f"{os.environ.get('MASTER_ADDR', socket.gethostname())}-{os.environ.get('MASTER_PORT', '0')}"
        return RunId(
            "run-" + master.replace(":", "-"),
            f"from MASTER_ADDR-MASTER_PORT, which every job launched on that address and port shares {after}",
        )
    # One process: nothing to agree on but the script, so two scripts tried one after the other on a
    # host (a newcomer's first runs) are two runs, not one whose history the second overwrote.
    name = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-") else ""  # no script: python -c, stdin
    script = _SAFE.sub("-", Path(name).stem)[:64] if name else ""
    who = "every run of this script" if script else "every process without a script (python -c, stdin)"
    return RunId(
        f"run-{socket.gethostname()}-{script or '0'}", f"which {who} on this host that names no run shares {after}"
    )


_SAFE = re.compile(r"[^A-Za-z0-9._:-]")


def _is_uuid(text: str) -> bool:
    try:
        return str(uuid.UUID(text)) == text
    except ValueError:
        return False
