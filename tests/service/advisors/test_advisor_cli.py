"""CLI: plan and advise through main(argv), JSON output, exit codes."""

import json
from pathlib import Path

import numpy as np
import pytest

from trainvitals.service.advisors.cli import main

CONFIG = """
model: {layers: 80, hidden: 8192, heads: 64, kv_heads: 8, ffn_hidden: 28672, vocab: 128256, seq_len: 4096}
parallelism: {gpus: 32, tp: 4, zero: fsdp, micro_batch: 2, global_batch: 64, recompute: full}
hardware: {gpu: H200, gpus_per_node: 4}
"""


def test_plan_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG)
    assert main(["plan", "--config", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["memory"]) >= {"params_gib", "grads_gib", "optimizer_gib", "activations_gib",
                                  "overhead_gib", "fits"}
    assert out["mfu"]["low"] < out["mfu"]["predicted"] < out["mfu"]["high"]
    assert out["mfu"]["predicted"] == pytest.approx(0.254, rel=0.12)  # measured 25.4%
    assert out["binding_wall"] in {"compute", "dp_comm", "tp_comm", "pp_bubble", "ep_comm", "memory"}


def test_plan_json_file_does_not_fit_and_bad_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {"model": {"layers": 80, "hidden": 8192, "heads": 64, "vocab": 32000, "seq_len": 4096},
           "parallelism": {"gpus": 8}, "hardware": {"gpu": "H100-SXM"}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    assert main(["plan", "--config", str(path)]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    cfg["parallelism"]["tp"] = 3
    path.write_text(json.dumps(cfg))
    assert main(["plan", "--config", str(path)]) == 2
    assert "parallelism.gpus" in capsys.readouterr().err


def test_plan_recommend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("model: {layers: 80, hidden: 8192, heads: 64, kv_heads: 8, ffn_hidden: 28672, "
                    "vocab: 128256, seq_len: 8192, params: 7.0e10}\n"
                    "parallelism: {gpus: 256}\nhardware: {gpu: H100-SXM}\n")
    assert main(["plan", "--config", str(path), "--recommend", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["config"]["tp"], out["config"]["dp"]) == (8, 32)
    assert out["ladder"][-1]["wall"] == "weights/GPU" and out["mfu"]["predicted"] > 0


SMALL = {"model": {"layers": 32, "hidden": 4096, "heads": 32, "vocab": 32000, "seq_len": 4096, "params": 7e9},
         "hardware": {"gpu": "H100-SXM"}}


@pytest.mark.parametrize(("parallelism", "message"), [
    ({"gpus": 8, "micro_batch": 0}, "parallelism.micro_batch: must be >= 1, got 0"),
    ({"gpus": 8, "micro_batch": -2}, "parallelism.micro_batch: must be >= 1, got -2"),
    ({"gpus": 8, "global_batch": "512"}, "parallelism.global_batch: must be an integer, got '512'"),
    ({"gpus": 8, "recompute": "most"}, "parallelism.recompute: must be one of"),
    ({"gpus": 8, "bogus": 1}, "parallelism.bogus: unknown key"),
    ([8], "parallelism: must be a mapping of keys to values, got [8]"),
    ({"gpus": 0}, "parallelism.gpus: must be >= 1, got 0"),
])
def test_plan_recommend_refuses_bad_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], parallelism: object, message: str
) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({**SMALL, "parallelism": parallelism}))
    assert main(["plan", "--config", str(path), "--recommend"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trainvitals plan: {message}") and err.count("\n") == 1


def test_plan_recommend_takes_null_as_unset_and_checks_the_gpu_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({**SMALL, "parallelism": {"gpus": 8, "micro_batch": None, "tp": 2}}))
    assert main(["plan", "--config", str(path), "--recommend", "--json"]) == 0  # tp: a plan key, taken and not read
    assert json.loads(capsys.readouterr().out)["config"]["micro_batch"] == 1
    path.write_text(json.dumps({**SMALL, "parallelism": {"gpus": 8}, "hardware": {"gpu": "H100-SXM", "gpus": 16}}))
    assert main(["plan", "--config", str(path), "--recommend"]) == 2
    assert "hardware.gpus: 16 != parallelism.gpus: 8" in capsys.readouterr().err


def test_advise_with_mtbf_and_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["advise", "--json", "--stall-s", "60", "--mtbf-h", "4", "--sdc-latency-h", "1",
               "--risk", "0.05", "--tier", "peer_ram:5:node", "--tier", "pfs:60:cluster",
               "--radius-mix", "node=0.9,rack=0.1"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended_interval_s"] == pytest.approx(out["optimal_interval_s"])
    assert out["band_s"][0] < out["recommended_interval_s"] < out["band_s"][1]
    assert [t["name"] for t in out["tiers"]] == ["peer_ram", "pfs"]
    assert out["retention"]["keep"] >= 2


def test_advise_from_event_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    starts = np.cumsum(np.random.default_rng(3).exponential(4 * 3600, 59))
    lines = ["timestamp,nodes,domains"]
    lines += [f"{t + j * 5:.0f},n{j},rack=r{i % 4}" for i, t in enumerate(starts) for j in range(4)]
    path = tmp_path / "events.csv"
    path.write_text("\n".join(lines) + "\n")
    assert main(["advise", "--json", "--stall-s", "60", "--events", str(path),
                 "--exposure-h", f"{starts[-1] / 3600 + 1:.1f}"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["log"]["incidents"] <= 59 and out["log"]["cluster_factor"] >= 4.0
    assert out["confidence_band_s"][0] < out["recommended_interval_s"] < out["confidence_band_s"][1]
    assert main(["advise", "--stall-s", "60"]) == 2
    assert "--mtbf" in capsys.readouterr().err
