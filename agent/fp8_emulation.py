"""Emulated FP8 delayed scaling: a Linear that really trains through float8 casts on any device.

`Fp8Linear` follows Transformer Engine's `DelayedScaling` recipe (TE `transformer_engine.common.
recipe.DelayedScaling`, update rule in `transformer_engine/pytorch/fp8.py` and
`transformer_engine/common/recipe/delayed_scaling.cu`), with tensors cast by torch's own
`float8_e4m3fn` / `float8_e5m2` dtypes and the GEMM done in high precision on the dequantised
values. That lets a CPU job train through FP8 quantisation and gives the agent a real amax history
and scale to read (see `trainvitals.agent.fp8_recipes`).

State, per module, laid out as TE's `fp8_meta[...]` buffers:

- `amax_history` [L, 3]: columns INPUT, WEIGHT, GRAD_OUTPUT (`ROLES`). Row 0 is the slot the next
  cast writes its amax into; the update rolls the history up by one row (row i <- row i+1, the
  amax just recorded lands in row L-1) and clears row 0, exactly like TE. Between steps the newest
  amax is therefore in row L-1 and rows 1..L-1 run oldest to newest.
- `scale` [3]: the multiplier s applied before each cast (`q = cast(x * s)`, `x_hat = q / s`;
  TE `scale`, scale_inv = 1/s).

When the update happens (the same points as current TE, so a reader sees the same layout):
the INPUT and WEIGHT scales are updated at the end of every grad-enabled forward, right after this
step's amaxes are recorded (TE: `fp8_autocast` exit); the GRAD_OUTPUT scale at the end of this
module's backward (TE: after the backward pass). Either way the scale a cast uses at step t was
built from amaxes up to step t-1, and between steps `scale` holds the multiplier the next step
will use. Older TE releases ran the same update at the start of the next forward/backward instead;
the numbers are identical, only the moment the buffers change differs.

Deliberate differences from TE: forwards under `torch.no_grad()` (evaluation) cast with the
current scales but neither record nor update, so evaluation batches never move the training
scales; amaxes are not all-reduced across ranks (under DDP the default `broadcast_buffers=True`
makes every rank use rank 0's state); activation-checkpoint recomputation records a second time
(TE restores the forward's meta for the recompute).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx, once_differentiable

# Re-exported: the roles' column order and the formats' maxima are wire conventions.
from trainvitals.wire.conventions import FP8_MAX, ROLES, Fp8Format

__all__ = [
    "FP8_MAX",
    "ROLES",
    "DelayedScalingRecipe",
    "Fp8Linear",
    "convert_linears",
    "quantize_dequantize",
]

# ROLES is also the column order of `Fp8Linear.amax_history` and `Fp8Linear.scale` (TE/torchao
# roles); FP8_MAX the formats' largest finite values (OCP FP8 spec; TE `fp8_dtype_max` in
# delayed_scaling.cu; fp8.md "Formats").
_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# E5M2 spacing in [2^15, 2^16) is 2^13, so round-to-nearest-even sends |x| >= 57344 + 2^12 to the
# next binade, 2^16, which does not exist: IEEE overflow to inf. Below it the cast rounds to 57344.
_E5M2_OVERFLOW_AT = 61440.0

# TE `Format` names (transformer_engine.common.recipe.Format) -> (input, weight, grad_output).
_TE_FORMATS: dict[str, tuple[Fp8Format, Fp8Format, Fp8Format]] = {
    "HYBRID": ("e4m3", "e4m3", "e5m2"),
    "E4M3": ("e4m3", "e4m3", "e4m3"),
    "E5M2": ("e5m2", "e5m2", "e5m2"),
}

_INPUT, _WEIGHT, _GRAD_OUTPUT = 0, 1, 2
# Forward and backward roles are updated at different points of the step, as in TE.
_FWD = slice(_INPUT, _WEIGHT + 1)
_BWD = slice(_GRAD_OUTPUT, _GRAD_OUTPUT + 1)
_STATE_BUFFERS = ("amax_history", "scale", "_fp8_max")


@dataclass(kw_only=True, slots=True, frozen=True)
class DelayedScalingRecipe:
    """Transformer Engine's `DelayedScaling`, with the FP8 format spelled out per role.

    Defaults are TE's (HYBRID formats, L = 1024, 'max', margin 0). Megatron-core's defaults are
    `history_len=1, amax_compute_algo="most_recent"`.

    Usage::

        recipe = DelayedScalingRecipe(history_len=16, margin=1)
        layer = Fp8Linear(512, 512, recipe=recipe)
        megatron = DelayedScalingRecipe.from_te_format("HYBRID", history_len=1,
                                                       amax_compute_algo="most_recent")
    """

    input_format: Fp8Format = "e4m3"
    """Format of the forward input (activation) cast."""
    weight_format: Fp8Format = "e4m3"
    """Format of the weight cast."""
    grad_output_format: Fp8Format = "e5m2"
    """Format of the incoming gradient cast in backward (E5M2: range over precision)."""
    history_len: int = 1024
    """L, rows of the amax history per role (TE `amax_history_len`, default 1024)."""
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    """A for the update: max over the history ('max') or the newest amax ('most_recent')."""
    margin: int = 0
    """Bits of headroom kept below the format's max: s = (fp8_max / A) / 2**margin."""
    e5m2_overflow: Literal["saturate", "inf"] = "saturate"
    """What an E5M2 cast does with |x * s| beyond 57344. 'saturate' (default) clamps to +-57344 as
    TE's kernels do (CUDA `__nv_fp8_e5m2` conversions use __NV_SATFINITE) and torchao does
    (`to_fp8_saturated`). 'inf' is a bare IEEE cast (torch's `.to(torch.float8_e5m2)`): values
    that round past 57344 become +-inf and propagate into the gradients. E4M3 (`e4m3fn`) has no
    inf and always saturates to +-448."""

    def __post_init__(self) -> None:
        for name in ("input_format", "weight_format", "grad_output_format"):
            if getattr(self, name) not in FP8_MAX:
                raise ValueError(f"{name} must be 'e4m3' or 'e5m2', got {getattr(self, name)!r}")
        if isinstance(self.history_len, bool) or not isinstance(self.history_len, int):
            raise TypeError("history_len must be an int")
        if self.history_len < 1:
            raise ValueError("history_len must be >= 1")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError("amax_compute_algo must be 'max' or 'most_recent'")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError("margin must be an int >= 0 (bits)")
        if self.e5m2_overflow not in ("saturate", "inf"):
            raise ValueError("e5m2_overflow must be 'saturate' or 'inf'")

    @classmethod
    def from_te_format(cls, fp8_format: str, **kwargs: Any) -> DelayedScalingRecipe:
        """Formats as TE's `Format`: 'HYBRID' (E4M3 forward, E5M2 backward), 'E4M3' or 'E5M2'."""
        try:
            input_format, weight_format, grad_output_format = _TE_FORMATS[fp8_format.upper()]
        except KeyError:
            raise ValueError(f"fp8_format must be one of {sorted(_TE_FORMATS)}") from None
        return cls(
            input_format=input_format,
            weight_format=weight_format,
            grad_output_format=grad_output_format,
            **kwargs,
        )

    @property
    def formats(self) -> tuple[Fp8Format, Fp8Format, Fp8Format]:
        """Formats in `ROLES` order."""
        return (self.input_format, self.weight_format, self.grad_output_format)

    def fmt(self, role: str) -> Fp8Format:
        """The format of one role of `ROLES`."""
        return self.formats[ROLES.index(role)]


def quantize_dequantize(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    fmt: str,
    *,
    e5m2_overflow: Literal["saturate", "inf"] = "saturate",
) -> torch.Tensor:
    """x_hat = cast(x * s) / s through a real float8 dtype, returned in x's dtype.

    Saturation is applied explicitly before the cast (fp8.md: CPU cast behaviour on overflow
    changed between torch versions), so the result does not depend on the torch build. NaN stays
    NaN. See `DelayedScalingRecipe.e5m2_overflow` for E5M2.

    Usage::

        x_hat = quantize_dequantize(x, torch.tensor(448.0) / x.abs().amax(), "e4m3")
    """
    fp8_max = FP8_MAX[fmt]
    scaled = x.float() * scale
    q = scaled.clamp(-fp8_max, fp8_max)
    if fmt == "e5m2" and e5m2_overflow == "inf":
        q = torch.where(scaled.abs() >= _E5M2_OVERFLOW_AT, scaled.sign() * math.inf, q)
    return (q.to(_DTYPES[fmt]).float() / scale).to(x.dtype)


def _amax(t: torch.Tensor) -> torch.Tensor:
    # An empty batch has no amax; 0 is what TE records and the update then ignores it (A == 0).
    if t.numel() == 0:
        return torch.zeros((), device=t.device)
    return t.detach().abs().amax().float()


class _Fp8LinearFunction(torch.autograd.Function):
    """Forward: cast input and weight with the current scales, GEMM on the dequantised values.
    Backward: cast grad_output with its scale; gradients straight through the casts."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        module: Fp8Linear,
        record: bool,
    ) -> torch.Tensor:
        s = module.scale
        overflow = module.recipe.e5m2_overflow
        x_hat = quantize_dequantize(x, s[_INPUT], module.formats[_INPUT], e5m2_overflow=overflow)
        w_hat = quantize_dequantize(weight, s[_WEIGHT], module.formats[_WEIGHT], e5m2_overflow=overflow)
        if record:
            module.amax_history[0, _FWD] = torch.stack((_amax(x), _amax(weight)))
            module._update_scales(_FWD)
        # Straight-through: backward differentiates the GEMM at the dequantised operands.
        ctx.save_for_backward(x_hat, w_hat)
        ctx.module = module  # type: ignore[attr-defined]
        ctx.record = record  # type: ignore[attr-defined]
        ctx.has_bias = bias is not None  # type: ignore[attr-defined]
        return F.linear(x_hat, w_hat, bias)

    @staticmethod
    @once_differentiable
    def backward(
        ctx: FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None]:
        x_hat, w_hat = ctx.saved_tensors  # type: ignore[attr-defined]
        module: Fp8Linear = ctx.module  # type: ignore[attr-defined]
        g_hat = quantize_dequantize(
            grad_out,
            module.scale[_GRAD_OUTPUT],
            module.formats[_GRAD_OUTPUT],
            e5m2_overflow=module.recipe.e5m2_overflow,
        )
        if ctx.record:  # type: ignore[attr-defined]
            module.amax_history[0, _GRAD_OUTPUT] = _amax(grad_out)
            module._update_scales(_BWD)
        needs = ctx.needs_input_grad  # type: ignore[attr-defined]
        grad_x = g_hat @ w_hat if needs[0] else None
        grad_w = None
        if needs[1]:
            g2 = g_hat.reshape(-1, g_hat.shape[-1])
            grad_w = (g2.t() @ x_hat.reshape(-1, x_hat.shape[-1])).to(w_hat.dtype)
        # TE derives dbias from the high-precision gradient (fused cast-transpose-dbias).
        grad_b = None
        if ctx.has_bias and needs[2]:  # type: ignore[attr-defined]
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_w, grad_b, None, None


class Fp8Linear(nn.Linear):
    """`nn.Linear` trained through emulated FP8 delayed scaling (Transformer Engine's recipe).

    Buffers (float32, saved in the state dict so a resume keeps the history): `amax_history`
    [L, 3] and `scale` [3], columns in `ROLES` order; see the module docstring for the layout and
    when they change.

    Usage::

        layer = Fp8Linear(256, 256, recipe=DelayedScalingRecipe(history_len=16))
        loss = layer(x).square().mean()
        loss.backward()                 # scales for the next step are now in layer.scale
        layer.amax_history[-1]          # this step's amax of input, weight, grad_output
    """

    amax_history: torch.Tensor
    scale: torch.Tensor
    _fp8_max: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: DelayedScalingRecipe | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe if recipe is not None else DelayedScalingRecipe()
        self.formats = self.recipe.formats
        self._init_fp8_state(self.weight.device)

    def _init_fp8_state(self, device: torch.device) -> None:
        # TE initialises the history to zeros and the scales to ones (fp8.py init_fp8_meta_tensors).
        f32 = torch.float32
        L = self.recipe.history_len
        self.register_buffer("amax_history", torch.zeros(L, len(ROLES), device=device, dtype=f32))
        self.register_buffer("scale", torch.ones(len(ROLES), device=device, dtype=f32))
        fp8_max = [FP8_MAX[f] for f in self.formats]
        self.register_buffer("_fp8_max", torch.tensor(fp8_max, device=device), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: DelayedScalingRecipe) -> Fp8Linear:
        """An Fp8Linear holding `linear`'s own Parameters (moved, not copied: an optimizer built
        before the swap keeps updating them)."""
        # Build on the meta device so no weight is allocated or initialised just to be replaced.
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            recipe=recipe,
        )
        new.weight = linear.weight
        new.bias = linear.bias
        new._init_fp8_state(linear.weight.device)
        new.train(linear.training)
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # Record and update only when gradients flow, as TE's autocast exit does: evaluation
        # under no_grad must not move the training scales.
        record = torch.is_grad_enabled()
        return _Fp8LinearFunction.apply(input, self.weight, self.bias, self, record)

    @torch.no_grad()
    def _update_scales(self, cols: slice) -> None:
        """TE's delayed-scaling update for the roles in `cols`, all on device, no sync."""
        history = self.amax_history[:, cols]
        if self.recipe.amax_compute_algo == "max":
            amax = history.amax(dim=0)  # NaN propagates, so a NaN amax keeps the old scale
        else:
            amax = history[0].clone()
        # TE fp8.py `_default_sf_compute`: sf = (fp8_max / amax) / 2**margin; amax == 0 or
        # non-finite keeps the previous scale.
        new_scale = (self._fp8_max[cols] / amax) / (2.0**self.recipe.margin)
        usable = torch.isfinite(amax) & (amax > 0)
        self.scale[cols] = torch.where(usable, new_scale, self.scale[cols])
        # TE `_update_amax_history`: roll up by one row, clear row 0 for the next amax.
        self.amax_history[:, cols] = history.roll(-1, dims=0)
        self.amax_history[0, cols] = 0.0

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Fp8Linear:
        # `model.to(torch.bfloat16)` must not round the amax history and scales: keep the FP8
        # state in float32 (follow device moves only), as torchao's Float8Linear does.
        before = {name: self._buffers[name] for name in _STATE_BUFFERS}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if old is not None and new is not None and new.dtype != torch.float32:
                self._buffers[name] = old.to(device=new.device)
        return self

    def extra_repr(self) -> str:
        r = self.recipe
        return (
            f"{super().extra_repr()}, formats={'/'.join(self.formats)}, "
            f"history_len={r.history_len}, amax_compute_algo={r.amax_compute_algo}, margin={r.margin}"
        )


def convert_linears(
    model: nn.Module,
    recipe: DelayedScalingRecipe,
    filter: Callable[[str, nn.Linear], bool] | None = None,
) -> int:
    """Swap every `nn.Linear` inside `model` for an `Fp8Linear` in place; return how many.

    Only exact `nn.Linear` instances are swapped (subclasses such as MultiheadAttention's
    out_proj, whose forward is never called, and existing Fp8Linears are left alone); `model`
    itself is not replaced. `filter(fqn, linear)` returning False keeps a layer in high precision.
    A Linear shared by several parents is swapped once and stays shared. Hooks registered on the
    old modules are not carried over.

    Usage::

        n = convert_linears(model, DelayedScalingRecipe(history_len=16),
                            filter=lambda fqn, m: not fqn.endswith("lm_head"))
    """
    swapped: dict[int, Fp8Linear] = {}
    kept: set[int] = set()  # a shared Linear is judged once, by its first name
    for fqn, module in list(model.named_modules(remove_duplicate=False)):
        if fqn == "" or type(module) is not nn.Linear or id(module) in kept:
            continue
        if id(module) not in swapped:
            if filter is not None and not filter(fqn, module):
                kept.add(id(module))
                continue
            swapped[id(module)] = Fp8Linear.from_linear(module, recipe)
        parent_name, _, child_name = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, swapped[id(module)])
    return len(swapped)
