"""Where a rank sits in the parallelism layout (its straggler cohort), and FLOPs per token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FLOPS_CONVENTION = (
    "6N+12LHQT per token (PaLM app. B): N non-embedding params, causal attention not halved,"
    " recompute excluded"
)


@dataclass(frozen=True, slots=True)
class Position:
    pp_stage: int | None = None
    tp_rank: int | None = None
    dp_rank: int | None = None


def position_of(rank: int, parallelism: dict[str, Any]) -> Position:
    """Megatron's default rank order (tp fastest, then cp, dp, pp): the layout torchrun + Megatron,
    NeMo and torchtitan's default device mesh ("pp", "dp", "cp", "tp") produce."""
    world = int(parallelism.get("world_size") or 1)
    tp = int(parallelism.get("tp") or 1)
    cp = int(parallelism.get("cp") or 1)
    pp = int(parallelism.get("pp") or 1)
    dp = int(parallelism.get("dp") or max(1, world // (tp * cp * pp)))
    if tp * cp * dp * pp != world:
        return Position()  # inconsistent or partial config: do not guess a cohort
    return Position(pp_stage=rank // (tp * cp * dp), tp_rank=rank % tp, dp_rank=(rank // (tp * cp)) % dp)


def flops_per_token(model: dict[str, Any]) -> float | None:
    """PaLM appendix B: 6N + 12 L H Q T, with H*Q = the attention width (= hidden)."""
    n = model.get("non_embedding_params")
    layers, hidden, seq = model.get("layers"), model.get("hidden"), model.get("seq_len")
    if not (n and layers and hidden and seq):
        return None
    return 6.0 * n + 12.0 * layers * hidden * seq
