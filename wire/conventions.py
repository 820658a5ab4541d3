"""Names and numbers the agent and the collector must agree on, written once.

The wire models (wire/v1.py) take their Literal types from here, the agent its FP8 maxima and
group names, the collector its layer labels: a change here is a change of the wire contract.
"""

from __future__ import annotations

import re
from typing import Final, Literal, get_args

WIRE_VERSION: Final = 1
"""Bumped on any incompatible change of the messages in wire/v1.py."""

GLOBAL_GROUP: Final = "__global__"
"""The gradient-norm group that carries the whole model's sums of squares."""

Role = Literal["input", "weight", "grad_output"]
ROLES: tuple[Role, ...] = get_args(Role)
"""The three tensors an FP8 GEMM casts, in the order the agent and the tables use."""

Fp8Format = Literal["e4m3", "e5m2"]
FP8_FORMATS: tuple[Fp8Format, ...] = get_args(Fp8Format)
FP8_MAX: Final[dict[str, float]] = {"e4m3": 448.0, "e5m2": 57344.0}
"""Largest finite magnitude of each format (OCP FP8: E4M3 'fn' variant, IEEE-like E5M2)."""
DEFAULT_FORMATS: Final[dict[str, Fp8Format]] = {"input": "e4m3", "weight": "e4m3", "grad_output": "e5m2"}
"""The usual hybrid recipe: E4M3 forward, E5M2 for gradients."""

FLOPS_CONVENTION: Final = (
    "6N+12LHQT per token (PaLM app. B), N non-embedding, causal not halved, no recompute;"
    " frozen params: no weight grads"
)
"""How the agent counts a step's model FLOPs (agent/_position.py), and the convention the collector
restates the cost model's MFU prediction in before comparing (service/analysis/expectations.py).
N non-embedding: every parameter that does a matmul per token, so all but the input embedding
table, with an output head counted (tied or not: its matmul runs every token); MoE: the active
experts' only (the parameters a token passes through)."""

DEFAULT_PROJECT: Final = "default"
"""The project of a registration that names none (and of every run when the collector runs without
auth); its runs are stored under their bare run id (service/store/run_keys.py)."""

DEFAULT_SEND_INTERVAL_S: Final = 2.0
"""The automatic send interval of a job of up to JOB_BATCHES_PER_S * DEFAULT_SEND_INTERVAL_S ranks."""
JOB_BATCHES_PER_S: Final = 512
"""What the automatic send interval holds a whole job to: about this many batches per second.
A collector's cost is per request (about 1 ms of CPU each, docs/performance.md "Scale-out"), so a
fixed per-rank interval would make the load grow with the job without bound (8,192 requests/s at
16,384 ranks every 2 s). Above 1,024 ranks every rank waits world_size / 512 s instead (32 s at
16,384): Prometheus scrapes every 15-30 s anyway, so that delivery delay costs little."""


def auto_send_interval_s(world_size: int) -> float:
    """2 s up to 1,024 ranks, world_size / 512 s above: the job sends about 512 batches/s at most
    (JOB_BATCHES_PER_S says why). The agent's default (AgentConfig.send_interval_s None);
    the collector waits at least this long for a rank's step before reducing it without that rank."""
    return max(DEFAULT_SEND_INTERVAL_S, world_size / JOB_BATCHES_PER_S)


DEFAULT_DETECTOR_WARMUP_STEPS: Final = 300
"""Steps from a run's first step during which the baseline detectors stay quiet (LR warm-up, early
loss drop), unless the run registers its own `detector_warmup_steps` or the collector is set
otherwise (TRAINVITALS_DETECTOR_WARMUP_STEPS)."""

CheckpointStatus = Literal["started", "persisted", "failed", "verified", "deleted"]
EventKind = Literal[
    "start", "restart", "resume", "failure", "node_replaced", "phase_change", "rollback", "stop", "note", "dropped"
]
"""'dropped': the agent's count of records it lost, by reason (docs/agent.md, "Nothing is lost silently")."""
DROP_REASONS = ("queue_full", "spool_full", "spool_error", "quarantine_full", "quarantine_error", "exit_timeout")
"""The keys of a 'dropped' event's domains (each a cumulative count, per rank incarnation, as a decimal
string); the collector exports these and sums any other key under 'other'."""
Recompute = Literal["none", "selective", "full"]
AmaxAlgo = Literal["max", "most_recent"]

# Prefixes that wrappers (DDP, torch.compile, FSDP1, activation checkpointing, Lightning) add to
# the model's own parameter and module names; a layer label must not depend on them.
_WRAPPER_PARTS: Final = frozenset(
    {"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module"}
)
_PARAM_SUFFIX = re.compile(r"\.(weight|bias)$")


def clean_name(name: str) -> str:
    """'module._orig_mod.layers.3.fc' -> 'layers.3.fc': the model's own dotted name."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


def layer_of(name: str) -> str:
    """The layer a parameter or module belongs to, the label of every per-layer series.

    'layers.3.attn.q.weight' -> 'layers.3' (up to the first numbered part, so bounded by depth);
    'lm_head.proj' -> 'lm_head'; 'tok_emb.weight' -> 'tok_emb'.
    """
    parts = clean_name(name).split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if len(parts) > 1 else _PARAM_SUFFIX.sub("", parts[0])
