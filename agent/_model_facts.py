"""What MFU needs, read from the model the agent is attached to and the device it runs on, so
that a job passes nothing (docs/agent.md, "What feeds MFU").

Model: a Hugging Face style `config` (layers, width, heads, KV heads, MLP width, vocabulary,
context length), else the modules themselves (the block list, the token embedding, an attention
module's head count); parameter counts, total and non-embedding, from the parameters. Device: the
dense bf16 peak of the GPUs in the advisors' table, by the name CUDA reports. Whatever the
registration passes explicitly wins (attach() merges these under it).

Every rank must derive the same identity values (the collector compares hidden, heads, kv_heads,
ffn_hidden, vocab, experts and active_experts between registrations of one run id), so nothing is
read from modules where a rank holds only part of the model: with pipeline stages (pp > 1) only
the config is read, and parameters are counted only where they are whole (plain or DDP replicas,
DTensor shards: their global shape; DeepSpeed ZeRO-3: `ds_numel`), not FSDP1's flat shards or
tensor-parallel slices.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Dense bf16 tensor-core peak per device, FLOP/s: the GPUs of service/advisors/hardware.py (its
# canonical names, so the collector's table agrees), from the vendors' datasheets.
PEAK_BF16_FLOPS: dict[str, float] = {
    "A100": 312e12,
    "H100-SXM": 989e12,
    "H100-PCIe": 756e12,
    "H200": 989e12,
    "B200": 2250e12,
    "GB200": 2500e12,
}

# HF config attribute names per wire field, first found wins (Llama/Mistral/Qwen, GPT-2, T5/OPT).
_CONFIG_NAMES: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head", "num_heads"),
    "kv_heads": ("num_key_value_heads",),
    "ffn_hidden": ("intermediate_size", "n_inner", "ffn_dim", "d_ff"),
    "vocab": ("vocab_size",),
    "seq_len": ("max_position_embeddings", "n_positions"),
}
_HEAD_ATTRS = ("num_heads", "n_head", "n_heads", "heads")
# Mixture of experts, HF config names (Mixtral, Qwen-MoE/OLMoE, DeepSeek, ...): experts per layer and
# the experts each token is routed to. A token passes through k of E experts: N counts those only.
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_ROUTED = ("num_experts_per_tok", "moe_topk", "num_selected_experts")
# An expert's MLP width where the config names it apart from the dense MLP's (Qwen2/Qwen3-MoE,
# DeepSeek): ffn_hidden is per expert for an MoE (the wire's ModelDims), and `intermediate_size`
# there is the dense layers' width (Qwen3-30B-A3B: 6,144 against its experts' 768).
_EXPERT_WIDTH = ("moe_intermediate_size",)
# Shared experts, which every token passes through besides its routed k: Qwen2-MoE names their width
# (one shared expert, 4-8 routed experts wide), DeepSeek their count (each of the experts' width).
_SHARED_WIDTH = "shared_expert_intermediate_size"
_SHARED_COUNT = "n_shared_experts"
# The width of one attention head, where heads x head_dim is not the model's width: Qwen3 and Gemma
# name it (`head_dim`: Qwen3-4B's 32 heads of 128 against a width of 2,560; their q/k/v/o projections
# are that wide too). Registered only where it differs from hidden / heads. Not for DeepSeek's MLA
# (a config naming `kv_lora_rank`): its projections are low-rank, far smaller than heads x head_dim,
# and the collector counts a head_dim into the projections' parameters as well as into 12LHQT:
# DeepSeek-V3's active parameters came out at 57B against the published 37B (hidden wide: 36.7B).
_HEAD_DIM = ("head_dim",)
_MLA = "kv_lora_rank"
# An MLA model's attention core instead: query-key heads of qk_nope_head_dim + qk_rope_head_dim
# (192 in DeepSeek-V2/V3) and value heads of v_head_dim (128), against its width of 7,168 / 128 = 56
# a head. Registered as attention_core_width = heads x (query-key + value) / 2, the H x Q of 12LHQT,
# which only the attention core's FLOPs read (its projections stay counted hidden wide): V3's 4k step
# is 16% more FLOPs than hidden wide, a 32k step 81% more.
_MLA_QK = ("qk_nope_head_dim", "qk_rope_head_dim")
_MLA_V = ("v_head_dim",)
# Roles in _param_sizes: an nn.Embedding table (not in N), and a token embedding tied to a head (in
# N: its matmul runs at the end of forward); any other parameter has the role "".
_TABLE, _TIED = "table", "tied"


def gpu_type_of(device_name: str) -> str | None:
    """The table's name for what `torch.cuda.get_device_name()` reports, None when it is not in
    the table (an H100 NVL, an L40S: no peak is guessed).

    'NVIDIA H100 80GB HBM3' -> 'H100-SXM'; 'NVIDIA H100 PCIe' -> 'H100-PCIe';
    'NVIDIA A100-SXM4-80GB' -> 'A100'.
    """
    name = device_name.upper().replace("-", " ")
    words = set(name.split())
    if "NVL" in words:
        return None  # H100 NVL / H200 NVL: other clocks and power, other peaks
    if "GB200" in name:
        return "GB200"
    if "B200" in words:
        return "B200"
    if "H200" in words:
        return "H200"
    if "H100" in words:
        return "H100-PCIe" if "PCIE" in words else "H100-SXM"
    if "A100" in words:
        return "A100"  # SXM and PCIe share the 312 TFLOP/s dense bf16 peak
    return None


def hardware_of(model: nn.Module | None) -> dict[str, Any]:
    """gpu_type and peak_flops of the device the model's parameters are on: for a CUDA GPU in the
    table, its name there and its dense bf16 peak; for another GPU, its reported name and no peak;
    for a CPU, 'cpu' and no peak. Empty when the model has no parameters."""
    param = next(model.parameters(), None) if model is not None else None
    if param is None:
        return {}
    if param.device.type == "cpu":
        return {"gpu_type": "cpu"}
    if param.device.type != "cuda":
        return {}
    reported = torch.cuda.get_device_name(param.device)
    known = gpu_type_of(reported)
    if known is None:
        return {"gpu_type": reported[:64]}
    return {"gpu_type": known, "peak_flops": PEAK_BF16_FLOPS[known]}


def model_dims(model: nn.Module | None, parallelism: dict[str, Any]) -> dict[str, int]:
    """ModelDims fields this rank can know for sure about the whole model (module docstring)."""
    if model is None:
        return {}
    inner = _unwrap(model)
    config = getattr(inner, "config", None)
    dims = _from_config(config)
    dims.update(_experts_of(config))
    if _a_stage(parallelism):
        return dims  # a stage's modules and parameters are not the model's
    sliced = _sliced(parallelism)
    for key, value in _from_modules(inner, heads=not sliced).items():
        dims.setdefault(key, value)
    counts = _param_counts(inner, sliced=sliced)
    if counts is not None:
        total, n = counts[0], counts[1] - _idle_expert_params(inner, config)
        if min(total, n) >= 1:
            dims["params"], dims["non_embedding_params"] = total, n
    return dims


def _experts_of(config: object) -> dict[str, int]:
    """experts and active_experts of a mixture of experts whose config names both (a token routed
    to k of E), and shared_ffn_hidden where it has shared experts; nothing for a dense model, or a
    config that does not say both consistently."""
    experts, routed = _config_int(config, _EXPERTS), _config_int(config, _ROUTED)
    if experts is None or routed is None or routed > experts:
        return {}
    moe = {"experts": experts, "active_experts": routed}
    shared = _config_int(config, (_SHARED_WIDTH,))
    if shared is None and (count := _config_int(config, (_SHARED_COUNT,))) is not None:
        width = _config_int(config, _EXPERT_WIDTH)
        shared = None if width is None else count * width
    if shared is not None:
        moe["shared_ffn_hidden"] = shared
    return moe


def _idle_expert_params(model: nn.Module, config: object) -> int:
    """The expert parameters a token does not pass through: (E - k) / E of those under a module
    named `experts` (an nn.ModuleList of experts, or fused expert weights), when the config names
    E and k; 0 for a dense model or one whose routing the config does not tell (N then counts every
    expert, and the MFU of an MoE reads E/k too high on its expert share: pass
    model.non_embedding_params). Shared experts (`shared_experts`) run on every token: counted."""
    moe = _experts_of(config)
    if not moe or moe["active_experts"] == moe["experts"]:
        return 0
    experts, routed = moe["experts"], moe["active_experts"]
    size = sum(
        int(ds) if isinstance(ds := getattr(p, "ds_numel", None), int) else p.numel()
        for name, p in model.named_parameters()
        if "experts" in name.split(".")
    )
    return size * (experts - routed) // experts


def _a_stage(parallelism: dict[str, Any]) -> bool:
    """With pipeline stages a rank holds one stage's modules and parameters, not the model's."""
    return int(parallelism.get("pp") or 1) > 1


def _sliced(parallelism: dict[str, Any]) -> bool:
    """With tensor or expert parallelism a rank's parameters may be slices of the model's."""
    return int(parallelism.get("tp") or 1) > 1 or int(parallelism.get("ep") or 1) > 1


def derive_into(body: dict[str, Any], model: nn.Module | None) -> None:
    """Fill the registration's model dims and hardware with what the model and device tell, under
    what `body` sets explicitly (a key set there wins, None included). A gpu_type set there also
    keeps the derived peak out: the collector looks that type up itself. Never raises: a model
    this cannot read registers what the job passed."""
    try:
        dims = model_dims(model, body.get("parallelism") or {})
        hardware = hardware_of(model)
    except Exception:  # noqa: BLE001 - deriving is a convenience, never a reason to stop monitoring
        return
    explicit_hw = dict(body.get("hardware") or {})
    if "gpu_type" in explicit_hw or "peak_flops" in explicit_hw:
        hardware.pop("peak_flops", None)
    body["model"] = {**dims, **(body.get("model") or {})}
    body["hardware"] = {**hardware, **explicit_hw}


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / FSDP (`.module`) and torch.compile (`._orig_mod`)."""
    for _ in range(8):
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner
    return model


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _config_int(config: object, names: tuple[str, ...]) -> int | None:
    """The first of the config's attributes `names` that holds a positive int."""
    return next((v for name in names if (v := _positive_int(getattr(config, name, None)))), None)


def _from_config(config: object) -> dict[str, int]:
    if config is None:
        return {}
    dims: dict[str, int] = {}
    for key, names in _CONFIG_NAMES.items():
        if key == "ffn_hidden" and _experts_of(config):
            names = _EXPERT_WIDTH + names  # an MoE's ffn_hidden is its experts' width
        if (value := _config_int(config, names)) is not None:
            dims[key] = value
    head_dim = _head_dim_of(config)
    heads, hidden = dims.get("heads"), dims.get("hidden")
    if head_dim is not None and heads is not None and heads * head_dim != hidden:
        dims["head_dim"] = head_dim
    core = _mla_core_width(config, heads)
    if core is not None and core != hidden:
        dims["attention_core_width"] = core
    return dims


def _mla_core_width(config: object, heads: int | None) -> int | None:
    """An MLA model's attention core width (module comment at _MLA_QK); None for any other model, or
    an MLA config that does not name its head widths."""
    if heads is None or _config_int(config, (_MLA,)) is None:
        return None
    query_key = sum(_config_int(config, (name,)) or 0 for name in _MLA_QK)
    value = _config_int(config, _MLA_V)
    if not query_key or value is None:
        return None
    return (heads * (query_key + value) + 1) // 2


def _head_dim_of(config: object) -> int | None:
    """One attention head's width as the config names it (module comment at _HEAD_DIM); None when
    it names none, or is an MLA model's."""
    if _config_int(config, (_MLA,)) is not None:
        return None
    return _config_int(config, _HEAD_DIM)


def _from_modules(model: nn.Module, *, heads: bool) -> dict[str, int]:
    """layers: the shallowest list of same-class blocks (a tie: the longest); hidden and vocab: the
    largest nn.Embedding (the token embedding; learned positions are fewer than the vocabulary);
    heads: the head count the blocks' attention modules agree on (not with tensor parallelism,
    where a module may hold its own share of the heads)."""
    dims: dict[str, int] = {}
    blocks: tuple[int, int, nn.ModuleList] | None = None  # (depth, -length, list)
    embedding: nn.Embedding | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            kinds = {type(m) for m in module}
            if len(kinds) == 1 and any(True for _ in module.parameters()):
                key = (name.count(".") if name else -1, -len(module))
                if blocks is None or key < blocks[:2]:
                    blocks = (*key, module)
        elif isinstance(module, nn.Embedding):
            if embedding is None or module.num_embeddings > embedding.num_embeddings:
                embedding = module
    if blocks is not None:
        dims["layers"] = len(blocks[2])
    if embedding is not None:
        dims["vocab"], dims["hidden"] = embedding.num_embeddings, embedding.embedding_dim
    if heads and blocks is not None:
        found = set()
        for module in blocks[2].modules():
            if isinstance(module, nn.MultiheadAttention):
                found.add(module.num_heads)
                continue
            for attr in _HEAD_ATTRS:
                value = _positive_int(getattr(module, attr, None))
                if value is not None:
                    found.add(value)
                    break
        if len(found) == 1:
            dims["heads"] = found.pop()
    return dims


def _param_counts(model: nn.Module, *, sliced: bool) -> tuple[int, int] | None:
    """(total, non-embedding) parameters, or None where this rank does not hold them whole.

    Non-embedding is N of 6N + 12LHQT: every parameter that does a matmul per token, so all but
    the nn.Embedding tables, with a head tied to the token embedding counted back in (its matmul
    is done every token). An MoE's idle experts come off in model_dims (_idle_expert_params)."""
    sizes = _param_sizes(model, sliced=sliced)
    if sizes is None:
        return None
    total = sum(size for _, size, _ in sizes)
    return total, total - sum(size for _, size, role in sizes if role == _TABLE)


class BackwardShares:
    """The shares of the non-embedding parameters (as counted for N) that backward works on, for
    flops_per_token: `trained`, those whose weight gradients it computes (`requires_grad`), and
    `reach`, those it passes through: from the first trained parameter on, in registration order
    (the forward order of the usual model), since below it no activation needs a gradient, and a
    head tied to the token embedding (registered first, its matmul runs last). (1, 1) for full
    training; a LoRA job about (0.01, 1), a frozen backbone under a trained head about (0.05,
    0.05). The parameters and their sizes are listed once; `read()` looks at `requires_grad`
    again (tens of us), for a job that unfreezes layers as it trains."""

    def __init__(self, model: nn.Module | None, parallelism: dict[str, Any]) -> None:
        self._sizes: list[tuple[nn.Parameter, int, str]] | None = None
        self._model = None if model is None or _a_stage(parallelism) else _unwrap(model)
        self._sliced = _sliced(parallelism)
        self._list()  # none for a pipeline stage: its parameters are not the model's

    def _list(self) -> None:
        try:
            self._sizes = None if self._model is None else _param_sizes(self._model, sliced=self._sliced)
        except Exception:  # noqa: BLE001 - a convenience: the convention's 6N stands
            self._sizes = None

    def read(self) -> tuple[float, float] | None:
        """(trained, reach), or None where the counts are not whole on this rank (as for N:
        pipeline stages, slices, FSDP1's flat shards) or nothing is trained."""
        if self._model is not None and self._sizes and next(self._model.parameters(), None) is not self._sizes[0][0]:
            self._list()  # replaced since listed: FSDP2's fully_shard after attach()
        if not self._sizes:
            return None
        first = next((i for i, (p, _, _) in enumerate(self._sizes) if p.requires_grad), None)
        n = sum(size for _, size, role in self._sizes if role != _TABLE)
        if first is None or n == 0:
            return None
        trained = sum(size for p, size, role in self._sizes if p.requires_grad and role != _TABLE)
        reach = sum(
            size for i, (_, size, role) in enumerate(self._sizes) if role != _TABLE and (i >= first or role == _TIED)
        )
        return trained / n, reach / n


def _param_sizes(model: nn.Module, *, sliced: bool) -> list[tuple[nn.Parameter, int, str]] | None:
    """Each parameter in registration order with its whole size and its role (_TABLE, _TIED or '';
    see _param_counts); None where this rank does not hold them whole."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        DTensor = ()  # type: ignore[assignment,misc]  # noqa: N806
    params = list(model.parameters())
    if not params:
        return None
    sizes = []
    for p in params:
        if type(p).__name__ == "FlatParameter" or (sliced and not isinstance(p, DTensor)):
            return None  # FSDP1's flattened shard, a tensor-parallel slice: a part of the model
        ds_numel = getattr(p, "ds_numel", None)  # DeepSpeed ZeRO-3 keeps the full size here
        sizes.append((p, int(ds_numel) if isinstance(ds_numel, int) else p.numel()))
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = (getattr(m, "weight", None) for m in model.modules() if not isinstance(m, nn.Embedding))
    tied = {id(w) for w in heads if id(w) in tables}  # tied to a head: its matmul counts
    return [(p, size, _TIED if id(p) in tied else _TABLE if id(p) in tables else "") for p, size in sizes]
