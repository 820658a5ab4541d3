"""The emulated FP8 delayed-scaling Linear: real casts, TE's update rule, trains on CPU."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainvitals.agent.fp8_emulation import (
    FP8_MAX,
    DelayedScalingRecipe,
    Fp8Linear,
    convert_linears,
    quantize_dequantize,
)

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2


def fp8_grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a float8 dtype, sorted, decoded from all 256 bit patterns."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return values[torch.isfinite(values)].unique().sort().values


def with_amax(a: float, shape: tuple[int, ...] = (6, 8), seed: int = 0) -> torch.Tensor:
    """A random tensor whose max |x| is exactly a."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g) * 2 - 1
    x[0, 0] = 1.0
    return x * a


def step(layer: Fp8Linear, x: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor:
    """One forward + backward; `grad` becomes the layer's grad_output."""
    y = layer(x)
    y.backward(torch.ones_like(y) if grad is None else grad)
    return y.detach()


# --- the casts ------------------------------------------------------------------------------


def test_e4m3_values_snap_to_the_nearest_grid_point() -> None:
    grid = fp8_grid(torch.float8_e4m3fn)
    assert grid.max().item() == 448.0 and len(grid) == 253  # 126 positive, 126 negative, 0
    x = torch.randn(4096) * 40
    q = quantize_dequantize(x, 1.0, "e4m3")
    assert bool(torch.isin(q, grid).all())
    # Round to nearest: no grid point is closer to x than the one chosen.
    idx = torch.searchsorted(grid, x.clamp(-448, 448)).clamp(1, len(grid) - 1)
    nearest = torch.minimum((grid[idx] - x).abs(), (grid[idx - 1] - x).abs())
    assert torch.equal((q - x).abs(), nearest)
    assert len(q.unique()) < len(x) / 10  # it really is 8 bits


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (17.0, 16.0),  # tie between 16 and 18: to even mantissa
        (19.0, 20.0),  # tie between 18 and 20: to even mantissa
        (0.3, 0.3125),
        (448.0, 448.0),
        (500.0, 448.0),  # saturates (fp8.md: E4M3 max 448)
        (-1e6, -448.0),
        (math.inf, 448.0),
        (2.0**-9, 2.0**-9),  # min subnormal
        (2.0**-10, 0.0),  # <= 2^-10 rounds to 0 (fp8.md)
        (1.01 * 2.0**-10, 2.0**-9),
    ],
)
def test_e4m3_cast_table(value: float, expected: float) -> None:
    assert quantize_dequantize(torch.tensor([value]), 1.0, "e4m3").item() == expected


def test_scale_is_applied_before_the_cast_and_divided_out_after() -> None:
    # 1.1 * 3 = 3.3 -> 3.25 (spacing 0.25 in [2, 4)) -> 3.25 / 3; at s = 1 it would be 1.125.
    x = torch.tensor([1.1])
    assert quantize_dequantize(x, torch.tensor(3.0), "e4m3").item() == (torch.tensor(3.25) / 3).item()
    assert quantize_dequantize(x, 1.0, "e4m3").item() == 1.125
    # Saturation happens on x * s: 1000 * 0.5 = 500 -> 448 -> 896.
    assert quantize_dequantize(torch.tensor([1000.0]), torch.tensor(0.5), "e4m3").item() == 896.0


def test_e5m2_saturates_by_default_and_overflows_to_inf_on_request() -> None:
    x = torch.tensor([60000.0, 61440.0, -7e4, math.inf, math.nan, 2.0**-17, 1.01 * 2.0**-17])
    sat = quantize_dequantize(x, 1.0, "e5m2")
    assert sat[:4].tolist() == [57344.0, 57344.0, -57344.0, 57344.0]
    assert math.isnan(sat[4].item())
    assert sat[5:].tolist() == [0.0, 2.0**-16]
    inf = quantize_dequantize(x, 1.0, "e5m2", e5m2_overflow="inf")
    # 60000 rounds down to 57344; from 61440 (half way to 2^16) round-to-nearest-even overflows.
    assert inf[:4].tolist() == [57344.0, math.inf, -math.inf, math.inf]
    assert bool(torch.isin(sat[torch.isfinite(sat)], fp8_grid(torch.float8_e5m2)).all())


def test_bf16_tensors_round_trip_in_bf16() -> None:
    x = torch.randn(64, dtype=torch.bfloat16)
    q = quantize_dequantize(x, torch.tensor(4.0), "e4m3")
    assert q.dtype == torch.bfloat16
    assert bool(torch.isin((q.float() * 4), fp8_grid(torch.float8_e4m3fn)).all())


# --- the recipe -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"history_len": 0},
        {"history_len": 2.0},
        {"amax_compute_algo": "mean"},
        {"margin": -1},
        {"margin": 0.5},
        {"input_format": "e3m4"},
        {"e5m2_overflow": "wrap"},
    ],
)
def test_recipe_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises((ValueError, TypeError)):
        DelayedScalingRecipe(**kwargs)


def test_recipe_defaults_are_te_hybrid() -> None:
    r = DelayedScalingRecipe()
    assert (r.history_len, r.amax_compute_algo, r.margin) == (1024, "max", 0)
    assert r.formats == ("e4m3", "e4m3", "e5m2") == DelayedScalingRecipe.from_te_format("HYBRID").formats
    assert DelayedScalingRecipe.from_te_format("E4M3", margin=2).formats == ("e4m3",) * 3
    assert r.fmt("grad_output") == "e5m2"
    with pytest.raises(ValueError):
        DelayedScalingRecipe.from_te_format("E3M4")


# --- the delayed-scaling update -------------------------------------------------------------


def expected_scale(amaxes: list[float], fp8_max: float, *, L: int, algo: str, margin: int) -> float:
    """fp8.md: A = max over the last L amaxes ('max') or the newest; s = (fp8_max / A) / 2**margin;
    A == 0 keeps the old scale (here the initial 1.0)."""
    s = 1.0
    for t in range(len(amaxes)):
        window = amaxes[max(0, t - L + 1) : t + 1]
        a = max(window) if algo == "max" else window[-1]
        if a > 0 and math.isfinite(a):
            s = (fp8_max / a) / 2**margin
    return s


@pytest.mark.parametrize(("algo", "margin"), [("max", 0), ("max", 2), ("most_recent", 0), ("most_recent", 3)])
def test_scale_update_follows_the_delayed_scaling_formula(algo: str, margin: int) -> None:
    L = 3
    layer = Fp8Linear(8, 5, recipe=DelayedScalingRecipe(history_len=L, amax_compute_algo=algo, margin=margin))
    x_amax = [1.0, 4.0, 2.0, 0.5, 0.25, 0.25, 3.0]
    g_amax = [0.01, 0.02, 0.005, 0.001, 0.004, 0.0001, 0.03]
    for t, (xa, ga) in enumerate(zip(x_amax, g_amax, strict=True)):
        # Before step t: built from amaxes up to t-1 only.
        assert layer.scale[INPUT].item() == pytest.approx(
            expected_scale(x_amax[:t], 448.0, L=L, algo=algo, margin=margin), rel=1e-6
        )
        assert layer.scale[GRAD_OUTPUT].item() == pytest.approx(
            expected_scale(g_amax[:t], 57344.0, L=L, algo=algo, margin=margin), rel=1e-6
        )
        step(layer, with_amax(xa, seed=t), with_amax(ga, shape=(6, 5), seed=100 + t))
        newest = layer.amax_history[L - 1]
        assert newest[INPUT].item() == pytest.approx(xa, rel=1e-7)
        assert newest[GRAD_OUTPUT].item() == pytest.approx(ga, rel=1e-7)
        assert newest[WEIGHT].item() == layer.weight.abs().max().item()
        assert layer.amax_history[0].tolist() == [0.0, 0.0, 0.0]  # TE's cleared slot
        # After the step the scale already includes amax_t: it is the one step t+1 will use.
        assert layer.scale[INPUT].item() == pytest.approx(
            expected_scale(x_amax[: t + 1], 448.0, L=L, algo=algo, margin=margin), rel=1e-6
        )


def test_the_forward_casts_with_the_scale_built_before_this_step() -> None:
    torch.manual_seed(0)
    layer = Fp8Linear(16, 8, recipe=DelayedScalingRecipe(history_len=4))
    step(layer, torch.randn(4, 16))
    s_before = layer.scale.clone()
    x = torch.randn(4, 16) * 8  # an amax this step's scale has not seen
    y = step(layer, x)
    manual = F.linear(
        quantize_dequantize(x, s_before[INPUT], "e4m3"),
        quantize_dequantize(layer.weight.detach(), s_before[WEIGHT], "e4m3"),
        layer.bias.detach(),
    )
    assert torch.equal(y, manual)
    assert not torch.equal(layer.scale, s_before)  # ... and the update happened after the cast


def test_zero_or_nonfinite_amax_keeps_the_old_scale() -> None:
    layer = Fp8Linear(8, 4, recipe=DelayedScalingRecipe(history_len=2, amax_compute_algo="most_recent"))
    step(layer, with_amax(2.0))
    assert layer.scale[INPUT].item() == 224.0
    step(layer, torch.zeros(3, 8))
    assert layer.amax_history[-1, INPUT].item() == 0.0
    assert layer.scale[INPUT].item() == 224.0
    with torch.no_grad():
        layer.weight.fill_(0.0)  # weight amax 0 from now on: its scale must stay where it is
    s_weight = layer.scale[WEIGHT].item()
    step(layer, with_amax(4.0) * torch.tensor(math.inf))  # inf (and NaN) in the input
    assert layer.scale[INPUT].item() == 224.0
    assert layer.scale[WEIGHT].item() == s_weight
    step(layer, with_amax(4.0))
    assert layer.scale[INPUT].item() == 112.0


@pytest.mark.parametrize(("algo", "margin"), [("max", 0), ("max", 1), ("most_recent", 0)])
def test_an_8x_input_jump_clips_3_bits_minus_margin(algo: str, margin: int) -> None:
    torch.manual_seed(0)
    rec = DelayedScalingRecipe(history_len=16, amax_compute_algo=algo, margin=margin)
    layer = Fp8Linear(32, 16, recipe=rec)
    x = torch.randn(8, 32)
    for _ in range(5):
        step(layer, x)
    s_t = layer.scale[INPUT].clone()  # the multiplier the jump step casts with
    step(layer, 8 * x)
    amax_t = layer.amax_history[-1, INPUT]
    headroom = math.log2(448.0 / (amax_t * s_t).item())
    assert headroom == pytest.approx(margin - 3.0, abs=1e-4)  # fp8.md: an 8x jump gives H = -3
    # The largest inputs really clipped: dequantised max is fp8_max / s, an eighth of 8x's amax.
    clipped = quantize_dequantize(8 * x, s_t, "e4m3")
    assert clipped.abs().max().item() == pytest.approx(448.0 / s_t.item(), rel=1e-6)
    # The next step's scale has caught up: no clipping left.
    assert math.log2(448.0 / (amax_t * layer.scale[INPUT]).item()) == pytest.approx(margin, abs=1e-4)


def test_backward_quantises_grad_output_and_passes_gradients_straight_through() -> None:
    torch.manual_seed(0)
    layer = Fp8Linear(16, 8, recipe=DelayedScalingRecipe(history_len=4))
    step(layer, torch.randn(4, 16), torch.randn(4, 8) * 1e-3)
    s = layer.scale.clone()
    x = torch.randn(4, 16, requires_grad=True)
    g = torch.randn(4, 8) * 1e-3
    layer.zero_grad()
    layer(x).backward(g)
    g_hat = quantize_dequantize(g, s[GRAD_OUTPUT], "e5m2")
    x_hat = quantize_dequantize(x.detach(), s[INPUT], "e4m3")
    w_hat = quantize_dequantize(layer.weight.detach(), s[WEIGHT], "e4m3")
    assert not torch.equal(g_hat, g)  # E5M2 really rounds the gradient
    torch.testing.assert_close(layer.weight.grad, g_hat.t() @ x_hat, rtol=1e-6, atol=0)
    torch.testing.assert_close(x.grad, g_hat @ w_hat, rtol=1e-6, atol=0)
    torch.testing.assert_close(layer.bias.grad, g.sum(0))  # dbias from the unquantised gradient
    assert layer.amax_history[-1, GRAD_OUTPUT].item() == g.abs().max().item()


def test_no_grad_forward_neither_records_nor_updates() -> None:
    layer = Fp8Linear(8, 4, recipe=DelayedScalingRecipe(history_len=4))
    step(layer, with_amax(1.0))
    history, scale = layer.amax_history.clone(), layer.scale.clone()
    with torch.no_grad():
        layer(with_amax(100.0))
    assert torch.equal(layer.amax_history, history) and torch.equal(layer.scale, scale)


def test_a_two_layer_mlp_trains_through_fp8_on_cpu() -> None:
    torch.manual_seed(0)
    recipe = DelayedScalingRecipe(history_len=16)
    model = nn.Sequential(Fp8Linear(16, 64, recipe=recipe), nn.ReLU(), Fp8Linear(64, 1, recipe=recipe))
    x = torch.randn(256, 16)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.5 * x[:, 4:5]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(50):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]
    for layer in (model[0], model[2]):
        assert bool(torch.isfinite(layer.amax_history).all())
        assert bool((layer.scale != 1.0).all())  # every role's scale was driven by real amaxes


def test_convert_linears_swaps_counts_and_keeps_outputs_within_fp8_error() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(32, 32)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), shared, nn.GELU(), shared,
        nn.Sequential(nn.Linear(32, 32, bias=False)), nn.Linear(32, 4),
    )
    model.eval()
    x = torch.randn(64, 16)
    with torch.no_grad():
        reference = model(x)
    first_weight = model[0].weight
    n = convert_linears(model, DelayedScalingRecipe(history_len=8), filter=lambda fqn, m: fqn != "6")
    assert n == 3  # "0", the shared one (once), "5.0"; "6" filtered out
    assert [type(m).__name__ for m in model] == [
        "Fp8Linear", "GELU", "Fp8Linear", "GELU", "Fp8Linear", "Sequential", "Linear",
    ]
    assert model[2] is model[4] and isinstance(model[5][0], Fp8Linear) and model[5][0].bias is None
    assert model[0].weight is first_weight and not model[0].training
    model.train()
    model(x).sum().backward()  # one step: scales now fitted to the data
    with torch.no_grad():
        out = model(x)
    rel = ((out - reference).norm() / reference.norm()).item()
    assert 0 < rel < 0.05


def test_state_is_float32_in_the_state_dict_and_survives_a_bf16_cast() -> None:
    torch.manual_seed(0)
    layer = Fp8Linear(8, 4, recipe=DelayedScalingRecipe(history_len=4))
    step(layer, torch.randn(3, 8) * 3.3)
    history, scale = layer.amax_history.clone(), layer.scale.clone()
    layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16
    assert layer.amax_history.dtype == torch.float32 and torch.equal(layer.amax_history, history)
    assert torch.equal(layer.scale, scale)
    y = step(layer, torch.randn(3, 8, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and layer.weight.grad.dtype == torch.bfloat16
    state = layer.state_dict()
    assert set(state) == {"weight", "bias", "amax_history", "scale"}
    fresh = Fp8Linear(8, 4, dtype=torch.bfloat16, recipe=DelayedScalingRecipe(history_len=4))
    fresh.load_state_dict(state)
    assert torch.equal(fresh.amax_history, layer.amax_history) and torch.equal(fresh.scale, layer.scale)


def test_fp8_max_constants() -> None:
    assert FP8_MAX["e4m3"] == torch.finfo(torch.float8_e4m3fn).max
    assert FP8_MAX["e5m2"] == torch.finfo(torch.float8_e5m2).max
