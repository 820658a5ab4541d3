"""The Fp8State adapters read the same numbers as the modules' own buffers.

Transformer Engine (GPU only) and torchao's delayed scaling (deleted in torchao 0.10) cannot run
here. Their adapters are tested against fakes that subclass the real emulated module, so the
numbers come from real FP8 training steps, and that expose those numbers in TE's / torchao's
layout. The emulation updates at the same points of the step as current TE, which is what makes
the layouts comparable.
"""

import math
import sys
from dataclasses import dataclass
from enum import Enum

import pytest
import torch
from torch import nn

from trainvitals.agent.fp8_emulation import DelayedScalingRecipe, Fp8Linear
from trainvitals.agent.fp8_recipes import (
    EmulatedFp8State,
    Fp8State,
    TorchaoFp8State,
    TransformerEngineFp8State,
    find_fp8_modules,
)

ROLES = ("input", "weight", "grad_output")


# --- a fake of Transformer Engine's fp8_meta ------------------------------------------------


class TeFormat(Enum):
    """Mirrors transformer_engine.common.recipe.Format (member names are what the adapter reads)."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    HYBRID = "hybrid"


@dataclass
class TeDelayedScaling:
    """Mirrors the fields of transformer_engine.common.recipe.DelayedScaling the adapter reads."""

    margin: int
    amax_history_len: int
    amax_compute_algo: str
    fp8_format: TeFormat = TeFormat.HYBRID
    is_delayed: bool = True

    def delayed(self) -> bool:  # TE >= 2: which kind of recipe this is
        return self.is_delayed


@dataclass
class TeFP8TensorMeta:
    """Mirrors transformer_engine.pytorch's FP8TensorMeta: scale, scale_inv, amax_history."""

    scale: torch.Tensor
    scale_inv: torch.Tensor
    amax_history: torch.Tensor


def te_fp8_meta(gemms: list[Fp8Linear], fmt: TeFormat = TeFormat.HYBRID) -> dict[str, object]:
    """TE's fp8_meta for these GEMMs, filled from their emulated state: scaling_fwd columns
    INPUT, WEIGHT, OUTPUT per GEMM and scaling_bwd columns GRAD_OUTPUT, GRAD_INPUT per GEMM. The
    OUTPUT / GRAD_INPUT casts do not happen in a plain Linear, so those columns stay 0 as in TE."""
    recipe = gemms[0].recipe
    L = recipe.history_len
    zeros, one = torch.zeros(L, 1), torch.ones(1)
    fwd_hist = torch.cat([torch.cat((g.amax_history[:, 0:2], zeros), 1) for g in gemms], 1)
    bwd_hist = torch.cat([torch.cat((g.amax_history[:, 2:3], zeros), 1) for g in gemms], 1)
    fwd_scale = torch.cat([torch.cat((g.scale[0:2], one)) for g in gemms])
    bwd_scale = torch.cat([torch.cat((g.scale[2:3], one)) for g in gemms])
    return {
        "recipe": TeDelayedScaling(recipe.margin, L, recipe.amax_compute_algo, fmt),
        "num_gemms": len(gemms),
        "scaling_fwd": TeFP8TensorMeta(fwd_scale, 1 / fwd_scale, fwd_hist),
        "scaling_bwd": TeFP8TensorMeta(bwd_scale, 1 / bwd_scale, bwd_hist),
    }


class FakeTeLinear(Fp8Linear):
    """TE cannot run here: this fake mirrors te.Linear's fp8_meta layout (FP8TensorMeta with
    amax_history [L, 3] / scale [3] forward, [L, 2] / [2] backward), filled on every access from
    the emulated module's real state."""

    @property
    def fp8_meta(self) -> dict[str, object]:
        return te_fp8_meta([self])


class FakeTeLayerNormMLP(nn.Module):
    """TE cannot run here: mirrors te.LayerNormMLP's two-GEMM fp8_meta (fc1 then fc2). The two
    emulated GEMMs are kept out of the module tree so only this module is discovered."""

    def __init__(self, recipe: DelayedScalingRecipe) -> None:
        super().__init__()
        self.gemms = [Fp8Linear(8, 16, recipe=recipe), Fp8Linear(16, 8, recipe=recipe)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemms[1](torch.relu(self.gemms[0](x)))

    @property
    def fp8_meta(self) -> dict[str, object]:
        return te_fp8_meta(self.gemms)


# --- a fake of torchao's delayed-scaling Float8Linear ---------------------------------------


class ScalingType(Enum):
    """Mirrors torchao.float8.config.ScalingType."""

    DELAYED = "delayed"
    DYNAMIC = "dynamic"


@dataclass
class CastConfig:
    scaling_type: ScalingType
    target_dtype: torch.dtype | None = None


@dataclass
class DelayedScalingConfig:
    history_len: int
    scale_fn_name: str = "max"


@dataclass
class Float8LinearConfig:
    cast_config_input: CastConfig
    cast_config_weight: CastConfig
    cast_config_grad_output: CastConfig
    delayed_scaling_config: DelayedScalingConfig


class FakeTorchaoFloat8Linear(Fp8Linear):
    """torchao's delayed scaling (0.4-0.9) is not installed here: this fake mirrors its buffers,
    fp8_amax_history_<role> [L] newest first and fp8_scale_<role> [1], plus its config, filled
    from the emulated module's real state (torchao's sync runs where the emulation updates)."""

    def __init__(self, *args: int, recipe: DelayedScalingRecipe, weight_delayed: bool = True) -> None:
        super().__init__(*args, recipe=recipe)
        delayed = CastConfig(ScalingType.DELAYED)
        self.config = Float8LinearConfig(
            cast_config_input=delayed,
            cast_config_weight=delayed if weight_delayed else CastConfig(ScalingType.DYNAMIC),
            cast_config_grad_output=CastConfig(ScalingType.DELAYED, target_dtype=torch.float8_e5m2),
            delayed_scaling_config=DelayedScalingConfig(recipe.history_len),
        )

    def _history(self, col: int) -> torch.Tensor:
        return self.amax_history[:, col].flip(0)

    @property
    def fp8_amax_history_input(self) -> torch.Tensor:
        return self._history(0)

    @property
    def fp8_amax_history_weight(self) -> torch.Tensor:
        return self._history(1)

    @property
    def fp8_amax_history_grad_output(self) -> torch.Tensor:
        return self._history(2)

    @property
    def fp8_scale_input(self) -> torch.Tensor:
        return self.scale[0:1]

    @property
    def fp8_scale_weight(self) -> torch.Tensor:
        return self.scale[1:2]

    @property
    def fp8_scale_grad_output(self) -> torch.Tensor:
        return self.scale[2:3]


# --- tests ----------------------------------------------------------------------------------


def train_steps(model: nn.Module, in_features: int, n: int = 3, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        x = torch.randn(4, in_features, generator=g) * (i + 1)
        y = model(x)
        y.backward(torch.randn(y.shape, generator=g) * 1e-2 * (i + 1))


def recipe(**kw: object) -> DelayedScalingRecipe:
    return DelayedScalingRecipe(**{"history_len": 5, **kw})  # type: ignore[arg-type]


def test_emulated_state_is_the_modules_own_buffers() -> None:
    model = nn.Sequential(Fp8Linear(8, 8, recipe=recipe(margin=1)), nn.ReLU(), nn.Linear(8, 2))
    train_steps(model, 8)
    [(fqn, state)] = find_fp8_modules(model)
    assert fqn == "0" and isinstance(state, EmulatedFp8State) and isinstance(state, Fp8State)
    layer = model[0]
    assert state.amax_history() is layer.amax_history and state.scale() is layer.scale
    assert state.roles == ROLES and [state.fmt(r) for r in ROLES] == ["e4m3", "e4m3", "e5m2"]
    assert (state.margin, state.history_len, state.amax_compute_algo) == (1, 5, "max")
    assert state.newest_row() == 4
    newest = state.amax_history()[state.newest_row()]
    assert newest[0].item() > 0 and state.amax_history()[0].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(("algo", "margin"), [("max", 0), ("most_recent", 2)])
def test_te_adapter_returns_the_emulated_numbers(algo: str, margin: int) -> None:
    model = nn.Sequential(FakeTeLinear(8, 6, recipe=recipe(amax_compute_algo=algo, margin=margin)))
    train_steps(model, 8, n=7)
    [(fqn, state)] = find_fp8_modules(model)
    assert fqn == "0" and isinstance(state, TransformerEngineFp8State)  # TE adapter wins over Fp8Linear
    layer = model[0]
    assert torch.equal(state.amax_history(), layer.amax_history)
    assert torch.equal(state.scale(), layer.scale)
    assert state.newest_row() == 4 and state.roles == ROLES
    assert (state.margin, state.history_len, state.amax_compute_algo) == (margin, 5, algo)
    assert [state.fmt(r) for r in ROLES] == ["e4m3", "e4m3", "e5m2"]


def test_te_adapter_reads_each_gemm_of_a_multi_gemm_module() -> None:
    model = nn.Sequential(nn.Linear(8, 8), FakeTeLayerNormMLP(recipe()))
    train_steps(model, 8)
    found = find_fp8_modules(model)
    assert [fqn for fqn, _ in found] == ["1.gemm0", "1.gemm1"]
    for (_, state), gemm in zip(found, model[1].gemms, strict=True):
        assert torch.equal(state.amax_history(), gemm.amax_history)
        assert torch.equal(state.scale(), gemm.scale)
    # The two GEMMs saw different tensors, so a column mix-up could not pass unnoticed.
    assert not torch.equal(found[0][1].amax_history(), found[1][1].amax_history())


@pytest.mark.parametrize(("fmt", "formats"), [(TeFormat.E4M3, ("e4m3",) * 3), (TeFormat.E5M2, ("e5m2",) * 3)])
def test_te_adapter_maps_te_formats(fmt: TeFormat, formats: tuple[str, ...]) -> None:
    class Fake(Fp8Linear):
        """TE cannot run here: te.Linear's fp8_meta under a non-HYBRID Format."""

        @property
        def fp8_meta(self) -> dict[str, object]:
            return te_fp8_meta([self], fmt)

    [(_, state)] = find_fp8_modules(nn.Sequential(Fake(4, 4, recipe=recipe())))
    assert tuple(state.fmt(r) for r in ROLES) == formats


def test_te_modules_without_delayed_state_are_not_returned() -> None:
    class Uninitialised(nn.Module):
        """TE cannot run here: a TE module before its first FP8 forward has an empty fp8_meta."""

        fp8_meta: dict[str, object] = {}

    class CurrentScaling(FakeTeLinear):
        """TE cannot run here: under Float8CurrentScaling the recipe says it is not delayed."""

        @property
        def fp8_meta(self) -> dict[str, object]:
            meta = te_fp8_meta([self])
            meta["recipe"].is_delayed = False  # type: ignore[attr-defined]
            return meta

    model = nn.Sequential(Uninitialised(), CurrentScaling(4, 4, recipe=recipe()))
    assert find_fp8_modules(model) == []


def test_torchao_adapter_returns_the_emulated_numbers_in_one_row_order() -> None:
    model = nn.Sequential(FakeTorchaoFloat8Linear(8, 6, recipe=recipe()))
    train_steps(model, 8, n=7)
    [(fqn, state)] = find_fp8_modules(model)
    assert fqn == "0" and isinstance(state, TorchaoFp8State)
    layer = model[0]
    # torchao keeps the newest amax first; the adapter flips it so that, like TE, row L-1 is newest.
    assert layer.fp8_amax_history_input[0].item() == layer.amax_history[-1, 0].item()
    assert torch.equal(state.amax_history(), layer.amax_history)
    assert torch.equal(state.scale(), layer.scale)
    assert state.newest_row() == 4 and state.roles == ROLES
    assert (state.margin, state.history_len, state.amax_compute_algo) == (0, 5, "max")
    assert [state.fmt(r) for r in ROLES] == ["e4m3", "e4m3", "e5m2"]


def test_torchao_adapter_reports_only_the_delayed_roles() -> None:
    model = nn.Sequential(FakeTorchaoFloat8Linear(8, 6, recipe=recipe(), weight_delayed=False))
    train_steps(model, 8)
    [(_, state)] = find_fp8_modules(model)
    layer = model[0]
    assert state.roles == ("input", "grad_output")
    assert torch.equal(state.amax_history(), layer.amax_history[:, [0, 2]])
    assert torch.equal(state.scale(), layer.scale[[0, 2]])
    with pytest.raises(KeyError):
        state.fmt("weight")


def build(kind: str, rec: DelayedScalingRecipe) -> nn.Module:
    cls = {"emulated": Fp8Linear, "te": FakeTeLinear, "torchao": FakeTorchaoFloat8Linear}[kind]
    return nn.Sequential(cls(16, 8, recipe=rec))


@pytest.mark.parametrize("kind", ["emulated", "te", "torchao"])
def test_headroom_from_the_interface_shows_an_8x_jump_as_minus_3_bits(kind: str) -> None:
    """What the monitor will do: keep last step's scale(), read this step's newest amax."""
    torch.manual_seed(0)
    model = build(kind, DelayedScalingRecipe(history_len=16))
    [(_, state)] = find_fp8_modules(model)
    x = torch.randn(8, 16)
    headroom = []
    for t in range(8):
        s_used = state.scale().clone()  # the multiplier this step will cast with
        model(x * (8 if t >= 5 else 1)).sum().backward()
        amax = state.amax_history()[state.newest_row()]
        headroom.append(math.log2(448.0 / (amax[0] * s_used[0]).item()))
    # Step 0 casts with the initial scale 1; then steady (0 bits), the jump (-3), caught up (0).
    assert headroom[1:] == pytest.approx([0, 0, 0, 0, -3, 0, 0], abs=1e-4)


def test_discovery_never_imports_transformer_engine_or_torchao() -> None:
    model = nn.Sequential(FakeTeLinear(4, 4, recipe=recipe()), FakeTorchaoFloat8Linear(4, 4, recipe=recipe()))
    kinds = [type(state).__name__ for _, state in find_fp8_modules(model)]
    assert kinds == ["TransformerEngineFp8State", "TorchaoFp8State"]
    assert not any(m.split(".")[0] in ("transformer_engine", "torchao") for m in sys.modules)
