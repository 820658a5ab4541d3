"""Where this process sits in the job, read without collectives."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    world_size: int
    hostname: str
    restart_count: int


def rank_info() -> RankInfo:
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return RankInfo(
        rank=rank,
        world_size=world,
        hostname=socket.gethostname(),
        restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
    )


def default_run_id() -> str:
    """A run id every rank derives identically: $TRAINVITALS_RUN, torchrun's rdzv id, or the master."""
    explicit = os.environ.get("TRAINVITALS_RUN")
    if explicit:
        return explicit
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID")
    if rdzv and rdzv != "none":
        return rdzv
    master = f"{os.environ.get('MASTER_ADDR', socket.gethostname())}-{os.environ.get('MASTER_PORT', '0')}"
    return "run-" + master.replace(":", "-")
