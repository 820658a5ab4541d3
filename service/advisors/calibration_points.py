"""Published MFU measurements of dense-transformer training runs: the cost model's calibration data.

One row per published run, with the configuration as printed by its source (docs/advisors.md quotes
each table) and the MFU it reports, as a fraction of n_gpus x dense bf16 peak. `split` says whether
the row is in the fit set (the few hardware constants are fitted on those) or held out (only used to
measure the error). The split is declared here, per row, before any fit: roughly alternate rows of
each table, with the largest-scale and most model-parallel runs held out.

Sources (exact references in docs/advisors.md, "Calibration data"):
- kempnerforge: seed 002, the KempnerForge MFU benchmark, H200, FSDP2 (+TP), full AC, 1-32 GPUs.
- llm_foundry: mosaicml/llm-foundry scripts/train/benchmarking/README.md, MPT models, PyTorch FSDP
  (FULL_SHARD), H100 80GB and A100 80GB, 8-64 GPUs.
- korthikanti2022: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Table 3 (configs) and Table 5 (iteration time, MFU), Megatron-LM TP+PP, A100 80GB,
  8-512 GPUs, selective recompute + sequence parallelism, and the full-recompute baseline.
- llama3: Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4, Llama 3 405B, H100,
  8,192 and 16,384 GPUs, TP8 x PP16 (x CP16), BF16 MFU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True, slots=True, frozen=True)
class CalibrationPoint:
    """One published run: its plan config and the MFU its source reports."""

    label: str
    """Short name, e.g. "llama3 405B 8192 GPUs"."""
    source: str
    """Key of SOURCES."""
    config: Mapping[str, Any]
    """Plan dict (model/parallelism/hardware), fields as the source states them."""
    mfu: float
    """Published MFU, fraction of n_gpus x dense peak."""
    split: str
    """"fit" (constants fitted on it) or "held_out" (error reported on it)."""


SOURCES: dict[str, str] = {
    "kempnerforge": "seed 002 (KempnerForge MFU benchmark, 2026-04-05), H200, 4 GPUs/node",
    "llm_foundry": "mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7), H100/A100 80GB",
    "korthikanti2022": "Korthikanti et al. 2022 (arXiv 2205.05198) Tables 3 and 5, A100 80GB (Selene)",
    "llama3": "Dubey et al. 2024 (arXiv 2407.21783) Table 4, H100 (Grand Teton)",
}


# --- KempnerForge (seed 002): Llama-3 shapes, seq 4096, full AC, FSDP2, 4 H200 per node ---------

_LLAMA = {
    "7B": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn_hidden": 14336},
    "13B": {"layers": 40, "hidden": 5120, "heads": 40, "kv_heads": 8, "ffn_hidden": 17920},
    "70B": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn_hidden": 28672},
}


def _kf(label: str, model: str, gpus: int, tp: int, mfu_pct: float, split: str) -> CalibrationPoint:
    micro, accum = {"7B": (4, 2), "13B": (4, 4), "70B": (2, 4)}[model]
    if model == "7B" and gpus <= 2 and tp == 1:
        micro, accum = 2, 4
    dp = gpus // tp
    config = {
        "model": {**_LLAMA[model], "vocab": 128256, "seq_len": 4096, "gated_mlp": True},
        "parallelism": {"gpus": gpus, "tp": tp, "dp": dp, "zero": "fsdp", "micro_batch": micro,
                        "global_batch": micro * accum * dp, "recompute": "full"},
        "hardware": {"gpu": "H200", "gpus_per_node": 4},
    }
    return CalibrationPoint(label=f"KF {label}", source="kempnerforge", config=config, mfu=mfu_pct / 100,
                            split=split)


_KEMPNERFORGE = (
    # The seven runs seed 002 quotes: the fit set.
    _kf("7B FSDP=4 (4 GPUs)", "7B", 4, 1, 53.8, "fit"),
    _kf("7B TP=4 (4 GPUs)", "7B", 4, 4, 34.7, "fit"),
    _kf("13B FSDP=8 (8 GPUs)", "13B", 8, 1, 44.4, "fit"),
    _kf("13B TP4xFSDP4 (16 GPUs)", "13B", 16, 4, 33.7, "fit"),
    _kf("13B TP4xFSDP8 (32 GPUs)", "13B", 32, 4, 32.7, "fit"),
    _kf("70B TP4xFSDP8 (32 GPUs)", "70B", 32, 4, 25.4, "fit"),
    _kf("7B TP4xFSDP8 (32 GPUs)", "7B", 32, 4, 26.9, "fit"),
    # The other seven rows of the same report.
    _kf("7B 1 GPU", "7B", 1, 1, 57.8, "held_out"),
    _kf("7B FSDP=2 (2 GPUs)", "7B", 2, 1, 51.7, "held_out"),
    _kf("7B TP=2 (2 GPUs)", "7B", 2, 2, 36.4, "held_out"),
    _kf("7B TP2xFSDP2 (4 GPUs)", "7B", 4, 2, 35.9, "held_out"),
    _kf("7B TP4xFSDP2 (8 GPUs)", "7B", 8, 4, 30.6, "held_out"),
    _kf("13B TP4xFSDP2 (8 GPUs)", "13B", 8, 4, 34.3, "held_out"),
    _kf("7B TP4xFSDP4 (16 GPUs)", "7B", 16, 4, 28.6, "held_out"),
)


# --- llm-foundry: MPT (GELU MLP 4d, tied embeddings, vocab 50368), FSDP FULL_SHARD, bf16 ----------

_MPT = {  # d_model, n_layers, n_heads (llm-foundry yamls); NumParams is quoted per row
    "125m": (768, 12, 12), "760m": (1536, 24, 12), "1b": (2048, 24, 16), "3b": (2560, 32, 20),
    "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 48, 64), "70b": (8192, 80, 64),
}


def _mpt(gpu: str, model: str, seq: int, gpus: int, mfu_pct: float, micro: int, accum: int, ckpt: bool,
         params: int, split: str) -> CalibrationPoint:
    hidden, layers, heads = _MPT[model]
    config = {
        "model": {"layers": layers, "hidden": hidden, "heads": heads, "vocab": 50368, "seq_len": seq,
                  "gated_mlp": False, "ffn_hidden": 4 * hidden, "tied_embeddings": True, "params": params},
        "parallelism": {"gpus": gpus, "zero": "fsdp", "micro_batch": micro,
                        "global_batch": micro * accum * gpus, "recompute": "full" if ckpt else "none"},
        "hardware": {"gpu": gpu},
    }
    name = "H100" if gpu == "H100-SXM" else gpu
    return CalibrationPoint(label=f"MPT {model} seq {seq} {gpus}x{name}", source="llm_foundry", config=config,
                            mfu=mfu_pct / 100, split=split)


_LLM_FOUNDRY = (
    # H100 80GB BF16 table: model, seq, GPUs, MFU, micro, accum, activation checkpointing, NumParams.
    _mpt("H100-SXM", "70b", 2048, 64, 42.57, 8, 4, True, 64862437376, "held_out"),
    _mpt("H100-SXM", "70b", 2048, 32, 36.15, 2, 16, True, 64862437376, "fit"),
    _mpt("H100-SXM", "30b", 2048, 32, 43.92, 14, 3, True, 29975214080, "held_out"),
    _mpt("H100-SXM", "30b", 2048, 8, 38.11, 3, 21, True, 29975214080, "fit"),
    _mpt("H100-SXM", "30b", 8192, 8, 29.92, 1, 21, True, 30019254272, "held_out"),
    _mpt("H100-SXM", "13b", 2048, 64, 39.86, 2, 1, False, 12853954560, "fit"),
    _mpt("H100-SXM", "13b", 4096, 8, 41.6, 10, 3, True, 12864440320, "held_out"),
    _mpt("H100-SXM", "7b", 2048, 8, 46.44, 6, 1, False, 6658859008, "fit"),
    _mpt("H100-SXM", "7b", 4096, 8, 40.42, 16, 2, True, 6667247616, "held_out"),
    _mpt("H100-SXM", "7b", 32768, 8, 30.94, 2, 2, True, 6784688128, "fit"),
    _mpt("H100-SXM", "3b", 2048, 64, 40.8, 6, 3, False, 2651837440, "held_out"),
    _mpt("H100-SXM", "1b", 2048, 64, 40.85, 20, 1, False, 1315950592, "fit"),
    _mpt("H100-SXM", "760m", 2048, 32, 37.57, 24, 1, False, 760470528, "held_out"),
    # A100 80GB table (1600 Gbps RoCE per node).
    _mpt("A100", "70b", 2048, 64, 53.33, 8, 4, True, 64862437376, "held_out"),
    _mpt("A100", "70b", 2048, 32, 48.56, 2, 16, True, 64862437376, "fit"),
    _mpt("A100", "30b", 2048, 8, 55.3, 3, 21, True, 29975214080, "held_out"),
    _mpt("A100", "30b", 8192, 8, 39.38, 1, 21, True, 30019254272, "fit"),
    _mpt("A100", "13b", 4096, 8, 57.62, 10, 3, True, 12864440320, "held_out"),
    _mpt("A100", "13b", 32768, 8, 51.69, 1, 3, True, 13011240960, "fit"),
    _mpt("A100", "7b", 2048, 8, 64.23, 6, 2, False, 6658859008, "held_out"),
    _mpt("A100", "7b", 8192, 8, 54.47, 8, 2, True, 6684024832, "fit"),
    _mpt("A100", "3b", 2048, 8, 62.11, 10, 2, False, 2651837440, "held_out"),
    _mpt("A100", "1b", 2048, 8, 59.86, 14, 4, False, 1315950592, "fit"),
    _mpt("A100", "125m", 2048, 8, 44.79, 40, 2, False, 125311488, "held_out"),
)


# --- Korthikanti et al. 2022: GPT (vocab 51200, seq 2048), Megatron-LM TP + PP, A100 80GB --------

_GPT = {  # Table 3: heads, hidden, layers, TP, PP, GPUs, global batch, micro batch
    "22B": (64, 6144, 48, 8, 1, 8, 4, 4),
    "175B": (96, 12288, 96, 8, 8, 64, 64, 1),
    "530B": (128, 20480, 105, 8, 35, 280, 280, 1),
    "1T": (160, 25600, 128, 8, 64, 512, 512, 1),
}


def _gpt(model: str, selective: bool, mfu_pct: float, split: str) -> CalibrationPoint:
    heads, hidden, layers, tp, pp, gpus, gbs, mbs = _GPT[model]
    par: dict[str, Any] = {"gpus": gpus, "tp": tp, "pp": pp, "micro_batch": mbs, "global_batch": gbs,
                           "recompute": "selective" if selective else "full"}
    if not selective:  # the baseline of Table 5: full recompute, TP without sequence parallelism
        par["sequence_parallel"] = False
    config = {
        "model": {"layers": layers, "hidden": hidden, "heads": heads, "vocab": 51200, "seq_len": 2048,
                  "gated_mlp": False, "ffn_hidden": 4 * hidden, "tied_embeddings": True},
        "parallelism": par,
        "hardware": {"gpu": "A100"},
    }
    how = "selective+SP" if selective else "full recompute"
    return CalibrationPoint(label=f"GPT {model} {gpus}xA100 {how}", source="korthikanti2022", config=config,
                            mfu=mfu_pct / 100, split=split)


# Table 5: selective + SP MFU 41.5 / 51.4 / 56.0 / 56.3 %; the full-recompute baseline's MFU is that
# times the iteration-time ratio (1.10/1.42, 13.75/18.13, 37.83/49.05, 71.49/94.42).
_KORTHIKANTI = (
    _gpt("22B", True, 41.5, "held_out"),
    _gpt("175B", True, 51.4, "fit"),
    _gpt("530B", True, 56.0, "held_out"),
    _gpt("1T", True, 56.3, "fit"),
    _gpt("22B", False, 41.5 * 1.10 / 1.42, "held_out"),
    _gpt("175B", False, 51.4 * 13.75 / 18.13, "held_out"),
    _gpt("530B", False, 56.0 * 37.83 / 49.05, "held_out"),
    _gpt("1T", False, 56.3 * 71.49 / 94.42, "held_out"),
)


# --- Llama 3 405B (Dubey et al. 2024, Table 4) -----------------------------------------------------

_LLAMA3_405B = {"layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8, "ffn_hidden": 53248,
                "vocab": 128256, "gated_mlp": True}


def _llama3(gpus: int, cp: int, pp: int, dp: int, seq: int, batch_per_dp: int, mfu_pct: float,
            split: str) -> CalibrationPoint:
    config = {
        "model": {**_LLAMA3_405B, "seq_len": seq},
        # 126 layers on 16 stages (one fewer on the first and last). Section 3.3.2: FSDP, parameters
        # not resharded after forward (with PP: one gather and one reduce-scatter per step).
        "parallelism": {"gpus": gpus, "tp": 8, "cp": cp, "pp": pp, "dp": dp, "zero": "fsdp", "micro_batch": 1,
                        "global_batch": batch_per_dp * dp, "uneven_stages": True},
        "hardware": {"gpu": "H100-SXM"},
    }
    label = f"Llama3 405B {gpus}xH100 TP8 CP{cp} PP{pp} DP{dp} seq {seq}"
    return CalibrationPoint(label=label, source="llama3", config=config, mfu=mfu_pct / 100, split=split)


_LLAMA3 = (
    _llama3(8192, 1, 16, 64, 8192, 32, 43.0, "fit"),
    _llama3(16384, 1, 16, 128, 8192, 16, 41.0, "held_out"),
    _llama3(16384, 16, 16, 8, 131072, 16, 38.0, "held_out"),
)


POINTS: tuple[CalibrationPoint, ...] = _KEMPNERFORGE + _LLM_FOUNDRY + _KORTHIKANTI + _LLAMA3
"""Every calibration point, fit and held-out."""


def fit_points() -> tuple[CalibrationPoint, ...]:
    return tuple(p for p in POINTS if p.split == "fit")


def held_out_points() -> tuple[CalibrationPoint, ...]:
    return tuple(p for p in POINTS if p.split == "held_out")
