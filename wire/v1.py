"""Wire format v1: what the agent sends and the collector (and `trainvitals replay`) ingests.

Two messages:

- `RunRegistration` (POST /v1/runs): once per run, idempotent; describes the model, the
  parallelism config, the hardware, the FP8 recipe and the checkpoint settings.
- `Batch` (POST /v1/batches): per rank, identified by (run, rank, incarnation, seq) so a retried
  batch is stored once. It carries records of five kinds: step, tensor, grad, checkpoint, event.

Units are in the field names or descriptions: seconds, bytes, bits, FLOPs, tokens. Times are Unix
epoch seconds (float). docs/wire-format.md renders this module as a table; change both together and
bump WIRE_VERSION on any incompatible change.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainvitals.wire.conventions import (
    DEFAULT_DETECTOR_WARMUP_STEPS,
    DEFAULT_PROJECT,
    GLOBAL_GROUP,
    AmaxAlgo,
    CheckpointStatus,
    EventKind,
    Fp8Format,
    Recompute,
    Role,
)

NO_NUL_PATTERN = r"^[^\x00]*$"
"""A name's pattern: no NUL character, which PostgreSQL refuses in text."""
_Name = Annotated[str, Field(min_length=1, max_length=256, pattern=NO_NUL_PATTERN)]
RUN_ID_CHARS = r"A-Za-z0-9._:\-"
"""The characters of a run id, as a regex class body (the agent's suggestion replaces the others)."""
RUN_ID_MAX_LENGTH = 128
_RUN_ID_PATTERN = f"^[{RUN_ID_CHARS}]+$"
_RunId = Annotated[str, Field(min_length=1, max_length=RUN_ID_MAX_LENGTH, pattern=_RUN_ID_PATTERN)]

# Every integer has the range of the column it lands in (service/store/models.py), so a value the
# database would wrap or refuse is a 422 naming the field instead (PostgreSQL's int4 once stored
# 2**31 as -2**31 with a 200). Values kept only in the registration's JSON get the 64-bit range,
# or the 32-bit one where they count ranks or devices (bounded by world_size, an int4 column).
INT32_MAX = 2**31 - 1
"""Integer columns (rank, pipeline/TP/DP position, staleness, checkpoint generation, world size)."""
INT64_MAX = 2**63 - 1
"""BigInteger columns (incarnation, seq, tokens, bytes, non-finite counts)."""
MAX_STEP = 2**53 - 1
"""Steps: stored as 64-bit, but kept where every step is exact as a float64 (the detectors' series)
and where the analysis can add to the newest step without leaving the column's range."""
_Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
_Count32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
_Degree = Annotated[int, Field(ge=1, le=INT32_MAX)]
_Positive = Annotated[int, Field(ge=1, le=INT64_MAX)]
_Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
# Times and amounts must be finite: they are summed, averaged and written to JSON columns, where an
# Infinity once stopped a run's analysis. A non-finite loss, gradient or amax stays accepted: that
# is what the detectors are for.
_Finite = Annotated[float, Field(allow_inf_nan=False)]
_NonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]
_Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
_PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Strict(BaseModel):
    # Unknown fields are an error: a typo in a field name must not be silently dropped.
    # NaN/Infinity travel as JSON constants: a non-finite loss is data, not a transport error.
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")


# --------------------------------------------------------------------------- run registration


class ModelDims(_Strict):
    layers: _Positive | None = Field(None, description="transformer blocks")
    hidden: _Positive | None = Field(None, description="model width d")
    heads: _Positive | None = Field(None, description="attention heads")
    kv_heads: _Positive | None = Field(None, description="key/value heads (GQA)")
    ffn_hidden: _Positive | None = Field(None, description="MLP inner width")
    vocab: _Positive | None = Field(None, description="vocabulary size")
    seq_len: _Positive | None = Field(None, description="tokens per sequence")
    params: _Positive | None = Field(None, description="total parameters")
    non_embedding_params: _Positive | None = Field(None, description="N in 6N + 12LHQT")
    experts: _Degree | None = Field(None, description="MLP experts per layer, a mixture of experts (1: dense)")
    active_experts: _Degree | None = Field(None, description="experts each token is routed to (top-k)")
    shared_ffn_hidden: _Positive | None = Field(
        None,
        description="MLP inner width every token passes through besides its routed experts: an MoE's "
        "shared experts together (DeepSeek: n_shared_experts x moe_intermediate_size; Qwen2-MoE: "
        "shared_expert_intermediate_size)",
    )
    head_dim: _Positive | None = Field(
        None,
        description="width of one attention head (Q in 12LHQT) and of its q/k/v/o projections, where heads x "
        "head_dim is not hidden (Qwen3, Gemma: the config's head_dim); absent: hidden / heads",
    )
    attention_core_width: _Positive | None = Field(
        None,
        description="H x Q in 12LHQT where the attention core's heads are not as wide as its q/k/v/o "
        "projections: heads x (query-key head width + value head width) / 2 (DeepSeek's MLA: "
        "qk_nope_head_dim + qk_rope_head_dim and v_head_dim; V3: 128 x (192 + 128) / 2 = 20,480); "
        "absent: heads x head_dim",
    )

    @model_validator(mode="after")
    def _routed_to_at_most_all_experts(self) -> ModelDims:
        if self.experts is not None and self.active_experts is not None and self.active_experts > self.experts:
            raise ValueError(
                f"active_experts ({self.active_experts}) exceeds experts ({self.experts}): a token is routed to "
                "at most every expert"
            )
        return self


class Parallelism(_Strict):
    world_size: _Degree = Field(1, description="ranks in the job")
    tp: _Degree = Field(1, description="tensor-parallel degree")
    pp: _Degree = Field(1, description="pipeline-parallel degree")
    dp: _Degree | None = Field(None, description="data-parallel degree (derived when absent)")
    cp: _Degree = Field(1, description="context-parallel degree")
    ep: _Degree = Field(1, description="expert-parallel degree")
    zero_stage: int = Field(0, ge=0, le=3, description="ZeRO stage; 3 = FSDP full shard")
    micro_batch: _Positive | None = Field(None, description="sequences per micro-batch per rank")
    global_batch: _Positive | None = Field(None, description="sequences per optimizer step")
    recompute: Recompute = "none"


class Hardware(_Strict):
    gpu_type: str | None = Field(None, max_length=64, description="e.g. H100-SXM; 'cpu' for CPU runs")
    gpu_count: _Degree | None = None
    gpus_per_node: _Degree | None = None
    peak_flops: _PositiveFloat | None = Field(None, description="dense peak FLOP/s per device")


class Fp8Recipe(_Strict):
    enabled: bool = False
    input_format: Fp8Format = "e4m3"
    weight_format: Fp8Format = "e4m3"
    grad_format: Fp8Format = "e5m2"
    history_len: _Degree = Field(1024, description="amax history length L")
    margin: _Count32 = Field(0, description="margin in bits")
    amax_algo: AmaxAlgo = "max"


class CheckpointSettings(_Strict):
    interval_steps: Annotated[int, Field(ge=1, le=MAX_STEP)] | None = None
    interval_seconds: _PositiveFloat | None = None
    keep_last: _Degree | None = Field(None, description="generations retained")
    async_save: bool = False


class RunRegistration(_Strict):
    """Sent once per run (by rank 0, or by every rank: registration is idempotent)."""

    wire_version: Literal[1] = 1
    run: _RunId = Field(description="run id shared by all ranks: letters, digits, . _ : -")
    project: _Name = Field(DEFAULT_PROJECT, description="tokens are scoped to a project; run ids are the project's own")
    baseline_run: str | None = Field(
        None,
        min_length=1,
        max_length=RUN_ID_MAX_LENGTH,
        pattern=_RUN_ID_PATTERN,  # a run id (constraints inline: the docs table then reads `str | None`)
        description="an earlier run of the same project to compare with: loss and gradient norm at equal steps, "
        "so the shapes both share (warm-up, data order, end of training) cancel; a name that is not a run of "
        "the project is ignored (the run is judged against itself)",
    )
    started_at: _Finite | None = Field(None, description="Unix seconds")
    incarnation: _Count | None = Field(
        None,
        description="the registering process's incarnation, as its batches carry it: when the collector refuses "
        "the registration (another job reusing the run id), it refuses that process's batches too",
    )
    resume: bool = Field(
        False,
        description="this process continues the registered run even where its model or layout differs (an elastic "
        "resize, a resume on another layout): a new incarnation, never refused as another job; the run is "
        "described by this registration from then on",
    )
    model: ModelDims = ModelDims()
    parallelism: Parallelism = Parallelism()
    hardware: Hardware = Hardware()
    fp8: Fp8Recipe = Fp8Recipe()
    checkpoint: CheckpointSettings = CheckpointSettings()
    flops_convention: str | None = Field(
        None, max_length=128, description="how flops_per_step is counted, e.g. '6N+12LHQT, no recompute'"
    )
    tags: dict[str, str] = Field(default_factory=dict, max_length=64)
    detector_warmup_steps: _Step | None = Field(
        None,
        description="steps from the run's first step during which the baseline detectors stay quiet (LR warm-up, "
        f"early loss drop); None: the collector's ({DEFAULT_DETECTOR_WARMUP_STEPS} unless set otherwise). A run "
        "shorter than its warm-up is judged only for non-finite values, failed checkpoints and stalls",
    )

    @model_validator(mode="after")
    def _baseline_is_another_run(self) -> RunRegistration:
        if self.baseline_run == self.run:
            raise ValueError("baseline_run names the run itself: name an earlier run of the same project")
        return self


# --------------------------------------------------------------------------- records


class StepRecord(_Strict):
    """One optimizer step on one rank."""

    kind: Literal["step"] = "step"
    step: _Step
    ts: _Finite = Field(description="Unix seconds at the end of the step")
    step_seconds: _NonNeg = Field(description="wall time of this step on this rank")
    compute_seconds: _NonNeg | None = Field(None, description="forward+backward+optimizer, excluding waits")
    wait_seconds: _NonNeg | None = Field(None, description="time blocked in collectives")
    data_seconds: _NonNeg | None = Field(None, description="time waiting for the input pipeline")
    loss: float | None = Field(None, description="may be non-finite: that is a finding, not an error")
    tokens: _Count | None = Field(None, description="tokens processed by this rank this step")
    flops: _NonNeg | None = Field(None, description="model FLOPs of this rank this step")
    lr: float | None = None
    grad_norm: float | None = Field(None, description="global L2 norm as the job itself computed it")
    pp_stage: _Count32 | None = Field(None, description="pipeline stage of this rank")
    tp_rank: _Count32 | None = Field(None, description="position in the tensor-parallel group")
    dp_rank: _Count32 | None = Field(None, description="position in the data-parallel group")
    skipped: bool = Field(
        False,
        description="the optimizer did not apply this step's update (a loss scaler such as "
        "torch.amp.GradScaler skipped it on inf/NaN gradients); the agent sets it when the "
        "optimizer it watches did not step",
    )


class TensorRecord(_Strict):
    """FP8 statistics of one monitored tensor (module fqn + role) at one step on one rank."""

    kind: Literal["tensor"] = "tensor"
    step: _Step
    tensor: _Name = Field(description="module fully-qualified name")
    role: Role
    format: Fp8Format
    amax: float = Field(description="max |x| of the high-precision tensor")
    scale: float | None = Field(None, description="multiplier s applied before the cast")
    headroom_bits: float | None = Field(None, description="log2(fp8_max / (amax * s))")
    lag_bits: float | None = Field(None, description="log2(amax_t / A_{t-1})")
    staleness_steps: _Count32 | None = Field(None, description="steps since the history max was set")
    sat_frac: _Fraction | None = None
    underflow_frac: _Fraction | None = None
    crest_bits: float | None = Field(None, description="log2(amax / median |x|)")
    nonfinite: _Count | None = Field(None, description="count of inf/NaN elements")
    shadow: bool = Field(False, description="True: what a delayed-scaling recipe would see (bf16/fp32 run)")


class GradRecord(_Strict):
    """Gradient sums of squares for one parameter group at one step on one rank.

    `owned_sq` counts every gradient element once across the whole job (shards summed once,
    replicas counted once), so the global norm is sqrt(sum over ranks of owned_sq).
    `local_sq` is everything this rank holds; replicas of it must agree across ranks.
    """

    kind: Literal["grad"] = "grad"
    step: _Step
    group: _Name = Field(description=f"parameter group, e.g. 'layers.3' or '{GLOBAL_GROUP}'")
    # Plain floats: a NaN/inf sum of squares is exactly what the collector must see, not a 422.
    owned_sq: float = Field(description="sum of squares of the gradient elements this rank owns")
    local_sq: float = Field(description="sum of squares of every gradient element this rank holds")
    nonfinite: _Count = 0


class CheckpointRecord(_Strict):
    kind: Literal["checkpoint"] = "checkpoint"
    step: _Step
    generation: _Count32
    status: CheckpointStatus = Field(
        description="started, then persisted (or failed); verified: persisted with a checksum; deleted: its files "
        "are gone after the save (the job's retention, or a later save to the same path), so it is no rollback target"
    )
    ts: _Finite
    path: str | None = Field(None, max_length=4096)
    bytes: _Count | None = None
    stall_seconds: _NonNeg | None = Field(None, description="training blocked by the save")
    persist_seconds: _NonNeg | None = Field(None, description="until durable (async saves)")
    checksum: str | None = Field(None, max_length=128)
    error: str | None = Field(None, max_length=4096)
    saved_by_incarnation: _Count | None = Field(
        None,
        description="the incarnation of this rank that saved the generation, when it is not the sender's: a "
        "restarted rank's deleted record about its previous process's save (stored under that incarnation)",
    )


class EventRecord(_Strict):
    kind: Literal["event"] = "event"
    ts: _Finite
    step: _Step | None = None
    event: EventKind
    detail: str | None = Field(None, max_length=4096)
    domains: dict[str, str] = Field(default_factory=dict, max_length=16, description="failure-domain tags")


Record = Annotated[
    StepRecord | TensorRecord | GradRecord | CheckpointRecord | EventRecord, Field(discriminator="kind")
]

MAX_RECORDS_PER_BATCH = 200_000


class Batch(_Strict):
    """Records from one rank; (run, rank, incarnation, seq) makes delivery idempotent."""

    wire_version: Literal[1] = 1
    run: _RunId
    rank: _Count32 = Field(description="global rank of the sender")
    incarnation: _Count = Field(description="bumped by every restart of the rank")
    seq: _Count = Field(
        description="per (run, rank, incarnation): the agent counts from 0 without gaps; the collector uses it only "
        "to store each batch once (any order and gaps accepted: 'Delivery' above)"
    )
    sent_at: _Finite | None = None
    records: list[Record] = Field(max_length=MAX_RECORDS_PER_BATCH)


class BatchAck(_Strict):
    accepted: int = Field(description="records stored by this request")
    duplicate: bool = Field(description="this batch had been stored before; nothing stored now")
