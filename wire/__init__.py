"""Wire format shared by the agent and the collector (see docs/wire-format.md)."""

from trainvitals.wire.v1 import (
    MAX_RECORDS_PER_BATCH,
    WIRE_VERSION,
    Batch,
    BatchAck,
    CheckpointRecord,
    CheckpointSettings,
    EventRecord,
    Fp8Recipe,
    GradRecord,
    Hardware,
    ModelDims,
    Parallelism,
    Record,
    RunRegistration,
    StepRecord,
    TensorRecord,
)

__all__ = [
    "MAX_RECORDS_PER_BATCH",
    "WIRE_VERSION",
    "Batch",
    "BatchAck",
    "CheckpointRecord",
    "CheckpointSettings",
    "EventRecord",
    "Fp8Recipe",
    "GradRecord",
    "Hardware",
    "ModelDims",
    "Parallelism",
    "Record",
    "RunRegistration",
    "StepRecord",
    "TensorRecord",
]
