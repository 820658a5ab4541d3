"""Where a rank sits in the parallelism layout (its straggler cohort), and FLOPs per token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainvitals.wire.conventions import FLOPS_CONVENTION

__all__ = ["FLOPS_CONVENTION", "Position", "flops_per_token", "model_parallel_share", "position_of"]


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


def model_parallel_share(parallelism: dict[str, Any]) -> float:
    """The share of a batch's model FLOPs one rank does: 1 / (tp x pp). Every rank of a
    tensor-parallel group and every pipeline stage sees the same tokens, and each does its part of
    the model's work on them; the collector sums the ranks' FLOPs (the wire's "of this rank"), so a
    rank reporting the whole model's would count the batch tp x pp times (MFU tp x pp too high)."""
    return 1.0 / (int(parallelism.get("tp") or 1) * int(parallelism.get("pp") or 1))


def flops_per_token(
    model: dict[str, Any], *, trained: float = 1.0, reach: float = 1.0, share: float = 1.0
) -> float | None:
    """PaLM appendix B, 6N + 12 L H Q T (H*Q = the attention core's width: attention_core_width where
    the model gives it (MLA), else heads x head_dim where it gives head_dim, else hidden), with
    backward's parts apart so that frozen parameters count what they cost: forward 2N + 4LHQT;
    backward's activation gradients 2N + 8LHQT over the share `reach` it passes through, and its
    weight gradients 2N over the `trained` share (agent/_model_facts.py, BackwardShares). Full
    training (1, 1) is 6N + 12LHQT; a LoRA job's ~4N, which 6N read as 1.5x the work done. `share`:
    this rank's part of it (model_parallel_share)."""
    n = model.get("non_embedding_params")
    layers, hidden, seq = model.get("layers"), model.get("hidden"), model.get("seq_len")
    if not (n and layers and hidden and seq):
        return None
    heads, head_dim = model.get("heads"), model.get("head_dim")
    width = model.get("attention_core_width") or (heads * head_dim if heads and head_dim else hidden)
    attention = layers * width * seq
    return ((2.0 + 2.0 * reach + 2.0 * trained) * n + (4.0 + 8.0 * reach) * attention) * share
