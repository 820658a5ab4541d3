"""Cost model: calibration on seed 002, its error, and the shape of the predictions."""

import pytest

from trainvitals.service.advisors.cost_model import (
    DEFAULT_CALIBRATION,
    HELD_OUT_ROWS,
    SEED_002_ROWS,
    calibrate,
    model_flops_per_token,
    plan,
    predict_mfu,
    relative_errors,
)
from trainvitals.service.advisors.model_config import parse_plan_input


def test_frozen_constants_match_the_fit() -> None:
    fitted = calibrate(SEED_002_ROWS)
    for name in ("eta", "tp_efficiency", "dp_exposed", "band", "mean_abs_error", "loo_max_abs_error"):
        assert getattr(fitted, name) == pytest.approx(getattr(DEFAULT_CALIBRATION, name), abs=5e-4), name


def test_fit_error_on_seed_002() -> None:
    # Docs report: in-sample mean 5.0% / max 9.2%; leave-one-out mean 8.3% / max 11.7%.
    errors = abs(relative_errors(DEFAULT_CALIBRATION, SEED_002_ROWS))
    assert errors.mean() < 0.055 and errors.max() < 0.10
    assert DEFAULT_CALIBRATION.loo_mean_abs_error < 0.09 and DEFAULT_CALIBRATION.loo_max_abs_error < 0.12


def test_held_out_rows_of_the_same_benchmark() -> None:
    errors = abs(relative_errors(DEFAULT_CALIBRATION, HELD_OUT_ROWS))
    assert errors.max() < 0.06  # within the band the prediction advertises
    assert errors.max() < DEFAULT_CALIBRATION.band


def test_flop_convention_matches_measured_tokens_per_second() -> None:
    # KempnerForge 7B FSDP=4: 38,983 tok/s <-> 53.8% MFU on 4 x 989 TFLOP/s.
    row = SEED_002_ROWS[0]
    flops = model_flops_per_token(parse_plan_input(row.config))
    assert 38_983 * flops / (4 * 989e12) == pytest.approx(0.538, abs=0.002)


def test_measured_values_fall_inside_predicted_band() -> None:
    for row in SEED_002_ROWS:
        mfu = plan(parse_plan_input(row.config)).mfu
        assert mfu.low <= row.mfu <= mfu.high, row.label


def test_fsdp_beats_tp_in_node_and_node_boundary_costs() -> None:
    fsdp, tp = (plan(parse_plan_input(r.config)) for r in SEED_002_ROWS[:2])
    assert fsdp.mfu.predicted > 1.4 * tp.mfu.predicted
    assert fsdp.binding_wall == "compute"
    cross = plan(parse_plan_input(SEED_002_ROWS[6].config))  # 7B TP4 x FSDP8 over 8 nodes
    assert cross.binding_wall == "dp_comm" and cross.step.dp_comm_exposed_s > 0


def _pp_config(pp: int, global_batch: int) -> dict:
    return {"model": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn_hidden": 28672,
                      "vocab": 128256, "seq_len": 4096},
            "parallelism": {"gpus": 64, "tp": 8, "pp": pp, "zero": 1, "global_batch": global_batch},
            "hardware": {"gpu": "H100-SXM"}}


def test_bubble_follows_p_minus_1_over_m() -> None:
    r = plan(parse_plan_input(_pp_config(4, 32)))  # dp = 2, m = 16
    critical = r.step.compute_s + r.step.tp_comm_s + r.step.pp_comm_s
    assert r.step.bubble_s == pytest.approx(critical * 3 / 16)
    more = plan(parse_plan_input(_pp_config(4, 128)))
    assert more.step.bubble_s / more.step.total_s < r.step.bubble_s / r.step.total_s


def test_predict_mfu_for_registration_dict() -> None:
    registration = dict(SEED_002_ROWS[4].config)
    registration = {**registration, "fp8": {"format": "hybrid"}, "run_id": "r1"}
    mfu = predict_mfu(registration)
    assert mfu.calibrated and mfu.low < mfu.predicted < mfu.high
    assert mfu.predicted == pytest.approx(0.327, rel=DEFAULT_CALIBRATION.band)
    b200 = {**registration, "hardware": {"gpu": "B200"}}
    assert not predict_mfu(b200).calibrated and predict_mfu(b200).high / predict_mfu(b200).predicted == 1.3
    with pytest.raises(ValueError, match=r"parallelism\.gpus: 32 is not divisible by tp\*pp\*cp = 3"):
        predict_mfu({**registration, "parallelism": {"gpus": 32, "tp": 3}})


def test_moe_counts_active_parameters_only() -> None:
    cfg = {"model": {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 32000, "seq_len": 4096,
                     "ffn_hidden": 5632, "experts": 8, "active_experts": 2},
           "parallelism": {"gpus": 32, "tp": 4, "ep": 2}, "hardware": {"gpu": "H200", "gpus_per_node": 4}}
    r = plan(parse_plan_input(cfg))
    assert r.params_active < 0.4 * r.params_total and r.step.ep_comm_s > 0
