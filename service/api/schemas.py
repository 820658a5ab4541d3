"""The collector's HTTP contract: response models (`XPublic`) of the read and advisor routes, and
the advisor routes' request bodies (`XRequest`).

Responses mirror what the queries and the advisors' `as_dict()` return, field for field and in the
same order (the CSV columns of `?format=csv` follow it); tests/service/api/test_schemas.py keeps
them in step with the store's rows and the advisors' dataclasses.

Request bodies check shape and JSON types, and cap sizes. The advisors' parsers stay the one owner
of what a value means (divisibility, GPU names, ranges) and name the offending key in their 422; so
the request types pass each value through unchanged (strict types, no coercion) and accept what
`trainvitals plan --config` and `trainvitals advise` accept, except: no NaN or Infinity, `null`
means "not given" for every optional key, and the counts that drive the planner's cost are capped
(`*_MAX` below, docs/advisors.md): the routes are open to any read token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    WithJsonSchema,
    model_validator,
)

from trainvitals.service.advisors.cadence import MAX_TIERS, CadenceInputs, TierSpec
from trainvitals.service.advisors.failure_log import RADIUS_LEVELS
from trainvitals.service.advisors.model_config import HARDWARE_ALIASES, MODEL_ALIASES, PARALLELISM_ALIASES
from trainvitals.wire.conventions import CheckpointStatus


class _Public(BaseModel):
    # Rows arrive as dicts (queries), dataclasses (RunOverview) or advisor dicts: read any of them.
    model_config = ConfigDict(from_attributes=True, use_attribute_docstrings=True)


# --------------------------------------------------------------------------- post-mortem reads


class RunPublic(_Public):
    """One run in `GET /v1/runs`."""

    run: str
    project: str
    status: str
    """running | finished"""
    world_size: int
    created_at: float
    """Registration time, epoch seconds."""
    last_seen_at: float
    """Last report of any rank, epoch seconds."""


class RunOverviewPublic(_Public):
    """`GET /v1/runs/{run_id}`: what was stored for a run (store.queries.RunOverview)."""

    run_id: str
    project: str
    status: str
    world_size: int
    ranks: int
    """Most ranks that reported one step."""
    steps: int
    step_records: int
    """Records stored, by kind (as are the other *_records and events)."""
    first_step: int | None
    last_step: int | None
    step_seconds_p50: float | None
    """Median over steps of the cross-rank median step time."""
    step_seconds_min_rank_mean: float | None
    step_seconds_max_rank_mean: float | None
    """Per-rank means over the newest rank windows, as is slowest_rank."""
    slowest_rank: int | None
    tensor_records: int
    grad_records: int
    checkpoint_records: int
    events: int
    detector_warmup_steps: int
    """Steps from the first step during which the baseline detectors stay quiet: the run's
    registered `detector_warmup_steps`, else the collector's."""
    detection_starts_at_step: int | None
    """first_step + detector_warmup_steps (None before the first step)."""
    warmup_steps_remaining: int | None
    """Steps still to run until detection starts (0: it has; None before the first step)."""
    detection: str
    """One line: when detection starts (a run shorter than the warm-up says so), or since when it runs."""
    mfu: str
    """One line: the measured MFU of the newest reduced steps, or why there is none and what to declare."""


class TensorStepPublic(_Public):
    """One step of a tensor's timeline: FP8 statistics reduced over ranks and TP shards."""

    tensor: str
    role: str
    step: int
    format: str
    amax: float
    """Max over ranks."""
    headroom_bits: float | None
    """Min over ranks."""
    lag_bits: float | None
    staleness_steps: int | None
    sat_frac: float | None
    underflow_frac: float | None
    crest_bits: float | None
    nonfinite: int | None
    """Sum over ranks."""
    shadow: bool


class WorstTensorPublic(_Public):
    """A tensor (and role) with little FP8 headroom in the step range."""

    tensor: str
    role: str
    min_headroom_bits: float
    max_amax: float
    clipped_steps: int
    """Steps with negative headroom."""
    max_sat_frac: float | None
    first_step: int
    last_step: int


class StepTimeMatrixPublic(_Public):
    """Per-rank step seconds: seconds[i][j] is steps[i] on ranks[j], null where not reported."""

    run: str
    ranks: list[int]
    steps: list[int]
    seconds: list[list[float | None]]


class FindingPublic(_Public):
    """A detector finding, one per (kind, subject), updated as it evolves."""

    kind: str
    severity: str
    """page | ticket | info"""
    subject_kind: str
    subject: str
    onset_step: int
    """First step of the evidence; while the finding stays open it only ever moves earlier."""
    detected_step: int | None
    """Step at which it was first raised (kept while it stays open); null: stored before this was
    recorded (revision 0009)."""
    paged_step: int | None
    """First step at which it was a page (kept while it stays open; later than detected_step when a
    ticket escalated); null: it never paged, or stored before this was recorded (revision 0020)."""
    last_step: int
    magnitude: float
    summary: str
    active: bool
    first_seen_at: float
    updated_at: float


class AnalysisFindingPublic(_Public):
    """A finding of an analysis on request (`GET /v1/runs/{run}/analysis`): what the detectors report
    now, not stored (service/detectors/findings.py `Finding`, in its field order, without the run)."""

    kind: str
    severity: str
    """page | ticket | info"""
    subject_kind: str
    subject: str
    onset_step: int
    last_step: int
    magnitude: float
    summary: str
    active: bool
    detected_step: int | None
    """First step at which a live collector would have raised it."""
    paged_step: int | None
    """First step at which it was a page (null: never paged)."""


class CheckpointGenerationPublic(_Public):
    """One checkpoint generation (and incarnation) across ranks."""

    generation: int
    step: int
    incarnation: int
    bytes: int | None
    """Total size over the ranks that persisted it."""
    stall_seconds: float | None
    """Slowest rank's training stall."""
    persist_seconds: float | None
    path: str | None
    ts: float
    errors: list[str]
    status: CheckpointStatus  # the wire's statuses: a generation takes the one its ranks' records give
    """failed if any rank failed; deleted when a rank's files of it are gone since (the job's
    retention, or a later save to the same path); persisted when every involved rank persisted;
    verified when also checksummed by each (or reported verified)."""
    ranks: int
    """Ranks that reported anything for it."""


class RollbackPublic(_Public):
    """`GET /v1/runs/{run_id}/rollback`: the generation to restart from."""

    run: str
    before_step: int | None
    reason: str
    """Why this target; when there is none, why not (no save recorded, or how many failed, never
    persisted, or came at or after before_step)."""
    target: CheckpointGenerationPublic | None
    """Newest verified (else persisted) generation before before_step; null when there is none."""
    verified: bool
    generations_considered: int


# --------------------------------------------------------------------------- ops and ingest


class HealthPublic(_Public):
    status: Literal["ok"]


class RunRegisteredPublic(_Public):
    """`POST /v1/runs`: 201 with created=true, or 200 for a repeated registration."""

    run: str
    created: bool
    project: str
    """The run's project: the registration's, or the token's when the registration names none."""


# --------------------------------------------------------------------------- advisor answers


class MemoryPublic(_Public):
    """Per-GPU memory by tenant, GiB."""

    params_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    overhead_gib: float
    total_gib: float
    capacity_gib: float
    fits: bool


class StepTimePublic(_Public):
    """One optimizer step's time, seconds, by component."""

    compute_s: float
    tp_comm_s: float
    cp_comm_s: float
    """Ring attention's exposed key/value exchange (context parallelism)."""
    pp_comm_s: float
    ep_comm_s: float
    dp_comm_exposed_s: float
    dp_comm_total_s: float
    bubble_s: float
    total_s: float


class MfuPublic(_Public):
    predicted: float
    low: float
    high: float
    calibrated: bool
    """True when the GPU type is covered by the calibration data."""
    convention: str
    """FLOP counting convention of the numbers."""
    band: float
    """Relative half-width of low..high: the calibration's held-out error in the config's regime, widened
    outside the calibrated domain."""
    regime: str
    """The calibration regime the band comes from (GPU type and layout)."""
    in_domain: bool
    """False: the config is outside the calibrated domain (`outside` says how); the band is widened."""
    outside: list[str]


class PlanPublic(_Public):
    """`POST /v1/plan`: predicted memory, step time and MFU (advisors.PlanResult.as_dict())."""

    memory: MemoryPublic
    step_time: StepTimePublic
    tokens_per_s: float
    mfu: MfuPublic
    binding_wall: str
    """memory, compute, tp_comm, pp_bubble, dp_comm or ep_comm."""
    model_flops_per_token: float
    params_total: float
    params_active: float
    warnings: list[str]
    defaults: list[str]
    """Each field the config left unstated and the value assumed for it, with why."""


class ParallelismPublic(_Public):
    gpus: int
    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    vpp: int
    zero: int
    micro_batch: int
    global_batch: int
    recompute: str
    uneven_stages: bool


class LadderStepPublic(_Public):
    wall: str
    """The binding wall ("state > 1 GPU", "weights/GPU", ...)."""
    axis: str
    """The axis added to relieve it."""
    detail: str


class RecommendationPublic(_Public):
    """`POST /v1/plan/recommend` (advisors.Recommendation.as_dict())."""

    feasible: bool
    config: ParallelismPublic | None
    plan: PlanPublic | None
    binding_wall: str
    mfu: MfuPublic | None
    ladder: list[LadderStepPublic]
    min_gpus: int | None
    """Smallest GPU count on which a layout fits (when infeasible)."""
    useful_gpus: int | None
    """Largest GPU count data parallelism can still use under the critical batch."""
    warnings: list[str]


class RetentionPublic(_Public):
    keep: int
    keep_for_risk: int
    keep_deterministic: int
    risk_at_keep: float
    storage_limit: int | None
    keep_every: int
    promote_after_s: float | None
    notes: list[str]


class TierAdvicePublic(_Public):
    name: str
    interval_s: float
    """null when no incident in the mix reaches this tier (an infinite interval)."""
    rate_per_hour: float


class CadenceAdvicePublic(_Public):
    """`POST /v1/advise/checkpoints` (advisors.CadenceAdvice.as_dict(); docs/advisors.md)."""

    young_interval_s: float
    daly_first_order_s: float
    daly_interval_s: float
    optimal_interval_s: float
    recommended_interval_s: float
    band_s: tuple[float, float]
    """Flat-basin band around the recommendation."""
    confidence_band_s: tuple[float, float]
    """The recommendation at the failure rate's confidence bounds."""
    expected_waste: float
    expected_waste_young: float
    mtbf_s: float
    downtime_s: float
    shape: float
    incidents: int | None
    """Incidents of the failure log the rate rests on (null when the MTBF was given)."""
    retention: RetentionPublic
    tiers: list[TierAdvicePublic]
    schedule_s: list[float] | None
    schedule_gain: float | None
    high_density_interval_s: float | None
    assumptions: list[str]
    warnings: list[str]


class _ObservedRun(_Public):
    run: str
    observed_saves: int
    observed_failures: int


# Bases in this order so that run and the observed counts come first, as the route always sent them
# (pydantic orders fields from the last base to the first).
class RunCadenceAdvicePublic(CadenceAdvicePublic, _ObservedRun):
    """`GET /v1/runs/{run_id}/advice/checkpoints`: cadence advice from the run's observed saves."""


# --------------------------------------------------------------------------- advisor requests

# Numbers pass through as sent (an int stays an int: the advisors' answers and error messages read
# exactly as they do from the CLI); strings and booleans are refused here.
_Number = Annotated[StrictInt | StrictFloat, WithJsonSchema({"type": "number"})]
# JSON has one number type: a count may come as 4 or 4.0 (YAML-born configs); the parser checks
# that it is whole and names the key otherwise.
_Count = Annotated[StrictInt | StrictFloat, WithJsonSchema({"type": "integer"})]
# A positive number; a string is passed on because YAML 1.1 reads "7.0e10" as one (the parser converts it).
_Amount = Annotated[StrictInt | StrictFloat | StrictStr, WithJsonSchema({"type": "number"})]


# Caps on what the planner's cost grows with (a recommendation for 1e8 layers took 7 s of CPU; at
# these caps the slowest measured one takes ~3 s): far above any trained model or cluster.
LAYERS_MAX = 10_000
WIDTH_MAX = 1_048_576
"""hidden, heads, kv_heads, experts, active_experts."""
FFN_MAX = 8 * WIDTH_MAX
TOKENS_MAX = 16_777_216
"""vocab, seq_len."""
GPUS_MAX = 1_048_576
"""gpus and every parallel degree."""
BATCH_MAX = 1_073_741_824
"""micro_batch, global_batch (sequences)."""


def _at_most(limit: int) -> AfterValidator:
    def check(value: float) -> float:
        if value > limit:
            raise ValueError(f"must be at most {limit:,}, got {value!r}")
        return value

    return AfterValidator(check)


# Counts (as _Count) with a cap each.
_Layers = Annotated[
    StrictInt | StrictFloat, _at_most(LAYERS_MAX), WithJsonSchema({"type": "integer", "maximum": LAYERS_MAX})
]
_Width = Annotated[
    StrictInt | StrictFloat, _at_most(WIDTH_MAX), WithJsonSchema({"type": "integer", "maximum": WIDTH_MAX})
]
_Ffn = Annotated[StrictInt | StrictFloat, _at_most(FFN_MAX), WithJsonSchema({"type": "integer", "maximum": FFN_MAX})]
_Tokens = Annotated[
    StrictInt | StrictFloat, _at_most(TOKENS_MAX), WithJsonSchema({"type": "integer", "maximum": TOKENS_MAX})
]
_Gpus = Annotated[
    StrictInt | StrictFloat, _at_most(GPUS_MAX), WithJsonSchema({"type": "integer", "maximum": GPUS_MAX})
]
_Batch = Annotated[
    StrictInt | StrictFloat, _at_most(BATCH_MAX), WithJsonSchema({"type": "integer", "maximum": BATCH_MAX})
]


def _drop_nulls(data: Any) -> Any:
    # null means "not given" for every optional key (the key's default); a required key sent as
    # null is then reported missing.
    if isinstance(data, Mapping):
        return {key: value for key, value in data.items() if value is not None}
    return data


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        return _drop_nulls(data)


class _Section(_Request):
    """A config section; keys may also be given by the names other tools use (model_config.*_ALIASES)."""

    _aliases: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _canonical_keys(cls, data: Any) -> Any:
        # As the planner's parser does: an alias becomes its key, and of two names for one key the
        # later one wins.
        if isinstance(data, Mapping):
            return {cls._aliases.get(key, key): value for key, value in data.items()}
        return data


class ModelSection(_Section):
    """A decoder-only transformer; unset keys take the planner's defaults."""

    _aliases = MODEL_ALIASES

    layers: _Layers
    hidden: _Width
    heads: _Width
    vocab: _Tokens
    seq_len: _Tokens
    kv_heads: _Width | None = None
    """Default: heads (multi-head attention)."""
    ffn_hidden: _Ffn | None = None
    """Default: 8/3 hidden rounded up to 256 (gated), else 4 hidden."""
    gated_mlp: StrictBool | None = None
    """Default true (SwiGLU)."""
    params: _Amount | None = None
    """Total parameter count; rescales the architecture's count."""
    experts: _Width | None = None
    active_experts: _Width | None = None
    shared_ffn_hidden: _Ffn | None = None
    """An MoE's shared experts: the MLP width every token passes through besides its routed ones."""
    head_dim: _Width | None = None
    """Width of one attention head and of its q/k/v/o projections, where heads x head_dim is not hidden
    (Qwen3, Gemma). Default: hidden / heads."""
    attention_core_width: _Width | None = None
    """The attention core's width in 12LHQT (H x Q) where its heads are not as wide as its q/k/v/o
    projections: heads x (query-key + value head width) / 2 (DeepSeek's MLA). Default: heads x
    head_dim."""
    tied_embeddings: StrictBool | None = None


class ParallelismSection(_Section):
    """The layout; gpus = tp * cp * pp * dp, dp derived when not given."""

    _aliases = PARALLELISM_ALIASES

    gpus: _Gpus | None = None
    """Default: hardware.gpus."""
    tp: _Gpus | None = None
    pp: _Gpus | None = None
    dp: _Gpus | None = None
    cp: _Gpus | None = None
    ep: _Gpus | None = None
    vpp: _Gpus | None = None
    zero: StrictInt | StrictStr | None = None
    """ZeRO stage 0-3, or "fsdp" (= 3). Default: 1 (distributed optimizer) with TP, PP or CP, FSDP for pure
    data parallelism (the output's `defaults` says which)."""
    micro_batch: _Batch | None = None
    global_batch: _Batch | None = None
    """Sequences per optimizer step; default micro_batch * dp."""
    recompute: Literal["none", "selective", "full"] | None = None
    """Default selective."""
    uneven_stages: StrictBool | None = None
    """Allow a pp that does not divide the layers (the fullest stage sets the pace); default false."""
    sequence_parallel: StrictBool | None = None
    """Sequence parallelism with TP; default true."""
    overlap_dp_comm: StrictBool | None = None
    """Data-parallel traffic overlapped with backward/forward; default true."""
    framework: Literal["megatron", "fsdp"] | None = None
    """The training stack whose efficiency applies; default from the layout."""
    attention: Literal["fused", "eager"] | None = None
    """Attention kernel: fused (FlashAttention/SDPA, stores no s^2 scores) or eager; default fused."""


class HardwareSection(_Section):
    """A GPU from the table (docs/advisors.md), or its explicit numbers; explicit numbers override
    the table's."""

    _aliases = HARDWARE_ALIASES

    gpu: StrictStr | None = None
    gpus: _Gpus | None = None
    gpus_per_node: _Gpus | None = None
    peak_tflops: _Amount | None = None
    """Dense bf16 peak per GPU."""
    peak_fp8_tflops: _Amount | None = None
    hbm_gib: _Amount | None = None
    intra_node_gbps: _Amount | None = None
    inter_node_gbps: _Amount | None = None
    precision: Literal["bf16", "fp8"] | None = None
    """Which peak is the MFU denominator; default bf16."""
    usable_hbm_fraction: _Number | None = None
    """Default 0.75."""
    peak_flops: _Amount | None = None
    """Dense bf16 peak in FLOP/s (instead of peak_tflops)."""


class PlanRequest(_Request):
    """`POST /v1/plan`: the plan config of `trainvitals plan --config FILE`."""

    model: ModelSection
    parallelism: ParallelismSection
    hardware: HardwareSection

    def as_config(self) -> dict[str, Any]:
        """The config dict the planner parses: canonical key names, only the keys given."""
        return self.model_dump(exclude_unset=True)


class RecommendParallelism(_Request):
    """What the recommender reads of a parallelism section; other keys (tp, pp, ...) are ignored,
    so the body of `POST /v1/plan` can be sent as it is. Of the aliases only world_size is read
    (for gpus); `recommend_from_config` itself reads them all and refuses unknown keys, which this
    model has already dropped."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _gpus_from_world_size(cls, data: Any) -> Any:
        data = _drop_nulls(data)
        if isinstance(data, Mapping) and "gpus" not in data and "world_size" in data:
            return {**data, "gpus": data["world_size"]}
        return data

    gpus: _Gpus | None = None
    """GPUs to lay out; default hardware.gpus (one of them is required)."""
    micro_batch: _Batch = 1
    global_batch: _Batch | None = None
    """Target sequences per step; default: the critical batch (2M tokens)."""
    recompute: Literal["none", "selective", "full"] | None = None


class RecommendRequest(BaseModel):
    """`POST /v1/plan/recommend`: model and hardware, and the GPU count; other top-level keys are
    ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: ModelSection
    hardware: HardwareSection
    parallelism: RecommendParallelism | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        return _drop_nulls(data)

    def as_config(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)


class TierRequest(_Request):
    """One checkpoint tier, fastest first."""

    name: StrictStr
    cost_s: _Number
    """Stall of one save to this tier, seconds."""
    survives: StrictStr = Field(description=f"Widest blast radius its copy survives: {', '.join(RADIUS_LEVELS)}.")


class CadenceRequest(_Request):
    """`POST /v1/advise/checkpoints`: the inputs of `trainvitals advise` without an event log
    (advisors.CadenceInputs; unset or null keys take its defaults; it checks every range)."""

    stall_s: _Number
    """Training stall per checkpoint."""
    persist_s: _Number = 0.0
    """Async lag until a checkpoint is durable."""
    mtbf_s: _Number | None = None
    """Job-level mean time between interruptions (required: the HTTP route takes no event log)."""
    restart_s: _Number = 600.0
    detect_s: _Number = 60.0
    sdc_latency_s: _Number | None = None
    """Mean silent-data-corruption detection latency."""
    acceptable_risk: _Number = 0.01
    """Acceptable probability that one SDC cannot be rolled back."""
    checkpoint_bytes: _Number | None = None
    storage_budget_bytes: _Number | None = None
    tiers: list[TierRequest] = Field(default=[], max_length=MAX_TIERS)
    radius_mix: dict[str, _Number] | None = None
    """Share of incidents per blast radius (default: all "node")."""
    basin_tolerance: _Number = 0.05

    def as_inputs(self) -> CadenceInputs:
        """The advisor's inputs; ValueError (a 422) for values it refuses."""
        given = self.model_dump(exclude_unset=True, exclude={"tiers"})
        tiers = tuple(TierSpec(**tier.model_dump()) for tier in self.tiers)
        return CadenceInputs(**given, tiers=tiers)
