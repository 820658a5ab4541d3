"""MFU without homework: the registration's model dims and hardware derived from the model and the
device (agent/_model_facts.py), what the job passes winning, and nothing guessed."""

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import trainvitals.agent as tv
from trainvitals.agent import _model_facts
from trainvitals.agent._model_facts import gpu_type_of, hardware_of, model_dims
from trainvitals.agent._position import flops_per_token
from trainvitals.service.advisors.model_config import parse_model
from trainvitals.wire import RunRegistration


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.n_head = heads
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)


class TinyGPT(nn.Module):
    def __init__(self, *, vocab: int = 100, d: int = 16, layers: int = 3, heads: int = 4, seq: int = 32,
                 tied: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.tok_emb.weight


def _expected_params(model: TinyGPT, *, tied: bool) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())  # shared weights once
    tables = model.pos_emb.weight.numel() + (0 if tied else model.tok_emb.weight.numel())
    return total, total - tables


@pytest.mark.parametrize("tied", [False, True])
def test_a_gpt_like_module_gets_its_dims_and_counts(tied: bool) -> None:
    model = TinyGPT(tied=tied)
    total, non_embedding = _expected_params(model, tied=tied)
    assert model_dims(model, {"world_size": 1}) == {
        "layers": 3, "hidden": 16, "heads": 4, "vocab": 100, "params": total, "non_embedding_params": non_embedding,
    }  # fmt: skip
    # A tied head does its matmul every token: N keeps it; only the position table is a pure lookup.
    assert non_embedding == total - 32 * 16 if tied else total - (100 + 32) * 16


def test_wrappers_are_seen_through() -> None:
    model = TinyGPT()
    ddp_like = nn.Module()  # DDP and FSDP hold the model as .module
    ddp_like.module = model
    compiled = torch.compile(model)
    assert model_dims(ddp_like, {}) == model_dims(model, {}) == model_dims(compiled, {})


class _HFLike(nn.Module):
    """A transformers PreTrainedModel in shape: a `config` object, modules the config describes."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(
            num_hidden_layers=2, hidden_size=24, num_attention_heads=6, num_key_value_heads=2,
            intermediate_size=64, vocab_size=50, max_position_embeddings=128, torch_dtype="bfloat16",
        )  # fmt: skip
        self.embed_tokens = nn.Embedding(50, 24)
        self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(2))


def test_a_hf_config_gives_the_dims_and_the_context_length() -> None:
    model = _HFLike()
    total = sum(p.numel() for p in model.parameters())
    dims = model_dims(model, {"world_size": 8})
    assert dims == {
        "layers": 2, "hidden": 24, "heads": 6, "kv_heads": 2, "ffn_hidden": 64, "vocab": 50, "seq_len": 128,
        "params": total, "non_embedding_params": total - 50 * 24,
    }  # fmt: skip
    assert flops_per_token(dims) == 6 * (total - 50 * 24) + 12 * 2 * 24 * 128


def test_a_pipeline_stage_reads_only_the_config_and_a_tensor_parallel_slice_is_not_counted() -> None:
    # Every rank must register the same identity: a stage's modules are not the model's.
    assert model_dims(_HFLike(), {"world_size": 4, "pp": 2}) == {
        "layers": 2, "hidden": 24, "heads": 6, "kv_heads": 2, "ffn_hidden": 64, "vocab": 50, "seq_len": 128,
    }  # fmt: skip
    assert model_dims(TinyGPT(), {"world_size": 4, "pp": 4}) == {}
    sliced = model_dims(TinyGPT(), {"world_size": 2, "tp": 2})
    assert "params" not in sliced and "heads" not in sliced and sliced["hidden"] == 16


@pytest.mark.parametrize(
    ("reported", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H100 NVL", None),  # other peaks than the table's: not guessed
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA GB200", "GB200"),
        ("NVIDIA L40S", None),
        ("Tesla V100-SXM2-32GB", None),
    ],
)
def test_gpu_names_map_to_the_advisors_table(reported: str, expected: str | None) -> None:
    assert gpu_type_of(reported) == expected


def test_the_peaks_are_the_advisors() -> None:
    from trainvitals.service.advisors.hardware import gpu_spec

    for name, peak in _model_facts.PEAK_BF16_FLOPS.items():
        assert gpu_spec(name).peak_bf16_tflops * 1e12 == peak


def test_a_cpu_model_has_no_peak() -> None:
    assert hardware_of(TinyGPT()) == {"gpu_type": "cpu"}
    assert hardware_of(None) == {} and hardware_of(nn.ReLU()) == {}


def test_a_cuda_device_gets_its_type_and_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    param = SimpleNamespace(device=torch.device("cuda", 0))
    model: Any = SimpleNamespace(parameters=lambda: iter([param]))
    for reported, expected in (
        ("NVIDIA H100 80GB HBM3", {"gpu_type": "H100-SXM", "peak_flops": 989e12}),
        ("NVIDIA L40S", {"gpu_type": "NVIDIA L40S"}),  # named, no peak: the overview says which to pass
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, r=reported: r)
        assert hardware_of(model) == expected


def _registered(tmp_path: Path, model: nn.Module, registration: dict[str, Any] | None = None) -> dict[str, Any]:
    """The registration attach() sends, as the spool's first line (no collector)."""
    cfg = tv.AgentConfig(collector="", spill_dir=str(tmp_path), record_file=str(tmp_path / "rec.jsonl"))
    agent = tv.attach(model, run="r1", config=cfg, registration=registration)
    agent.step(tokens=64)
    agent.close()
    reg = json.loads((tmp_path / "rec.jsonl").read_bytes().splitlines()[0])
    RunRegistration.model_validate(reg)
    return reg


def test_attach_registers_the_derived_dims_and_explicit_values_win(tmp_path: Path) -> None:
    model = _HFLike()
    derived = _registered(tmp_path / "a", model)
    assert derived["model"]["hidden"] == 24 and derived["model"]["seq_len"] == 128
    # A dense model's body leaves out the later fields it has no value for (not null: a collector
    # older than them would refuse it once, agent/_refusals.py).
    assert not {"experts", "active_experts", "shared_ffn_hidden"} & set(derived["model"])
    assert derived["hardware"] == {"gpu_type": "cpu", "gpu_count": None, "gpus_per_node": None, "peak_flops": None}
    explicit = _registered(
        tmp_path / "b", model,
        {"model": {"seq_len": 64, "heads": None}, "hardware": {"peak_flops": 1e12}},
    )  # fmt: skip
    assert explicit["model"]["seq_len"] == 64 and explicit["model"]["heads"] is None  # the job's, None included
    assert explicit["model"]["hidden"] == 24  # the rest still derived
    assert explicit["hardware"]["peak_flops"] == 1e12 and explicit["hardware"]["gpu_type"] == "cpu"


def test_a_declared_gpu_type_keeps_the_derived_peak_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_model_facts, "hardware_of", lambda model: {"gpu_type": "H100-SXM", "peak_flops": 989e12})
    body: dict[str, Any] = {"hardware": {"gpu_type": "A100"}}
    _model_facts.derive_into(body, TinyGPT())
    assert body["hardware"] == {"gpu_type": "A100"}  # the collector looks A100 up itself


def test_a_model_that_cannot_be_read_registers_what_the_job_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(model: object, parallelism: object) -> dict[str, int]:
        raise RuntimeError("odd model")

    monkeypatch.setattr(_model_facts, "model_dims", broken)
    body: dict[str, Any] = {"model": {"hidden": 8}}
    _model_facts.derive_into(body, TinyGPT())
    assert body == {"model": {"hidden": 8}}


class _Moe(nn.Module):
    """A Mixtral-style layer: a router and 4 expert MLPs (a ModuleList named `experts`), a shared
    expert that runs on every token."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, 4, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.Linear(4 * d, d)) for _ in range(4))
        self.shared_experts = nn.Linear(d, d)


class TinyMoE(nn.Module):
    def __init__(self, *, top_k: int | None, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_local_experts=4, num_experts_per_tok=top_k, hidden_size=d)
        self.embed = nn.Embedding(100, d)
        self.layers = nn.ModuleList(_Moe(d) for _ in range(layers))
        self.head = nn.Linear(d, 100, bias=False)


def test_an_moe_counts_the_experts_a_token_passes_through() -> None:
    """N of 6N is what a token passes through: top-1 of 4 experts counts a quarter of the expert
    MLPs (all four read the MFU of their share 4x too high); the router, the shared expert, attention
    and the head in full. Without top-k in the config every expert is counted, as before."""
    model = TinyMoE(top_k=1)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for layer in model.layers for p in layer.experts.parameters())
    dims = model_dims(model, {"world_size": 1})
    assert dims["params"] == total
    assert dims["non_embedding_params"] == total - 100 * 16 - experts * 3 // 4
    assert model_dims(TinyMoE(top_k=None), {"world_size": 1})["non_embedding_params"] == total - 100 * 16


@pytest.mark.parametrize(
    ("top_k", "registered"),
    [(1, {"experts": 4, "active_experts": 1}), (4, {"experts": 4, "active_experts": 4}), (None, {}), (5, {})],
)
def test_an_moe_registers_its_experts_and_top_k_when_the_config_says_both(top_k: int | None, registered: dict) -> None:
    """The collector's MFU prediction for an MoE needs E and k (expert parallelism shards E); a
    config that names only one, or routes to more experts than it has, registers neither (the
    wire would refuse the registration)."""
    dims = model_dims(TinyMoE(top_k=top_k), {"world_size": 1, "ep": 2})
    assert {k: dims[k] for k in ("experts", "active_experts") if k in dims} == registered
    RunRegistration(run="r", model=dims)  # what the agent derives, the wire takes


# Qwen3-30B-A3B's published config (the fields read here): 128 experts of width 768, 8 per token;
# `intermediate_size` is the width a dense layer would have, which none of its 48 layers has.
_QWEN3_MOE = SimpleNamespace(
    num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    vocab_size=151936, max_position_embeddings=40960,
)  # fmt: skip


class _ConfigOnly(nn.Module):
    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config


def test_an_moe_registers_its_experts_width_where_the_config_names_it_apart() -> None:
    """ffn_hidden is per expert for an MoE (wire ModelDims): a config with `moe_intermediate_size`
    registers that, not its dense width. Read as 6,144 the collector's model of Qwen3-30B-A3B had
    233B parameters, and scaled to the published 30.5B its active ones came out at 2.0B; read as
    768 they are 3.34B, the published 3.3B within 2% (2.9B with its 32 heads of 128 taken 2,048 wide,
    as before head_dim)."""
    dims = model_dims(_ConfigOnly(_QWEN3_MOE), {"world_size": 64, "pp": 2})  # pp: the config alone
    assert dims["ffn_hidden"] == 768
    assert (dims["experts"], dims["active_experts"]) == (128, 8)
    registered = RunRegistration(run="r", model={**dims, "params": 30_500_000_000}).model
    model = parse_model({"model": registered.model_dump(exclude_none=True)})
    assert abs(model.params_active / 3.3e9 - 1) < 0.02
    assert abs(model.params_total / model.params_override - 1) < 0.05  # the shape gives the published total
    dense = SimpleNamespace(**{k: v for k, v in vars(_QWEN3_MOE).items() if "expert" not in k})
    assert model_dims(_ConfigOnly(dense), {"pp": 2})["ffn_hidden"] == 6144  # no experts: the MLP's width


# Qwen1.5-MoE-A2.7B's published config (the fields read here): 60 experts of width 1,408, 4 per token,
# and one shared expert of width 5,632 that every token passes through. Published: 14.3B parameters,
# 2.7B of them active.
_QWEN15_MOE = SimpleNamespace(
    num_hidden_layers=24, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
    intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
    num_experts=60, num_experts_per_tok=4, vocab_size=151936, max_position_embeddings=8192,
)  # fmt: skip


def test_an_moe_registers_its_shared_experts_and_the_collector_counts_them_active() -> None:
    """A shared expert runs on every token: left out, the collector's model of Qwen1.5-MoE-A2.7B
    had 1.97B active parameters against the published 2.7B (its FLOPs, so the predicted step time,
    27% short, and the MFU it predicts that much too high: a gap where there is none)."""
    dims = model_dims(_ConfigOnly(_QWEN15_MOE), {"world_size": 64, "pp": 2})
    assert (dims["ffn_hidden"], dims["shared_ffn_hidden"]) == (1408, 5632)
    registered = RunRegistration(run="r", model=dims).model_dump(exclude_none=True)
    model = parse_model(registered)
    assert abs(model.params_total / 14.3e9 - 1) < 0.02  # the shape alone gives the published total
    assert abs(model.params_active / 2.7e9 - 1) < 0.02
    # Expert parallelism shards the routed experts only: the shared one is replicated like attention.
    assert model.expert_params == 24 * 60 * 3 * 2048 * 1408
    # With the published total registered too (as an agent that counts its module does), the same;
    # without the shared expert the total rescales the rest and the active count stays 27% short.
    published = {**registered["model"], "params": 14_300_000_000}
    assert abs(parse_model({"model": published}).params_active / 2.7e9 - 1) < 0.02
    published.pop("shared_ffn_hidden")
    assert abs(parse_model({"model": published}).params_active / 2.7e9 - 1) > 0.25


def test_deepseek_names_its_shared_experts_by_count() -> None:
    """DeepSeek-V2/V3 configs give n_shared_experts, each of the routed experts' width."""
    deepseek = SimpleNamespace(
        hidden_size=2048, num_attention_heads=16, moe_intermediate_size=1408, intermediate_size=10944,
        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
    )  # fmt: skip
    dims = model_dims(_ConfigOnly(deepseek), {"pp": 2})
    assert (dims["ffn_hidden"], dims["experts"], dims["shared_ffn_hidden"]) == (1408, 64, 2 * 1408)
    for none in ({"n_shared_experts": 0}, {"n_shared_experts": None}, {"moe_intermediate_size": None}):
        config = SimpleNamespace(**{**vars(deepseek), **none})
        assert "shared_ffn_hidden" not in model_dims(_ConfigOnly(config), {"pp": 2})


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_a_real_hf_moe_with_shared_experts_gets_the_active_parameters_it_has(family: str) -> None:
    """Tiny random transformers models of the two families with shared experts, built from their own
    config classes (no download): the agent registers the shared width, and the collector's
    architecture count of the active parameters agrees with what the agent counted from the
    module itself (N plus the input table) within 2% (routers, gates and norms are not in the
    shape; DeepSeek's MLA attention is counted as plain attention)."""
    import transformers

    tiny = {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 128, "num_experts_per_tok": 2}
    if family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **tiny, moe_intermediate_size=44, shared_expert_intermediate_size=176, num_experts=8
        )
        model, shared = transformers.Qwen2MoeForCausalLM(config), 176
    else:
        config = transformers.DeepseekV3Config(
            **tiny, moe_intermediate_size=32, n_shared_experts=2, n_routed_experts=8, first_k_dense_replace=0,
            q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
            topk_group=1,
        )
        model, shared = transformers.DeepseekV3ForCausalLM(config), 2 * 32
    dims = model_dims(model, {"world_size": 1})
    assert (dims["experts"], dims["active_experts"], dims["shared_ffn_hidden"]) == (8, 2, shared)
    registered = RunRegistration(run="r", model=dims).model_dump(exclude_none=True)
    collector = parse_model(registered, strict=False)
    counted = dims["non_embedding_params"] + 1000 * 64  # the agent's N, the input table added back
    assert abs(collector.params_active / counted - 1) < 0.02
    assert collector.params_total == pytest.approx(dims["params"], rel=0.02)


# Published configs (the fields read here). Qwen3-4B: 32 query heads of 128 on a width of 2,560.
# DeepSeek-V3: MLA (low-rank query and key-value projections, `kv_lora_rank`) with 128 heads on a
# width of 7,168, its `head_dim` the RoPE part alone; 256 experts of 2,048, 8 per token, one shared.
# Llama 3 8B names a head_dim that is hidden / heads.
_QWEN3_4B = SimpleNamespace(
    num_hidden_layers=36, hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=9728, vocab_size=151936, max_position_embeddings=40960,
)  # fmt: skip
_DEEPSEEK_V3 = SimpleNamespace(
    num_hidden_layers=61, hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, head_dim=64,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512, q_lora_rank=1536,
    intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
    n_shared_experts=1, vocab_size=129280, max_position_embeddings=4096,
)  # fmt: skip
_LLAMA3_8B = SimpleNamespace(
    num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=14336, vocab_size=128256,
)  # fmt: skip


def test_heads_wider_than_the_model_register_their_head_dim() -> None:
    """12LHQT counts H*Q, the attention's width, which the agent and the collector took to be hidden:
    Qwen3-4B attends 4,096 wide on a width of 2,560. A config whose head_dim is hidden / heads
    registers none (it would tell nothing), nor does an MLA model: the collector counts head_dim into
    the q/k/v/o projections too, and DeepSeek-V3's low-rank ones are far smaller than 128 heads of
    192 and 128 (so counted, its active parameters came out at 57B against the published 37B)."""
    assert model_dims(_ConfigOnly(_QWEN3_4B), {"pp": 2})["head_dim"] == 128
    assert "head_dim" not in model_dims(_ConfigOnly(_LLAMA3_8B), {"pp": 2})
    deepseek = model_dims(_ConfigOnly(_DEEPSEEK_V3), {"pp": 2})
    assert "head_dim" not in deepseek
    registered = RunRegistration(run="r", model={**deepseek, "params": 671_000_000_000}).model_dump(exclude_none=True)
    assert abs(parse_model(registered).params_active / 37e9 - 1) < 0.02
    assert parse_model({"model": {**registered["model"], "head_dim": 160}}).params_active > 55e9
    no_head_dim = SimpleNamespace(**{k: v for k, v in vars(_QWEN3_4B).items() if k != "head_dim"})
    assert "head_dim" not in model_dims(_ConfigOnly(no_head_dim), {"pp": 2})
    # Both sides count the attention heads x head_dim wide, and agree (expectations.run_flops_per_token).
    from trainvitals.service.advisors.model_config import parse_plan_input
    from trainvitals.service.analysis.expectations import run_flops_per_token

    dims = {**model_dims(_ConfigOnly(_QWEN3_4B), {"pp": 2}), "seq_len": 32768, "non_embedding_params": 3_600_000_000}
    registration = {"model": dims, "parallelism": {"world_size": 8}, "hardware": {"gpu_type": "H100-SXM"}}
    agent = flops_per_token(dims)
    collector = run_flops_per_token(registration, parse_plan_input(registration, strict=False))
    assert agent == pytest.approx(collector, rel=1e-12)
    assert agent == pytest.approx(6 * 3.6e9 + 12 * 36 * 32 * 128 * 32768, rel=1e-12)
    hidden_wide = flops_per_token({k: v for k, v in dims.items() if k != "head_dim"})
    assert agent / hidden_wide > 1.35  # at a 32k context the attention is most of the step


def test_a_real_hf_model_with_wide_heads_has_the_forward_flops_the_agent_counts() -> None:
    """A tiny random transformers Qwen3 (its own config class, no download) whose 4 heads of 32 are
    twice its width of 64: the forward FLOPs torch's FlopCounterMode counts in its matmuls agree with
    the agent's 2N + 4LHQT (a third of full training's 6N + 12LHQT) within 2%; with the attention
    taken hidden wide, as before head_dim, they were a fifth short."""
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    seq = 256
    config = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=1000, max_position_embeddings=seq, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(config).eval()
    dims = {**model_dims(model, {"world_size": 1}), "seq_len": seq}
    assert dims["head_dim"] == 32
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, seq, dtype=torch.long))
    counted = counter.get_total_flops() / seq
    forward = flops_per_token(dims) / 3
    assert abs(forward / counted - 1) < 0.02
    hidden_wide = flops_per_token({k: v for k, v in dims.items() if k != "head_dim"}) / 3
    assert hidden_wide / counted < 0.85


def test_an_mla_model_registers_its_attention_cores_width() -> None:
    """DeepSeek-V3 attends with 128 query-key heads of 192 (128 + 64 RoPE) and value heads of 128 on
    a width of 7,168: attention_core_width 128 x (192 + 128) / 2 = 20,480 is its 12LHQT H*Q. Its
    parameters are unchanged by it (37B active, as published), agent and collector count the same
    FLOPs, and at a 32k context they are 1.8x the hidden-wide count (1.16x at 4k)."""
    from trainvitals.service.advisors.model_config import parse_plan_input
    from trainvitals.service.analysis.expectations import run_flops_per_token

    dims = model_dims(_ConfigOnly(_DEEPSEEK_V3), {"pp": 2})
    assert dims["attention_core_width"] == 20480 and "head_dim" not in dims
    registered = RunRegistration(run="r", model={**dims, "params": 671_000_000_000}).model_dump(exclude_none=True)
    assert abs(parse_model(registered).params_active / 37e9 - 1) < 0.02
    for seq, more in ((4096, 1.16), (32768, 1.81)):
        model = {**dims, "seq_len": seq, "non_embedding_params": 37_000_000_000}
        registration = {"model": model, "parallelism": {"world_size": 2048, "ep": 64, "pp": 16},
                        "hardware": {"gpu_type": "H100-SXM"}}  # fmt: skip
        agent = flops_per_token(model)
        assert agent == pytest.approx(run_flops_per_token(registration, parse_plan_input(registration, strict=False)))
        assert agent == pytest.approx(6 * 37e9 + 12 * 61 * 20480 * seq, rel=1e-12)
        hidden_wide = flops_per_token({k: v for k, v in model.items() if k != "attention_core_width"})
        assert agent / hidden_wide == pytest.approx(more, abs=0.01)
    # Other models register none: Llama's heads are hidden wide, Qwen3's width is its head_dim's.
    assert "attention_core_width" not in model_dims(_ConfigOnly(_LLAMA3_8B), {"pp": 2})
    assert "attention_core_width" not in model_dims(_ConfigOnly(_QWEN3_4B), {"pp": 2})


def test_a_real_hf_mla_model_has_the_forward_flops_the_agent_counts() -> None:
    """A tiny random transformers DeepSeek-V3 (its own config class, no download; MLA with query-key
    heads of 24 + 8 and value heads of 32, 4 of them on a width of 64, every layer dense): torch's
    FlopCounterMode counts the forward's matmul FLOPs, and the agent's 2N + 4LHQT with its attention
    core 128 wide agrees within 2%; hidden wide, as before attention_core_width, a fifth short."""
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    seq = 256
    config = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=1000, max_position_embeddings=seq, first_k_dense_replace=2, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, q_lora_rank=None, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=24, v_head_dim=32, n_group=1, topk_group=1, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    dims = {**model_dims(model, {"world_size": 1}), "seq_len": seq}
    assert dims["attention_core_width"] == 4 * (32 + 32) // 2 and "head_dim" not in dims
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, seq, dtype=torch.long))
    counted = counter.get_total_flops() / seq
    assert abs(flops_per_token(dims) / 3 / counted - 1) < 0.02
    hidden_wide = flops_per_token({k: v for k, v in dims.items() if k != "attention_core_width"}) / 3
    assert hidden_wide / counted < 0.85
