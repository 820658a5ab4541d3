"""GPU table for the planner: peak dense TFLOP/s, HBM and link bandwidths per GPU type.

Peaks are dense (no sparsity) tensor-core numbers from the vendor datasheets, as listed in
docs/advisors.md. Bandwidths are per GPU and per direction-pair as marketed (NVLink "900 GB/s" on
H100 SXM); the cost model scales them with calibrated efficiencies, so only their ratios matter
much. HBM is the capacity PyTorch sees, in GiB.

    >>> spec = gpu_spec("H100-SXM")
    >>> spec.peak_tflops("fp8")
    1979.0
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(kw_only=True, slots=True, frozen=True)
class GpuSpec:
    """One GPU type and the node it usually sits in."""

    name: str
    """Canonical name, e.g. "H100-SXM"."""
    peak_bf16_tflops: float
    """Dense bf16 tensor-core peak, TFLOP/s."""
    peak_fp8_tflops: float | None
    """Dense fp8 tensor-core peak, TFLOP/s; None when the GPU has no fp8 tensor cores."""
    hbm_gib: float
    """HBM capacity visible to the framework, GiB."""
    intra_node_gbps: float
    """Per-GPU intra-node (NVLink/PCIe) bandwidth, GB/s."""
    inter_node_gbps: float
    """Per-GPU inter-node (InfiniBand/RoCE) bandwidth, GB/s."""
    gpus_per_node: int
    """GPUs sharing the fast intra-node fabric (the NVLink domain)."""

    def __post_init__(self) -> None:
        for field in ("peak_bf16_tflops", "hbm_gib", "intra_node_gbps", "inter_node_gbps"):
            if not getattr(self, field) > 0:
                raise ValueError(f"hardware.{field} must be > 0, got {getattr(self, field)!r}")
        if self.gpus_per_node < 1:
            raise ValueError(f"hardware.gpus_per_node must be >= 1, got {self.gpus_per_node!r}")

    def peak_tflops(self, precision: str) -> float:
        """Peak for the matmul precision; fp8 falls back to bf16 on GPUs without fp8."""
        if precision == "fp8" and self.peak_fp8_tflops is not None:
            return self.peak_fp8_tflops
        return self.peak_bf16_tflops

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * GIB


# Sources: NVIDIA datasheets (A100, H100, H200, B200, GB200 NVL72); the dense peaks match
# stragglers_and_mfu.md. Inter-node: one 200 Gb/s HDR NIC per A100, 400 Gb/s NDR per Hopper GPU,
# 400 Gb/s per B200, 800 Gb/s per GB200 (ConnectX-8). H100 PCIe: PCIe Gen5 x16 between GPUs
# (NVLink bridges join only pairs, so a 4/8-GPU TP group sees PCIe).
GPU_TABLE: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec(
            name="A100",
            peak_bf16_tflops=312.0,
            peak_fp8_tflops=None,
            hbm_gib=80.0,
            intra_node_gbps=600.0,
            inter_node_gbps=25.0,
            gpus_per_node=8,
        ),
        GpuSpec(
            name="H100-SXM",
            peak_bf16_tflops=989.0,
            peak_fp8_tflops=1979.0,
            hbm_gib=80.0,
            intra_node_gbps=900.0,
            inter_node_gbps=50.0,
            gpus_per_node=8,
        ),
        GpuSpec(
            name="H100-PCIe",
            peak_bf16_tflops=756.0,
            peak_fp8_tflops=1513.0,
            hbm_gib=80.0,
            intra_node_gbps=64.0,
            inter_node_gbps=50.0,
            gpus_per_node=8,
        ),
        GpuSpec(
            name="H200",
            peak_bf16_tflops=989.0,
            peak_fp8_tflops=1979.0,
            hbm_gib=140.0,
            intra_node_gbps=900.0,
            inter_node_gbps=50.0,
            gpus_per_node=8,
        ),
        GpuSpec(
            name="B200",
            peak_bf16_tflops=2250.0,
            peak_fp8_tflops=4500.0,
            hbm_gib=180.0,
            intra_node_gbps=1800.0,
            inter_node_gbps=50.0,
            gpus_per_node=8,
        ),
        GpuSpec(
            name="GB200",
            peak_bf16_tflops=2500.0,
            peak_fp8_tflops=5000.0,
            hbm_gib=186.0,
            intra_node_gbps=1800.0,
            inter_node_gbps=100.0,
            gpus_per_node=72,
        ),
    )
}

_ALIASES = {
    "A100-SXM": "A100",
    "A100-80GB": "A100",
    "H100": "H100-SXM",
    "H100SXM": "H100-SXM",
    "H100-SXM5": "H100-SXM",
    "H100PCIE": "H100-PCIe",
    "H200-SXM": "H200",
}


def gpu_spec(name: str) -> GpuSpec:
    """Look a GPU up by name (case-insensitive, a few common aliases); ValueError if unknown."""
    key = name.strip()
    for candidate in (key, key.upper(), _ALIASES.get(key.upper().replace(" ", "-"), "")):
        if candidate in GPU_TABLE:
            return GPU_TABLE[candidate]
    for known in GPU_TABLE:
        if known.upper() == key.upper():
            return GPU_TABLE[known]
    raise ValueError(
        f"hardware.gpu: unknown GPU {name!r}; known: {', '.join(GPU_TABLE)} "
        "(or give peak_tflops, hbm_gib, intra_node_gbps, inter_node_gbps explicitly)"
    )
