"""Plan-input parsing: defaults, aliases, and errors that name the bad key."""

import pytest

from trainvitals.service.advisors.hardware import GPU_TABLE, gpu_spec
from trainvitals.service.advisors.model_config import default_ffn_hidden, parse_plan_input


def _cfg(**par: object) -> dict:
    return {"model": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "vocab": 128256,
                      "seq_len": 4096, "ffn_hidden": 14336},
            "parallelism": {"gpus": 16, **par}, "hardware": {"gpu": "H100-SXM"}}


def test_gpu_table_peaks_match_reference() -> None:
    peaks = {name: (s.peak_bf16_tflops, s.peak_fp8_tflops) for name, s in GPU_TABLE.items()}
    assert peaks == {"A100": (312.0, None), "H100-SXM": (989.0, 1979.0), "H100-PCIe": (756.0, 1513.0),
                     "H200": (989.0, 1979.0), "B200": (2250.0, 4500.0), "GB200": (2500.0, 5000.0)}
    assert gpu_spec("h100").name == "H100-SXM"
    assert gpu_spec("A100").peak_tflops("fp8") == 312.0  # no fp8 tensor cores: bf16 peak


def test_unknown_gpu_names_key() -> None:
    with pytest.raises(ValueError, match=r"hardware\.gpu: unknown GPU 'V100'"):
        gpu_spec("V100")


def test_derived_dp_and_defaults() -> None:
    p = parse_plan_input(_cfg(tp=2, pp=2))
    assert (p.parallelism.dp, p.parallelism.zero, p.parallelism.recompute) == (4, 1, "selective")
    assert p.parallelism.global_batch == 4  # one micro-batch per data-parallel rank
    assert p.parallelism.framework == "megatron" and p.parallelism.sequence_parallel
    # Every unstated field that changes the prediction is named with the value taken and why.
    stated = {d.split(":")[0] for d in p.defaults}
    assert {"zero", "vpp", "recompute", "micro_batch", "global_batch", "sequence_parallel",
            "framework", "overlap_dp_comm"} <= stated
    assert any(d.startswith("zero: 1 (") and "distributed optimizer" in d for d in p.defaults)
    assert parse_plan_input(_cfg()).parallelism.zero == 3  # pure data parallelism: FSDP
    assert not any(d.startswith("zero") for d in parse_plan_input(_cfg(zero=2)).defaults)
    assert round(p.model.params_total / 1e9, 2) == 8.03  # Llama-3 8B shape
    assert p.hardware.gpus_per_node == 8


def test_default_vpp_interleaves_when_the_schedule_allows() -> None:
    # 32 layers on pp=2: 16 per stage -> 8 virtual stages of 2 layers, m = 8 is a multiple of pp.
    p = parse_plan_input(_cfg(tp=2, pp=2, global_batch=32))
    assert p.parallelism.vpp == 8 and any(d.startswith("vpp: 8 (interleaved") for d in p.defaults)
    odd = parse_plan_input(_cfg(tp=2, pp=2, global_batch=12))  # m = 3: Megatron cannot interleave
    assert odd.parallelism.vpp == 1 and any("not a multiple of pp=2" in d for d in odd.defaults)
    assert parse_plan_input(_cfg(tp=2, pp=2, vpp=2, global_batch=32)).parallelism.vpp == 2


def test_pp_must_divide_layers_unless_uneven() -> None:
    with pytest.raises(ValueError, match=r"parallelism\.pp: pp=3 does not divide model\.layers=32; .*uneven_stages"):
        parse_plan_input(_cfg(gpus=12, pp=3))
    p = parse_plan_input(_cfg(gpus=12, pp=3, uneven_stages=True))
    assert p.stage_layers == 11
    with pytest.raises(ValueError, match=r"pp\*vpp=2\*3 does not divide model\.layers=32"):
        parse_plan_input(_cfg(pp=2, vpp=3))
    # A run registration (lenient) reports what the job runs: its stages are uneven.
    registered = parse_plan_input(_cfg(gpus=12, pp=3), strict=False)
    assert registered.parallelism.uneven_stages
    assert any(d.startswith("uneven_stages: true") for d in registered.defaults)


def test_params_that_contradict_the_shape_are_refused() -> None:
    cfg = _cfg()
    cfg["model"]["params"] = 8e12  # 1000x the 8.03e9 the shape gives
    with pytest.raises(ValueError, match=r"model\.params: 8e\+12 is 996x the 8.03e\+09 parameters"):
        parse_plan_input(cfg)
    cfg["model"]["params"] = 8e7
    with pytest.raises(ValueError, match=r"model\.params: 8e\+07 is 1/100 of the 8.03e\+09 parameters"):
        parse_plan_input(cfg)
    cfg["model"]["params"] = 8e9
    assert parse_plan_input(cfg).model.params_total == pytest.approx(8e9)


def test_fp8_on_a_gpu_without_fp8_is_refused() -> None:
    cfg = _cfg()
    cfg["hardware"] = {"gpu": "A100", "precision": "fp8"}
    with pytest.raises(ValueError, match=r"hardware\.precision: fp8 on A100, which has no FP8 tensor cores"):
        parse_plan_input(cfg)
    cfg["hardware"] = {"gpu": "H100", "precision": "fp8"}
    assert parse_plan_input(cfg).hardware.peak_flops == 1979e12


def test_llama_ffn_rule() -> None:
    assert default_ffn_hidden(4096, gated=True) == 11008
    assert default_ffn_hidden(4096, gated=False) == 16384


@pytest.mark.parametrize(("par", "message"), [
    ({"tp": 3}, r"parallelism\.gpus: 16 is not divisible by tp\*pp\*cp = 3"),
    ({"tp": 16}, None),
    ({"zero": "zero4"}, r"parallelism\.zero"),
    ({"recompute": "some"}, r"parallelism\.recompute"),
    ({"ep": 2}, r"parallelism\.ep: 2 does not divide model\.experts=1"),
    ({"global_batch": 17}, r"parallelism\.global_batch: 17 is not a multiple"),
    ({"tp": "two"}, r"parallelism\.tp: must be an integer"),
    ({"bogus": 1}, r"parallelism\.bogus: unknown key"),
])
def test_bad_parallelism_names_key(par: dict, message: str | None) -> None:
    if message is None:  # tp=16 does not divide 32 heads? it does; it is allowed
        assert parse_plan_input(_cfg(**par)).parallelism.tp == 16
        return
    with pytest.raises(ValueError, match=message):
        parse_plan_input(_cfg(**par))


def test_missing_model_key() -> None:
    cfg = _cfg()
    del cfg["model"]["vocab"]
    with pytest.raises(ValueError, match=r"model\.vocab: required"):
        parse_plan_input(cfg)


def test_registration_aliases_and_lenient_mode() -> None:
    registration = {
        "model": {"num_layers": 32, "hidden_size": 4096, "num_heads": 32, "vocab_size": 32000,
                  "seq_length": 2048, "fp8_recipe": {"format": "e4m3"}},
        "parallelism": {"world_size": 8, "zero_stage": 1, "micro_batch_size": 2},
        "hardware": {"gpu_type": "A100", "count": 8},
        "checkpoint": {"interval_steps": 500},
    }
    with pytest.raises(ValueError, match="checkpoint: unknown top-level key"):
        parse_plan_input(registration)
    p = parse_plan_input(registration, strict=False)
    assert (p.model.layers, p.parallelism.gpus, p.parallelism.zero, p.hardware.gpu.name) == (32, 8, 1, "A100")


def test_explicit_hardware_overrides_table() -> None:
    cfg = _cfg()
    cfg["hardware"] = {"peak_tflops": 500, "hbm_gib": 64, "intra_node_gbps": 400, "inter_node_gbps": 25,
                       "gpus_per_node": 4}
    p = parse_plan_input(cfg)
    assert (p.hardware.peak_flops, p.hardware.gpu.hbm_gib, p.hardware.gpus_per_node) == (500e12, 64, 4)
    del cfg["hardware"]["hbm_gib"]
    with pytest.raises(ValueError, match=r"hardware\.gpu: required unless"):
        parse_plan_input(cfg)


def test_tp_must_split_the_kv_heads_or_replicate_them() -> None:
    # GQA: each TP rank holds whole KV heads, or a KV head is replicated on tp/kv_heads ranks.
    cfg = _cfg(gpus=6, tp=3)
    cfg["model"].update(hidden=6144, heads=48, kv_heads=8)
    with pytest.raises(ValueError, match=r"parallelism\.tp: 3 neither divides nor is a multiple of model\.kv_heads=8"):
        parse_plan_input(cfg)
    cfg["parallelism"] = {"gpus": 16, "tp": 16}  # 16 = 2 x 8: each KV head on two ranks
    assert parse_plan_input(cfg).parallelism.tp == 16
    cfg["parallelism"] = {"gpus": 8, "tp": 4}
    assert parse_plan_input(cfg).parallelism.tp == 4


def test_hardware_and_parallelism_gpus_must_agree() -> None:
    cfg = _cfg(gpus=8)
    cfg["hardware"]["gpus"] = 16
    with pytest.raises(ValueError, match=r"hardware\.gpus: 16 != parallelism\.gpus: 8"):
        parse_plan_input(cfg)
    with pytest.raises(ValueError, match=r"hardware\.gpus: 16 != parallelism\.gpus: 8"):
        parse_plan_input(cfg, strict=False)
    cfg["hardware"]["gpus"] = 8
    assert parse_plan_input(cfg).parallelism.gpus == 8
    del cfg["parallelism"]["gpus"]
    assert parse_plan_input(cfg).parallelism.gpus == 8  # hardware.gpus stands in for it
    cfg["hardware"]["gpus"] = "8"
    with pytest.raises(ValueError, match=r"hardware\.gpus: must be an integer, got '8'"):
        parse_plan_input(cfg)


def test_default_zero_shards_over_context_parallel_ranks() -> None:
    # dp = 1 but cp = 2: ZeRO shards over dp*cp, so there is a group to shard over.
    p = parse_plan_input(_cfg(gpus=2, cp=2))
    assert p.parallelism.zero == 1 and not any("nothing to shard" in d for d in p.defaults)
    alone = parse_plan_input(_cfg(gpus=8, tp=8))
    assert alone.parallelism.zero == 0 and any("nothing to shard" in d for d in alone.defaults)


def test_attention_kernel_key() -> None:
    assert parse_plan_input(_cfg()).parallelism.attention == "fused"
    none = parse_plan_input(_cfg(recompute="none"))
    assert any(d.startswith("attention: fused (") for d in none.defaults)
    assert parse_plan_input(_cfg(attention="eager")).parallelism.attention == "eager"
    with pytest.raises(ValueError, match=r"parallelism\.attention: must be one of \('fused', 'eager'\), got 'flash'"):
        parse_plan_input(_cfg(attention="flash"))
    with pytest.raises(ValueError, match=r"parallelism\.attention: must be a string, got 1"):
        parse_plan_input(_cfg(attention=1))
