"""Advisors: predicted memory/MFU for a parallelism config and checkpoint-cadence advice.

Pure functions over configs and event logs (no I/O except `load_events` and the CLI).

    >>> from trainvitals.service.advisors import advise_cadence, CadenceInputs
    >>> advice = advise_cadence(CadenceInputs(stall_s=60, mtbf_s=4 * 3600))
    >>> round(advice.recommended_interval_s / 60)
    21
"""

from trainvitals.service.advisors.cadence import (
    CadenceAdvice,
    CadenceInputs,
    RetentionAdvice,
    TierSpec,
    advise_cadence,
    advise_from_records,
    advise_retention,
    daly_higher_order,
    expected_waste,
    flat_basin_band,
    irrecoverable_probability,
    optimal_interval,
    young_interval,
)
from trainvitals.service.advisors.calibration import calibrate
from trainvitals.service.advisors.cost_model import (
    DEFAULT_CALIBRATION,
    Calibration,
    MfuPrediction,
    PlanResult,
    plan,
    predict_mfu,
)
from trainvitals.service.advisors.failure_log import (
    FailureEvent,
    LogAnalysis,
    analyze_log,
    load_events,
    merge_incidents,
    parse_event,
)
from trainvitals.service.advisors.hardware import GPU_TABLE, GpuSpec, gpu_spec
from trainvitals.service.advisors.memory import MemoryBreakdown, per_gpu_memory, training_step_bytes
from trainvitals.service.advisors.model_config import PlanInput, parse_plan_input
from trainvitals.service.advisors.recommend import Recommendation, recommend

__all__ = [
    "CadenceAdvice",
    "CadenceInputs",
    "Calibration",
    "DEFAULT_CALIBRATION",
    "FailureEvent",
    "GPU_TABLE",
    "GpuSpec",
    "LogAnalysis",
    "MemoryBreakdown",
    "MfuPrediction",
    "PlanInput",
    "PlanResult",
    "Recommendation",
    "RetentionAdvice",
    "TierSpec",
    "advise_cadence",
    "advise_from_records",
    "advise_retention",
    "analyze_log",
    "calibrate",
    "daly_higher_order",
    "expected_waste",
    "flat_basin_band",
    "gpu_spec",
    "irrecoverable_probability",
    "load_events",
    "merge_incidents",
    "optimal_interval",
    "parse_event",
    "parse_plan_input",
    "per_gpu_memory",
    "plan",
    "predict_mfu",
    "recommend",
    "training_step_bytes",
    "young_interval",
]
