"""The ladder table of seed 000, reproduced by the recommender."""

from trainvitals.service.advisors.model_config import ModelConfig, parse_hardware, parse_model
from trainvitals.service.advisors.recommend import recommend

H100 = parse_hardware({"hardware": {"gpu": "H100-SXM"}})


def _model(**kw: object) -> ModelConfig:
    return parse_model({"model": {"vocab": 128256, "seq_len": 8192, **kw}})


M7 = _model(layers=32, hidden=4096, heads=32, params=7e9)
M70 = _model(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, params=70e9)
M405 = _model(layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, params=405e9)
M_SPARSE = _model(layers=120, hidden=16384, heads=128, kv_heads=8, ffn_hidden=4096, experts=64,
                  active_experts=2)


def _walls(rec: object) -> list[tuple[str, str]]:
    return [(s.wall, s.axis) for s in rec.steps]  # type: ignore[attr-defined]


def test_rung0_7b_on_8() -> None:
    rec = recommend(model=M7, hardware=H100, gpus=8)
    c = rec.config
    assert rec.feasible and (c.tp, c.pp, c.dp, c.zero) == (1, 1, 8, 3)
    assert _walls(rec) == [("state > 1 GPU", "FSDP/ZeRO-3")]


def test_rung1_70b_on_one_node_is_infeasible() -> None:
    rec = recommend(model=M70, hardware=H100, gpus=8)
    assert not rec.feasible and rec.config is None
    assert _walls(rec)[-1] == ("state > 1 node", "(forces multi-node)")
    assert rec.min_gpus is not None and 16 < rec.min_gpus <= 64 and rec.min_gpus % 8 == 0


def test_rung2_70b_on_256() -> None:
    rec = recommend(model=M70, hardware=H100, gpus=256)
    c = rec.config
    assert (c.tp, c.pp, c.dp) == (8, 1, 32)
    assert _walls(rec)[-1] == ("weights/GPU", "TP + FSDP")
    assert not any("useful data-parallel" in w for w in rec.warnings)  # dp=32: under the 2M cap


def test_rung3_405b_on_2048_then_the_bubble() -> None:
    rec = recommend(model=M405, hardware=H100, gpus=2048, global_batch_tokens=1024 * 8192)
    c = rec.config
    assert (c.tp, c.pp, c.dp, c.micro_batches) == (8, 16, 16, 64)
    assert _walls(rec)[-1] == ("weights > TP alone", "+ PP")
    assert any("pipeline bubble 19%" in w for w in rec.warnings)  # 15/79, as in seed 000
    assert rec.result is not None and rec.result.step.bubble_s > 0.1 * rec.result.step.total_s


def test_rung4_sparse_trillion_uses_every_axis() -> None:
    assert M_SPARSE.params_total > 1e12
    rec = recommend(model=M_SPARSE, hardware=H100, gpus=4096, global_batch_tokens=16 * 2**20)
    c = rec.config
    assert ("6N compute/token", "+ EP (MoE)") in _walls(rec)
    assert c.tp == 8 and c.pp > 1 and c.dp > 1 and c.ep > 1 and c.dp % c.ep == 0


def test_405b_on_64_reports_minimum() -> None:
    rec = recommend(model=M405, hardware=H100, gpus=64)
    assert not rec.feasible
    assert rec.min_gpus is not None and rec.min_gpus >= 16 * 405e9 / (60 * 2**30)
    assert recommend(model=M405, hardware=H100, gpus=rec.min_gpus).feasible
    assert not recommend(model=M405, hardware=H100, gpus=rec.min_gpus - 8).feasible


def test_7b_on_4096_warns_past_dp_cap() -> None:
    rec = recommend(model=_model(layers=32, hidden=4096, heads=32, params=7e9, seq_len=4096),
                    hardware=H100, gpus=4096)
    assert rec.feasible and rec.config.dp == 4096
    assert any("past the useful data-parallel size" in w for w in rec.warnings)
    assert rec.useful_gpus == 512  # 2M tokens / 4096 tokens per sequence


def test_70b_on_32_h200_picks_seed002_layout() -> None:
    h200 = parse_hardware({"hardware": {"gpu": "H200", "gpus_per_node": 4}})
    model = parse_model({"model": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8,
                                   "ffn_hidden": 28672, "vocab": 128256, "seq_len": 4096}})
    rec = recommend(model=model, hardware=h200, gpus=32, micro_batch=2, recompute="full",
                    global_batch_tokens=64 * 4096)
    assert (rec.config.tp, rec.config.dp) == (4, 8)  # KempnerForge's "70B needs TP": TP=4 x FSDP=8
