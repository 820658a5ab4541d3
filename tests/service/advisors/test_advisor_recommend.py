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
    # ZeRO-1 does not fit; ZeRO-2 and FSDP both hide their traffic in NVLink: the lighter one wins.
    assert rec.feasible and (c.tp, c.pp, c.dp, c.zero) == (1, 1, 8, 2)
    assert _walls(rec) == [("state > 1 GPU", "ZeRO/FSDP sharding")]
    assert "ZeRO-1: does not fit" in rec.steps[0].detail


def test_rung1_70b_on_one_node_is_infeasible() -> None:
    rec = recommend(model=M70, hardware=H100, gpus=8)
    assert not rec.feasible and rec.config is None
    assert _walls(rec)[-1] == ("state > 1 node", "(forces multi-node)")
    assert rec.min_gpus is not None and 16 < rec.min_gpus <= 64 and rec.min_gpus % 8 == 0


def test_rung2_70b_on_256() -> None:
    rec = recommend(model=M70, hardware=H100, gpus=256)
    c = rec.config
    assert (c.tp, c.pp, c.dp, c.zero) == (8, 1, 32, 1)  # ZeRO-1: FSDP's per-micro-batch gathers cost more
    assert _walls(rec)[-1] == ("weights/GPU", "TP + sharding")
    assert not any("useful data-parallel" in w for w in rec.warnings)  # dp=32: under the 2M cap


def test_rung3_405b_on_2048_then_the_bubble() -> None:
    rec = recommend(model=M405, hardware=H100, gpus=2048, global_batch_tokens=1024 * 8192)
    c = rec.config
    assert (c.tp, c.pp, c.dp, c.micro_batches) == (8, 16, 16, 64)
    # TP8 x FSDP=256 fits too, but moves the weights across nodes every micro-batch: the ladder holds
    # it, climbs to PP, and keeps the faster layout.
    assert ("exposed DP traffic", "(climb on)") in _walls(rec)
    # 126 layers: only pp=1 and 2 divide them among the degrees 256 GPUs allow, and neither fits.
    assert c.uneven_stages and _walls(rec)[-2:] == [("weights > TP alone", "+ PP"),
                                                    ("no pp dividing 126 layers fits", "uneven stages")]
    assert "the fullest stage holds 8 layers vs 7.88 on average (+1.6% step time)" in rec.steps[-1].detail
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


def test_70b_on_32_h200_fits_fsdp_alone() -> None:
    # Seed 002: "FSDP wins until it can't fit". Gathering two blocks at a time (not the whole model),
    # 70B under FSDP=32 with full recompute holds ~55 GiB of 105 usable on an H200 (llm-foundry ran
    # MPT-70b FSDP-only on 32 80-GB H100s), so the ladder stops at the sharding rung. KempnerForge
    # measured TP=4 x FSDP=8 (25.4% MFU) but not FSDP=32; it said "70B needs TP" from the former.
    h200 = parse_hardware({"hardware": {"gpu": "H200", "gpus_per_node": 4}})
    model = parse_model({"model": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8,
                                   "ffn_hidden": 28672, "vocab": 128256, "seq_len": 4096}})
    rec = recommend(model=model, hardware=h200, gpus=32, micro_batch=2, recompute="full",
                    global_batch_tokens=64 * 4096)
    assert (rec.config.tp, rec.config.dp, rec.config.zero) == (1, 32, 3)
    assert _walls(rec) == [("state > 1 GPU", "ZeRO/FSDP sharding")]


def test_seed003_long_sequence_takes_a_cp_rung() -> None:
    # 7B at 128K tokens on 64 H100: TP8 alone leaves no room for the activations; CP splits them.
    m = _model(layers=32, hidden=4096, heads=32, params=7e9, seq_len=131072)
    rec = recommend(model=m, hardware=H100, gpus=64, global_batch_tokens=4 * 2**20)
    c = rec.config
    assert ("activations/GPU (long sequence)", "+ CP (ring attention)") in _walls(rec)
    assert (c.tp, c.cp, c.pp, c.dp, c.zero) == (8, 2, 1, 4, 1)  # seed 003: TP8, CP, DP4, ZeRO-1
    assert rec.result is not None and rec.result.step.cp_comm_s == 0  # ring hidden behind attention


def test_pipeline_degrees_divide_the_layers_when_one_fits() -> None:
    # 768 GPUs / tp 8 = 96 allows pp = 3, 6, 12, 24, ...; of those only powers of 2 divide 128 layers.
    m = _model(layers=128, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, params=405e9)
    rec = recommend(model=m, hardware=H100, gpus=768, global_batch_tokens=2**22)
    c = rec.config
    assert c.pp > 2 and 128 % c.pp == 0 and not c.uneven_stages
    assert not any(s.axis == "uneven stages" for s in rec.steps)


def test_sharding_is_the_fastest_fitting_candidate() -> None:
    from trainvitals.service.advisors.cost_model import plan
    from trainvitals.service.advisors.memory import per_gpu_memory
    from trainvitals.service.advisors.recommend import _layout

    rec = recommend(model=M70, hardware=H100, gpus=256)
    c = rec.config
    rivals = [_layout(M70, H100, gpus=256, tp=c.tp, pp=c.pp, ep=1, zero=z, micro_batch=1,
                      global_tokens=2 * 2**20, recompute="selective") for z in (1, 2, 3)]
    fitting = [r for r in rivals if r is not None and per_gpu_memory(r).fits]
    fastest = max(fitting, key=lambda r: plan(r).tokens_per_s)
    assert c.zero == fastest.parallelism.zero and len(fitting) == 3


def test_useful_gpus_count_a_replicas_context_parallel_ranks() -> None:
    """An 8B model at 128k tokens a sequence is laid out tp 8 x cp 2: at the critical batch (4
    sequences, one per data-parallel replica) every one of the 64 GPUs is useful; CP was left out
    of a replica's GPUs, which read 32."""
    long = _model(layers=32, hidden=4096, heads=32, kv_heads=8, params=8e9, seq_len=131072)
    rec = recommend(model=long, hardware=H100, gpus=64, critical_batch_tokens=4 * 131072)
    c = rec.config
    assert (c.tp, c.cp, c.dp, c.pp) == (8, 2, 4, 1)
    assert rec.useful_gpus == 64


def test_tp_respects_the_kv_heads() -> None:
    # 12 query heads, 4 KV heads on 48 GPUs: tp=6 divides the heads and the GPUs but splits KV heads
    # in halves; the largest degree that keeps whole (or replicated) KV heads is 4.
    m = _model(layers=96, hidden=12288, heads=12, kv_heads=4, params=175e9)
    rec = recommend(model=m, hardware=H100, gpus=48)
    tp_step = next(s for s in rec.steps if s.wall == "weights/GPU")
    assert "tp=4 splits both" in tp_step.detail
    assert rec.config is None or rec.config.tp == 4
