"""Per-GPU memory by tenant: parameters, gradients, optimizer state, activations, overhead.

Byte rules (seed 001, "the memory wall"): bf16 working weights 2 B/param, bf16 gradients 2 B/param,
AdamW fp32 master + two moments 12 B/param (16 B/param in all); activations 12 * L * B * S * d * b_a
bytes with selective recomputation. Overhead (CUDA context, NCCL buffers, allocator fragmentation)
is budgeted as a fixed share of HBM: seed 001 says plan for 75% of HBM, not 100%.

Parallel layout rules (Megatron/ZeRO conventions; docs/advisors.md has the derivation):
- TP and PP split weights; ZeRO stage z shards optimizer (z>=1), gradients (z>=2) and parameters
  (z=3) across the data- and context-parallel ranks (dp*cp). With dp*cp = 1 there is nothing to
  shard over and every stage counts as ZeRO-0.
- At ZeRO-3/FSDP the weights in use are gathered in bf16 on top of the shard. Seed 000 counts the
  whole model's ("plus ~14 GB of bf16 weights gathered during compute" for 7B): that is FSDP that
  never reshards after forward, an upper bound. We model FSDP's default instead (one unit per block,
  reshard after forward, the next block prefetched): two blocks' weights (their TP share) plus the
  root unit, embedding and output head, which stays gathered. With pp > 1 the stage stays gathered
  across micro-batches (torchtitan's default under PP, and Llama 3's), the cost model charges one
  gather per step for it, and we count the whole stage.
- Activations are split by TP (sequence parallelism) and CP; 1F1B keeps min(m, pp) micro-batches in
  flight on the first stage, so PP does not shrink activation memory there (Korthikanti et al. 2022).
  Attention is fused (FlashAttention/SDPA) unless the config says `attention: eager`: only eager
  attention stores the s^2 score tensors.

    >>> case_a = training_step_bytes(n_params=7e9, layers=32, hidden=4096, batch=1, seq=4096)
    >>> round(case_a.total / 1e9, 1)
    124.9
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainvitals.service.advisors.model_config import PlanInput

ACTIVATION_K = 12
"""Per-block activation multiplier under selective recomputation (seed 001)."""
BYTES_PARAM, BYTES_GRAD, BYTES_OPTIM, BYTES_ACT = 2, 2, 12, 2


@dataclass(kw_only=True, slots=True, frozen=True)
class MemoryBreakdown:
    """Bytes per GPU by tenant."""

    params: float
    """Working weights (and, at ZeRO-3, the gathered copy), bytes."""
    grads: float
    """Gradients, bytes."""
    optimizer: float
    """Optimizer state (fp32 master + Adam moments), bytes."""
    activations: float
    """Activations kept for backward (plus fp32 logits), bytes."""
    overhead: float
    """Reserve for CUDA context, NCCL buffers, fragmentation, bytes (0 for the single-GPU bill)."""
    capacity: float
    """HBM per GPU, bytes (0 when not tied to a GPU)."""

    @property
    def tenants(self) -> float:
        """The four tenants without the overhead reserve."""
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def total(self) -> float:
        return self.tenants + self.overhead

    @property
    def fits(self) -> bool:
        return self.capacity > 0 and self.total <= self.capacity

    def as_dict(self) -> dict[str, float | bool]:
        gib = 1024**3
        return {
            "params_gib": self.params / gib,
            "grads_gib": self.grads / gib,
            "optimizer_gib": self.optimizer / gib,
            "activations_gib": self.activations / gib,
            "overhead_gib": self.overhead / gib,
            "total_gib": self.total / gib,
            "capacity_gib": self.capacity / gib,
            "fits": self.fits,
        }


def training_step_bytes(
    *,
    n_params: float,
    layers: int,
    hidden: int,
    batch: int,
    seq: int,
    param_bytes: float = BYTES_PARAM,
    grad_bytes: float = BYTES_GRAD,
    optim_bytes: float = BYTES_OPTIM,
    act_bytes: float = BYTES_ACT,
    k: float = ACTIVATION_K,
) -> MemoryBreakdown:
    """Seed 001's single-GPU bill: N(b_p + b_g + b_o) + k L B S d b_a, no overhead."""
    return MemoryBreakdown(
        params=n_params * param_bytes,
        grads=n_params * grad_bytes,
        optimizer=n_params * optim_bytes,
        activations=k * layers * batch * seq * hidden * act_bytes,
        overhead=0.0,
        capacity=0.0,
    )


def min_gpus_to_hold(total_bytes: float, gpu_bytes: float) -> int:
    """Perfect-slicing floor: ceil(total / per-GPU memory) (seed 001's `-(-total // H100)`)."""
    return max(1, math.ceil(total_bytes / gpu_bytes - 1e-12))


def _selective_bytes_per_layer(plan: PlanInput) -> float:
    m, p = plan.model, plan.parallelism
    selective = ACTIVATION_K * BYTES_ACT * p.micro_batch * m.seq_len * m.hidden / (p.tp * p.cp)
    if p.tp > 1 and not p.sequence_parallel:
        # Without SP the norm/dropout inputs (10 of Korthikanti's 34 sbh) are whole on every TP rank.
        selective *= 24 / 34 + 10 / 34 * p.tp
    return selective


def activation_bytes_per_layer(plan: PlanInput) -> float:
    """Activation bytes one layer keeps for one micro-batch on one GPU."""
    m, p = plan.model, plan.parallelism
    b, s, h = p.micro_batch, m.seq_len, m.hidden
    if p.recompute == "full":
        # Full recompute keeps only each layer's bf16 input: split along the sequence by SP, whole on
        # every TP rank without it.
        return BYTES_ACT * b * s * h / (p.cp * (p.tp if p.sequence_parallel else 1))
    selective = _selective_bytes_per_layer(plan)
    if p.recompute == "none" and p.attention == "eager":
        # The attention score/softmax/dropout tensors selective recompute drops: 5 a s^2 b bytes.
        # Fused kernels never store them, so without recompute they keep what selective keeps.
        return selective + 5 * m.heads * s * s * b / (p.tp * p.cp * p.cp)
    return selective


def gathered_params(plan: PlanInput) -> float:
    """Parameters ZeRO-3/FSDP holds gathered on one GPU besides its shard (see the module docstring)."""
    m, p = plan.model, plan.parallelism
    if p.pp > 1:
        return plan.stage_params
    expert_block = m.expert_params / m.layers
    block = (m.block_params - expert_block) / p.tp + expert_block / (p.tp * p.ep)
    root = (m.params_total - m.layers * m.block_params) / p.tp
    return min(plan.stage_params, 2 * block + root)


def per_gpu_memory(plan: PlanInput) -> MemoryBreakdown:
    """Peak memory on the most loaded GPU (first pipeline stage) for a parallel layout."""
    m, p, hw = plan.model, plan.parallelism, plan.hardware
    stage_params = plan.stage_params  # the fullest stage when stages are uneven
    sharded = m.params_total / p.gpus  # ZeRO shards over dp*cp; ep only regroups experts
    zero = p.zero if p.dp * p.cp > 1 else 0  # a shard group of one shards nothing
    params = BYTES_PARAM * (sharded + gathered_params(plan) if zero >= 3 else stage_params)
    grads = BYTES_GRAD * (sharded if zero >= 2 else stage_params)
    optimizer = BYTES_OPTIM * (sharded if zero >= 1 else stage_params)

    layers_per_stage = plan.stage_layers
    in_flight: float = min(p.micro_batches, p.pp)
    if p.vpp > 1 and p.pp > 1:
        in_flight *= 1 + (p.pp - 1) / (p.pp * p.vpp)  # interleaving keeps extra warm-up chunks
    acts = activation_bytes_per_layer(plan) * layers_per_stage * in_flight
    if p.recompute == "full":
        # During backward one layer is recomputed and its selective-level set is live.
        acts += _selective_bytes_per_layer(plan)
    # fp32 logits of one micro-batch for the loss (vocab split by TP), on the last stage.
    acts += 4 * p.micro_batch * m.seq_len * m.vocab / (p.tp * p.cp)
    capacity = hw.gpu.hbm_bytes
    return MemoryBreakdown(
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=acts,
        overhead=capacity * (1 - hw.usable_hbm_fraction),
        capacity=capacity,
    )
