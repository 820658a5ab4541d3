"""The planner's input: model shape, parallelism and hardware, parsed and validated from a dict.

The dict is what `trainvitals plan --config FILE` loads from JSON/YAML, and also the `model`,
`parallelism` and `hardware` sections of a run registration (wire format v1). Every error is a
ValueError that names the offending key, e.g. "parallelism.tp: 3 does not divide model.heads=32".

    >>> plan_input = parse_plan_input({
    ...     "model": {"layers": 32, "hidden": 4096, "heads": 32, "vocab": 32000, "seq_len": 4096},
    ...     "parallelism": {"gpus": 8},
    ...     "hardware": {"gpu": "H100-SXM"},
    ... })
    >>> plan_input.parallelism.dp
    8
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainvitals.service.advisors.hardware import GpuSpec, gpu_spec

RECOMPUTE_MODES = ("none", "selective", "full")
ATTENTION_KERNELS = ("fused", "eager")
FRAMEWORKS = ("megatron", "fsdp")
PARAMS_OVERRIDE_LIMIT = 10.0
"""An explicit `model.params` more than this factor off the architecture's count is refused."""

# Registration payloads written by other tools use other names for the same fields (alias: key).
MODEL_ALIASES = {
    "num_layers": "layers",
    "n_layers": "layers",
    "hidden_size": "hidden",
    "dim": "hidden",
    "num_heads": "heads",
    "n_heads": "heads",
    "num_kv_heads": "kv_heads",
    "n_kv_heads": "kv_heads",
    "ffn_hidden_size": "ffn_hidden",
    "ffn_dim": "ffn_hidden",
    "vocab_size": "vocab",
    "seq_length": "seq_len",
    "num_experts": "experts",
    "top_k": "active_experts",
    "shared_expert_intermediate_size": "shared_ffn_hidden",
}
PARALLELISM_ALIASES = {
    "world_size": "gpus",
    "zero_stage": "zero",
    "micro_batch_size": "micro_batch",
    "global_batch_size": "global_batch",
    "virtual_stages": "vpp",
}
HARDWARE_ALIASES = {"gpu_type": "gpu", "count": "gpus", "peak_tflops_per_gpu": "peak_tflops"}

# The keys each section takes (after aliases); anything else is an error in strict parsing.
MODEL_KEYS = frozenset({
    "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "gated_mlp", "vocab", "seq_len", "params", "experts",
    "active_experts", "shared_ffn_hidden", "tied_embeddings", "head_dim", "attention_core_width",
})
PARALLELISM_KEYS = frozenset({
    "gpus", "tp", "pp", "dp", "cp", "ep", "vpp", "zero", "micro_batch", "global_batch", "recompute",
    "uneven_stages", "sequence_parallel", "overlap_dp_comm", "framework", "attention",
})
HARDWARE_KEYS = frozenset({
    "gpu", "gpus", "gpus_per_node", "peak_tflops", "peak_fp8_tflops", "hbm_gib", "intra_node_gbps",
    "inter_node_gbps", "precision", "usable_hbm_fraction", "peak_flops",
})


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    """A decoder-only transformer (Llama-style: RMSNorm, RoPE, optional GQA, optional gated MLP)."""

    layers: int
    """Transformer blocks."""
    hidden: int
    """Model width d."""
    heads: int
    """Attention (query) heads."""
    kv_heads: int
    """Key/value heads (GQA); equal to heads for multi-head attention."""
    ffn_hidden: int
    """MLP inner width (per expert for MoE)."""
    gated_mlp: bool
    """SwiGLU-style MLP with three matrices instead of two."""
    vocab: int
    """Vocabulary size."""
    seq_len: int
    """Training sequence length, tokens."""
    params_override: float | None = None
    """Total parameter count when given explicitly; architecture counts are scaled to it."""
    experts: int = 1
    """MLP experts per layer (1 = dense)."""
    active_experts: int = 1
    """Experts each token is routed to (top-k)."""
    shared_ffn_hidden: int = 0
    """MLP width every token passes through besides its routed experts (an MoE's shared experts
    together; DeepSeek and Qwen2-MoE have them): active, and replicated like attention, not sharded
    by expert parallelism."""
    tied_embeddings: bool = False
    """Input embedding and output head share one matrix."""
    attention_head_dim: int = 0
    """Width of one attention head where the model says so apart from hidden / heads (Qwen3, Gemma:
    heads x head_dim wider than hidden), in the attention core's FLOPs (12LHQT's Q) and the q/k/v/o
    projections' parameters; 0: hidden / heads."""
    attention_core_width: int = 0
    """The attention core's width (12LHQT's H x Q) where its heads are not as wide as its q/k/v/o
    projections (DeepSeek's MLA: heads x (query-key + value head width) / 2, against low-rank
    projections counted hidden wide); 0: heads x head_dim."""

    def __post_init__(self) -> None:
        if not self.attention_head_dim and self.hidden % self.heads:
            raise ValueError(f"model.hidden: {self.hidden} is not divisible by model.heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model.kv_heads: {self.kv_heads} does not divide model.heads={self.heads}")
        if self.active_experts > self.experts:
            raise ValueError(
                f"model.active_experts: {self.active_experts} exceeds model.experts={self.experts}"
            )
        if self.params_override is not None:
            ratio = self._scale
            counted = self.params_override / ratio
            if not 1 / PARAMS_OVERRIDE_LIMIT <= ratio <= PARAMS_OVERRIDE_LIMIT:
                off = f"{ratio:,.0f}x" if ratio > 1 else f"1/{1 / ratio:,.0f} of"
                raise ValueError(
                    f"model.params: {self.params_override:.3g} is {off} the {counted:.3g} parameters "
                    "the shape (layers, hidden, ffn_hidden, vocab, experts) gives; fix one or drop model.params"
                )

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden // self.heads

    @property
    def attention_width(self) -> int:
        """The H*Q of 12LHQT, the attention core's FLOPs per token and layer over 12 S: the core's own
        width where the model gives it (MLA), else heads x head_dim (= hidden unless head_dim says
        otherwise)."""
        return self.attention_core_width or self.heads * self.head_dim

    @property
    def attention_params_per_layer(self) -> int:
        q_and_o = 2 * self.hidden * self.heads * self.head_dim
        k_and_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_and_o + k_and_v

    def allows_tp(self, tp: int) -> bool:
        """TP splits the query heads evenly, and the KV heads too or replicates each KV head on
        tp/kv_heads ranks (GQA; the cost model's ring traffic assumes the same)."""
        return self.heads % tp == 0 and (self.kv_heads % tp == 0 or tp % self.kv_heads == 0)

    @property
    def mlp_params_per_expert(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden * self.ffn_hidden

    @property
    def shared_mlp_params(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden * self.shared_ffn_hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def _scale(self) -> float:
        # An explicit params count rescales every architecture-derived count proportionally.
        counted = self.layers * self._block_counted + self.embedding_params
        return 1.0 if self.params_override is None else self.params_override / counted

    @property
    def _block_counted(self) -> int:
        """One transformer block's parameters as the architecture counts them, all its experts included."""
        return self.attention_params_per_layer + self.experts * self.mlp_params_per_expert + self.shared_mlp_params

    @property
    def block_params(self) -> float:
        """Parameters of one transformer block, all its experts included (scaled like params_total)."""
        return self._scale * self._block_counted

    @property
    def expert_params(self) -> float:
        """Parameters that expert parallelism shards (all routed experts' MLPs, not the shared ones);
        0 for a dense model."""
        if self.experts == 1:
            return 0.0
        return self._scale * self.layers * self.experts * self.mlp_params_per_expert

    @property
    def params_total(self) -> float:
        """All parameters, embeddings included (what memory holds)."""
        return self._scale * (self.layers * self._block_counted + self.embedding_params)

    @property
    def params_active(self) -> float:
        """Parameters one token touches (top-k experts only): what 6N counts."""
        per_layer = self.attention_params_per_layer + self.active_experts * self.mlp_params_per_expert
        return self._scale * (self.layers * (per_layer + self.shared_mlp_params) + self.embedding_params)


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelismConfig:
    """How the job is laid out; gpus = tp * cp * pp * dp, and ep is carved out of dp."""

    gpus: int
    """World size."""
    tp: int = 1
    """Tensor-parallel degree (with sequence parallelism for activations)."""
    pp: int = 1
    """Pipeline stages."""
    dp: int = 1
    """Data-parallel degree (derived when not given)."""
    cp: int = 1
    """Context-parallel degree (sequence split across ranks)."""
    ep: int = 1
    """Expert-parallel degree; must divide dp."""
    vpp: int = 1
    """Virtual pipeline stages per rank (interleaved 1F1B)."""
    zero: int = 3
    """ZeRO stage: 0 replicated, 1 optimizer sharded, 2 + gradients, 3 (= FSDP) + parameters."""
    micro_batch: int = 1
    """Sequences per micro-batch per data-parallel rank."""
    global_batch: int = 1
    """Sequences per optimizer step across the job."""
    recompute: str = "selective"
    """Activation recomputation: "none", "selective" or "full"."""
    uneven_stages: bool = False
    """Pipeline stages may hold different layer counts (the stage with the most sets the pace)."""
    sequence_parallel: bool = True
    """With tp > 1, activations outside the TP regions are split along the sequence (Megatron SP);
    TP collectives become all-gather/reduce-scatter of the same volume."""
    overlap_dp_comm: bool = True
    """Data-parallel/ZeRO collectives overlap backward (grad reduce) and forward (param gather);
    False: all of that traffic is on the critical path."""
    framework: str = "megatron"
    """Kernel/runtime stack, which sets the achieved GEMM efficiency: "megatron" (Megatron-LM, NeMo
    and similar 3D-parallel stacks with fused kernels) or "fsdp" (PyTorch FSDP/FSDP2 with DTensor
    TP: torchtitan, llm-foundry, KempnerForge)."""
    attention: str = "fused"
    """Attention kernel: "fused" (FlashAttention/SDPA: no s^2 score tensors are stored) or "eager"
    (scores, softmax and dropout mask materialised, 5 a s^2 b bytes per layer kept without recompute)."""

    def __post_init__(self) -> None:
        if self.tp * self.cp * self.pp * self.dp != self.gpus:
            raise ValueError(
                f"parallelism.gpus: {self.gpus} != tp*cp*pp*dp = {self.tp}*{self.cp}*{self.pp}*{self.dp}"
            )
        if self.dp % self.ep:
            raise ValueError(f"parallelism.ep: {self.ep} does not divide parallelism.dp={self.dp}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"parallelism.zero: must be 0-3 or 'fsdp', got {self.zero!r}")
        if self.framework not in FRAMEWORKS:
            raise ValueError(f"parallelism.framework: must be one of {FRAMEWORKS}, got {self.framework!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(
                f"parallelism.recompute: must be one of {RECOMPUTE_MODES}, got {self.recompute!r}"
            )
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(
                f"parallelism.attention: must be one of {ATTENTION_KERNELS}, got {self.attention!r}"
            )
        if self.global_batch % (self.micro_batch * self.dp):
            raise ValueError(
                f"parallelism.global_batch: {self.global_batch} is not a multiple of "
                f"micro_batch*dp = {self.micro_batch}*{self.dp}"
            )

    @property
    def micro_batches(self) -> int:
        """Micro-batches each pipeline runs per optimizer step (m)."""
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def zero_name(self) -> str:
        return {0: "ZeRO-0 (DDP)", 1: "ZeRO-1 (distributed optimizer)", 2: "ZeRO-2", 3: "ZeRO-3/FSDP"}[self.zero]


@dataclass(kw_only=True, slots=True, frozen=True)
class HardwareConfig:
    """The GPUs and how they are grouped into nodes."""

    gpu: GpuSpec
    """Resolved GPU spec (table entry with any explicit overrides applied)."""
    gpus_per_node: int
    """GPUs per NVLink domain."""
    precision: str = "bf16"
    """Matmul precision whose peak is the MFU denominator: "bf16" or "fp8"."""
    usable_hbm_fraction: float = 0.75
    """Share of HBM the four tenants may use; seed 001 budgets 75% (CUDA context, NCCL, fragmentation)."""

    def __post_init__(self) -> None:
        if self.precision not in ("bf16", "fp8"):
            raise ValueError(f"hardware.precision: must be 'bf16' or 'fp8', got {self.precision!r}")
        if self.precision == "fp8" and self.gpu.peak_fp8_tflops is None:
            raise ValueError(
                f"hardware.precision: fp8 on {self.gpu.name}, which has no FP8 tensor cores; "
                "use precision: bf16 (or give hardware.peak_fp8_tflops)"
            )
        if not 0 < self.usable_hbm_fraction <= 1:
            raise ValueError(
                f"hardware.usable_hbm_fraction: must be in (0, 1], got {self.usable_hbm_fraction!r}"
            )

    @property
    def peak_flops(self) -> float:
        """Peak FLOP/s per GPU for the configured precision."""
        return self.gpu.peak_tflops(self.precision) * 1e12


@dataclass(kw_only=True, slots=True, frozen=True)
class PlanInput:
    """Everything `plan` needs."""

    model: ModelConfig
    """Model shape."""
    parallelism: ParallelismConfig
    """Layout of the job."""
    hardware: HardwareConfig
    """GPU type and node size."""
    defaults: tuple[str, ...] = ()
    """Fields the config left unstated and the value assumed for each, with why (shown in the output)."""

    @property
    def stage_layers(self) -> float:
        """Layers on the fullest pipeline stage: L/pp, or ceil(L/pp) with uneven stages."""
        p, layers = self.parallelism, self.model.layers
        return float(-(-layers // p.pp)) if p.uneven_stages else layers / p.pp

    @property
    def stage_params(self) -> float:
        """Parameters one GPU holds before ZeRO sharding: its TP/EP share of the fullest stage."""
        m, p = self.model, self.parallelism
        dense = m.params_total - m.expert_params
        per_stage = dense / (p.tp * p.pp) + m.expert_params / (p.tp * p.pp * p.ep)
        return per_stage * self.stage_layers / (m.layers / p.pp)

    def __post_init__(self) -> None:
        p, layers = self.parallelism, self.model.layers
        if p.pp * p.vpp > layers:
            raise ValueError(f"parallelism.pp: pp*vpp = {p.pp * p.vpp} exceeds model.layers={layers}")
        if not p.uneven_stages and layers % (p.pp * p.vpp):
            what = f"pp={p.pp}" if p.vpp == 1 else f"pp*vpp={p.pp}*{p.vpp}"
            raise ValueError(
                f"parallelism.pp: {what} does not divide model.layers={layers}; pick a divisor "
                "or set parallelism.uneven_stages: true (the fullest stage sets the pace)"
            )


def _section(
    data: Mapping[str, Any], name: str, aliases: Mapping[str, str], known: frozenset[str], strict: bool
) -> dict[str, Any]:
    raw = data.get(name)
    if raw is None:
        raise ValueError(f"{name}: missing (a mapping of keys to values)")
    if not isinstance(raw, Mapping):
        raise ValueError(f"{name}: must be a mapping of keys to values, got {raw!r}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        canonical = aliases.get(key, key)
        if canonical not in known:
            if strict:
                raise ValueError(f"{name}.{key}: unknown key (known: {', '.join(sorted(known))})")
            continue
        out[canonical] = value
    return out


def _int(section: dict[str, Any], prefix: str, key: str, default: int | None = None, minimum: int = 1) -> int:
    if key not in section or section[key] is None:
        if default is None:
            raise ValueError(f"{prefix}.{key}: required")
        return default
    value = section[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ValueError(f"{prefix}.{key}: must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{prefix}.{key}: must be >= {minimum}, got {value!r}")
    return int(value)


def _float(section: dict[str, Any], prefix: str, key: str) -> float | None:
    value = section.get(key)
    if value is None:
        return None
    if isinstance(value, str):  # YAML 1.1 reads "7.0e10" (no exponent sign) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{prefix}.{key}: must be a positive number, got {value!r}")
    return float(value)


def _bool(section: dict[str, Any], prefix: str, key: str, default: bool) -> bool:
    value = section.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{prefix}.{key}: must be true or false, got {value!r}")
    return value


def default_ffn_hidden(hidden: int, gated: bool) -> int:
    """Llama rule for gated MLPs (8/3 d rounded up to 256), GPT rule (4 d) otherwise."""
    if not gated:
        return 4 * hidden
    return 256 * -(-int(8 * hidden / 3) // 256)


def parse_model(data: Mapping[str, Any], *, strict: bool = True) -> ModelConfig:
    sec = _section(data, "model", MODEL_ALIASES, MODEL_KEYS, strict)
    heads = _int(sec, "model", "heads")
    gated = _bool(sec, "model", "gated_mlp", True)
    hidden = _int(sec, "model", "hidden")
    experts = _int(sec, "model", "experts", 1)
    return ModelConfig(
        layers=_int(sec, "model", "layers"),
        hidden=hidden,
        heads=heads,
        kv_heads=_int(sec, "model", "kv_heads", heads),
        ffn_hidden=_int(sec, "model", "ffn_hidden", default_ffn_hidden(hidden, gated)),
        gated_mlp=gated,
        vocab=_int(sec, "model", "vocab"),
        seq_len=_int(sec, "model", "seq_len"),
        params_override=_float(sec, "model", "params"),
        experts=experts,
        active_experts=_int(sec, "model", "active_experts", min(2, experts)),
        shared_ffn_hidden=_int(sec, "model", "shared_ffn_hidden", 0, minimum=0),
        tied_embeddings=_bool(sec, "model", "tied_embeddings", False),
        attention_head_dim=_int(sec, "model", "head_dim", 0),
        attention_core_width=_int(sec, "model", "attention_core_width", 0),
    )


def parse_hardware(data: Mapping[str, Any], *, strict: bool = True) -> HardwareConfig:
    sec = _section(data, "hardware", HARDWARE_ALIASES, HARDWARE_KEYS, strict)
    peak_bf16 = _float(sec, "hardware", "peak_tflops")
    peak_fp8 = _float(sec, "hardware", "peak_fp8_tflops")
    hbm = _float(sec, "hardware", "hbm_gib")
    intra = _float(sec, "hardware", "intra_node_gbps")
    inter = _float(sec, "hardware", "inter_node_gbps")
    peak_flops = _float(sec, "hardware", "peak_flops")
    if peak_flops is not None and peak_bf16 is None:
        peak_bf16 = peak_flops / 1e12
    name = sec.get("gpu")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"hardware.gpu: must be a string, got {name!r}")
    if name is not None:
        # The table entry, with whatever the config gives explicitly taking precedence.
        table = gpu_spec(name)
        spec = dataclasses.replace(
            table,
            peak_bf16_tflops=table.peak_bf16_tflops if peak_bf16 is None else peak_bf16,
            peak_fp8_tflops=table.peak_fp8_tflops if peak_fp8 is None else peak_fp8,
            hbm_gib=table.hbm_gib if hbm is None else hbm,
            intra_node_gbps=table.intra_node_gbps if intra is None else intra,
            inter_node_gbps=table.inter_node_gbps if inter is None else inter,
        )
    else:
        if peak_bf16 is None or hbm is None or intra is None or inter is None:
            raise ValueError(
                "hardware.gpu: required unless peak_tflops, hbm_gib, intra_node_gbps and "
                "inter_node_gbps are all given"
            )
        spec = GpuSpec(
            name="custom",
            peak_bf16_tflops=peak_bf16,
            peak_fp8_tflops=peak_fp8,
            hbm_gib=hbm,
            intra_node_gbps=intra,
            inter_node_gbps=inter,
            gpus_per_node=8,
        )
    per_node = _int(sec, "hardware", "gpus_per_node", spec.gpus_per_node)
    fraction = sec.get("usable_hbm_fraction", 0.75)
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        raise ValueError(f"hardware.usable_hbm_fraction: must be a number, got {fraction!r}")
    return HardwareConfig(
        gpu=dataclasses.replace(spec, gpus_per_node=per_node),
        gpus_per_node=per_node,
        precision=str(sec.get("precision", "bf16")),
        usable_hbm_fraction=float(fraction),
    )


def _zero(sec: dict[str, Any]) -> int:
    value = sec["zero"]
    if isinstance(value, str) and value.lower() == "fsdp":
        return 3
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2, 3):
        raise ValueError(f"parallelism.zero: must be 0, 1, 2, 3 or 'fsdp', got {value!r}")
    return value


def default_zero(*, tp: int, pp: int, cp: int, dp: int) -> tuple[int, str]:
    """The sharding large runs use when the config does not say (and why)."""
    if dp * cp == 1:  # ZeRO shards over the data- and context-parallel ranks together
        return 0, "one data-parallel replica without CP: nothing to shard"
    if tp * pp * cp > 1:
        return 1, "Megatron-LM/NeMo practice with model parallelism: distributed optimizer"
    return 3, "pure data parallelism: PyTorch FSDP is the usual stack"


def default_vpp(*, layers: int, pp: int, micro_batches: int) -> tuple[int, str]:
    """Interleaved 1F1B as Megatron runs it at scale: chunks of >= 2 layers, m a multiple of pp."""
    if pp == 1:
        return 1, "no pipeline"
    if micro_batches % pp:
        return 1, f"m={micro_batches} is not a multiple of pp={pp} (interleaving needs it)"
    per_stage = -(-layers // pp)  # uneven stages: the fullest one
    v = max((d for d in range(1, per_stage // 2 + 1) if per_stage % d == 0), default=1)
    return v, f"interleaved 1F1B, {per_stage // v} layers per virtual stage"


def hardware_gpus(data: Mapping[str, Any]) -> int | None:
    """`hardware.gpus` (alias `count`) when given: the world size a registration may state there."""
    raw = data.get("hardware")
    if not isinstance(raw, Mapping):
        return None
    # The later of two names wins, as in _section.
    sec: dict[str, Any] = {HARDWARE_ALIASES.get(str(key), str(key)): value for key, value in raw.items()}
    return _int(sec, "hardware", "gpus") if sec.get("gpus") is not None else None


def _world_size(sec: dict[str, Any], hw_gpus: int | None) -> int:
    gpus = _int(sec, "parallelism", "gpus", hw_gpus)
    if hw_gpus is not None and gpus != hw_gpus:
        raise ValueError(
            f"hardware.gpus: {hw_gpus} != parallelism.gpus: {gpus}; give the world size once, or the same in both"
        )
    return gpus


def parse_recompute(sec: dict[str, Any]) -> str:
    recompute = sec.get("recompute")
    if recompute is None:
        return "selective"
    if not isinstance(recompute, str):
        raise ValueError(f"parallelism.recompute: must be a string, got {recompute!r}")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"parallelism.recompute: must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    return recompute


def parse_parallelism(
    data: Mapping[str, Any], model: ModelConfig, *, strict: bool = True, hw_gpus: int | None = None
) -> tuple[ParallelismConfig, tuple[str, ...]]:
    """The layout and the defaults it took for unstated fields ("key: value (why)"); `hw_gpus` is
    hardware.gpus, which stands in for parallelism.gpus and must agree with it."""
    sec = _section(data, "parallelism", PARALLELISM_ALIASES, PARALLELISM_KEYS, strict)
    p = "parallelism"
    defaults: list[str] = []
    gpus = _world_size(sec, hw_gpus)
    tp, pp, cp = _int(sec, p, "tp", 1), _int(sec, p, "pp", 1), _int(sec, p, "cp", 1)
    if gpus % (tp * pp * cp):
        raise ValueError(f"parallelism.gpus: {gpus} is not divisible by tp*pp*cp = {tp * pp * cp}")
    dp = _int(sec, p, "dp", gpus // (tp * pp * cp))
    ep = _int(sec, p, "ep", 1)
    if model.heads % tp:
        raise ValueError(f"parallelism.tp: {tp} does not divide model.heads={model.heads}")
    if not model.allows_tp(tp):
        raise ValueError(
            f"parallelism.tp: {tp} neither divides nor is a multiple of model.kv_heads={model.kv_heads} "
            "(each rank needs whole KV heads, or each KV head replicated on tp/kv_heads ranks)"
        )
    if pp > model.layers:
        raise ValueError(f"parallelism.pp: {pp} exceeds model.layers={model.layers}")
    if model.experts % ep:
        raise ValueError(f"parallelism.ep: {ep} does not divide model.experts={model.experts}")
    if model.seq_len % cp:
        raise ValueError(f"parallelism.cp: {cp} does not divide model.seq_len={model.seq_len}")
    if "micro_batch" not in sec:
        defaults.append("micro_batch: 1")
    micro = _int(sec, p, "micro_batch", 1)
    if "global_batch" not in sec:
        defaults.append(f"global_batch: {micro * dp} (one micro-batch per data-parallel rank)")
    global_batch = _int(sec, p, "global_batch", micro * dp)
    recompute = parse_recompute(sec)
    if sec.get("recompute") is None:
        defaults.append("recompute: selective (Megatron default with sequence parallelism)")
    attention = sec.get("attention")
    if attention is None:
        attention = "fused"
        if recompute == "none":
            defaults.append("attention: fused (FlashAttention/SDPA, every current stack: no s^2 score tensors kept)")
    if not isinstance(attention, str):
        raise ValueError(f"parallelism.attention: must be a string, got {attention!r}")
    if "zero" in sec and sec["zero"] is not None:
        zero = _zero(sec)
    else:
        zero, why = default_zero(tp=tp, pp=pp, cp=cp, dp=dp)
        defaults.append(f"zero: {zero} ({why})")
    if "vpp" in sec and sec["vpp"] is not None:
        vpp = _int(sec, p, "vpp", 1)
    else:
        m = global_batch // (micro * dp) if micro * dp and global_batch % (micro * dp) == 0 else 0
        vpp, why = default_vpp(layers=model.layers, pp=pp, micro_batches=m) if m else (1, "")
        if pp > 1:
            defaults.append(f"vpp: {vpp} ({why})")
    # A registered job whose pp does not divide the layers is running with uneven stages.
    uneven = _bool(sec, p, "uneven_stages", not strict and model.layers % pp != 0)
    if uneven and "uneven_stages" not in sec:
        defaults.append(f"uneven_stages: true (the job runs pp={pp}, which does not divide {model.layers} layers)")
    sequence_parallel = _bool(sec, p, "sequence_parallel", True)
    if tp > 1 and "sequence_parallel" not in sec:
        defaults.append("sequence_parallel: true (Megatron/torchtitan practice with TP)")
    overlap = _bool(sec, p, "overlap_dp_comm", True)
    if dp * cp > 1 and "overlap_dp_comm" not in sec:
        defaults.append("overlap_dp_comm: true (grad reduce-scatter in backward, param gather in forward)")
    framework = sec.get("framework")
    if framework is None:
        framework = "fsdp" if zero == 3 and pp == 1 else "megatron"
        why = ("FSDP without PP is the PyTorch-native stack" if framework == "fsdp"
               else "a 3D-parallel (TP/PP) stack with fused kernels")
        defaults.append(f"framework: {framework} ({why})")
    if not isinstance(framework, str):
        raise ValueError(f"parallelism.framework: must be a string, got {framework!r}")
    config = ParallelismConfig(
        gpus=gpus,
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        ep=ep,
        vpp=vpp,
        zero=zero,
        micro_batch=micro,
        global_batch=global_batch,
        recompute=recompute,
        uneven_stages=uneven,
        sequence_parallel=sequence_parallel,
        overlap_dp_comm=overlap,
        framework=framework,
        attention=attention,
    )
    return config, tuple(defaults)


@dataclass(kw_only=True, slots=True, frozen=True)
class RecommendTarget:
    """What the recommender reads of a parallelism section; the layout keys (tp, pp, ...) it chooses
    itself are accepted and ignored, so a plan config can be given unchanged."""

    gpus: int
    """GPUs to lay out (parallelism.gpus, or hardware.gpus)."""
    micro_batch: int = 1
    """Sequences per micro-batch."""
    global_batch: int | None = None
    """Target sequences per step; None: the critical batch."""
    recompute: str = "selective"
    """Activation recomputation of every candidate."""


def parse_recommend_parallelism(data: Mapping[str, Any]) -> RecommendTarget:
    """The recommender's inputs, checked as strictly as `parse_parallelism` checks a plan's."""
    hw_gpus = hardware_gpus(data)
    sec = {} if data.get("parallelism") is None else _section(
        data, "parallelism", PARALLELISM_ALIASES, PARALLELISM_KEYS, strict=True
    )
    p = "parallelism"
    return RecommendTarget(
        gpus=_world_size(sec, hw_gpus),
        micro_batch=_int(sec, p, "micro_batch", 1),
        global_batch=_int(sec, p, "global_batch") if sec.get("global_batch") is not None else None,
        recompute=parse_recompute(sec),
    )


def parse_plan_input(data: Mapping[str, Any], *, strict: bool = True) -> PlanInput:
    """Validate a plan dict (JSON/YAML or run registration). strict=False ignores unknown keys."""
    if not isinstance(data, Mapping):
        raise ValueError("config: top level must be a mapping with model, parallelism, hardware")
    if strict:
        extra = set(data) - {"model", "parallelism", "hardware"}
        if extra:
            raise ValueError(
                f"{sorted(extra)[0]}: unknown top-level key (known: model, parallelism, hardware)"
            )
    model = parse_model(data, strict=strict)
    hardware = parse_hardware(data, strict=strict)
    parallelism, defaults = parse_parallelism(data, model, strict=strict, hw_gpus=hardware_gpus(data))
    return PlanInput(model=model, parallelism=parallelism, hardware=hardware, defaults=defaults)
