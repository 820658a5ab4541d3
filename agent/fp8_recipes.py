"""What the FP8 monitor reads: one interface over each recipe's own amax history and scale.

`find_fp8_modules(model)` returns `(fqn, Fp8State)` for every module that trains through a real
FP8 delayed-scaling recipe, recognised by duck typing:

- Transformer Engine modules (`te.Linear`, `LayerNormLinear`, `LayerNormMLP`, ...): a dict
  `fp8_meta` whose "scaling_fwd" / "scaling_bwd" entries carry `amax_history` and `scale`
  (`TransformerEngineFp8State`, one per GEMM);
- torchao.float8 `Float8Linear` with delayed scaling: buffers `fp8_amax_history_<role>` and
  `fp8_scale_<role>` (`TorchaoFp8State`);
- trainvitals' own `Fp8Linear` (`EmulatedFp8State`).

Neither transformer_engine nor torchao is ever imported: their state is read by attribute name, so
discovery costs nothing when they are absent and cannot trigger their (CUDA-initialising) imports.
Modules with dynamic/current, block or MX scaling have no history to read and are not returned.

Timing contract, the same for every adapter (TE and torchao update right after each step's casts,
and the emulation follows TE): read at a step boundary, i.e. after backward and after torchao's
`sync_float8_amax_and_scale_history`, which torchao requires before `optimizer.step()`.
"""

from __future__ import annotations

from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import nn

from trainvitals.agent.fp8_emulation import _TE_FORMATS, Fp8Linear
from trainvitals.wire import DEFAULT_FORMATS, ROLES
from trainvitals.wire.conventions import Fp8Format, Role

__all__ = [
    "EmulatedFp8State",
    "Fp8State",
    "TorchaoFp8State",
    "TransformerEngineFp8State",
    "find_fp8_modules",
]

_DTYPE_FORMATS: dict[torch.dtype, Fp8Format] = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


@runtime_checkable
class Fp8State(Protocol):
    """The delayed-scaling state of one FP8 GEMM, as the recipe itself keeps it.

    - `amax_history()`: float32 [L, len(roles)] on the module's device, columns in `roles` order.
      Rows form a ring: row `(newest_row() - k) % L` holds the amax recorded k steps before the
      newest one. A row reading 0 holds nothing (not yet filled, or TE's slot cleared for the next
      amax). May be the live buffer: do not modify it, clone it for a snapshot. No host sync.
    - `scale()`: float32 [len(roles)], the multiplier s the NEXT cast of each role will use. The
      multiplier the newest amax was cast with is the value `scale()` returned at the previous step
      boundary, so headroom_bits of step t = log2(fp8_max / (amax_t * s_t)) with s_t read one step
      earlier (fp8.md); equivalently margin + log2(A_{t-1} / amax_t).
    - With `history_len == 1`, TE (and the emulation) clears the only row in the update, so between
      steps the history holds no amax; the latest one is then fp8_max / (scale * 2**margin).

    Usage::

        for fqn, state in find_fp8_modules(model):
            newest = state.amax_history()[state.newest_row()]     # [len(state.roles)]
            s_next = state.scale()
    """

    roles: tuple[Role, ...]
    margin: int
    history_len: int
    amax_compute_algo: str

    def fmt(self, role: str) -> Fp8Format: ...

    def amax_history(self) -> torch.Tensor: ...

    def scale(self) -> torch.Tensor: ...

    def newest_row(self) -> int: ...


class EmulatedFp8State:
    """`Fp8State` of a trainvitals `Fp8Linear`: its buffers themselves, no copy.

    Usage::

        state = EmulatedFp8State(model.fc1)
        state.amax_history() is model.fc1.amax_history   # True
    """

    __slots__ = ("module", "roles", "margin", "history_len", "amax_compute_algo")

    def __init__(self, module: Fp8Linear) -> None:
        self.module = module
        self.roles: tuple[Role, ...] = ROLES
        self.margin = module.recipe.margin
        self.history_len = module.recipe.history_len
        self.amax_compute_algo: str = module.recipe.amax_compute_algo

    def fmt(self, role: str) -> Fp8Format:
        return self.module.recipe.fmt(role)

    def amax_history(self) -> torch.Tensor:
        return self.module.amax_history

    def scale(self) -> torch.Tensor:
        return self.module.scale

    def newest_row(self) -> int:
        # The update rolls the amax just recorded into the last row (TE layout).
        return self.history_len - 1


class TransformerEngineFp8State:
    """`Fp8State` of one GEMM of a Transformer Engine module under a `DelayedScaling` recipe.

    Reads `module.fp8_meta["scaling_fwd"]` (columns per GEMM g: INPUT 3g, WEIGHT 3g+1, OUTPUT 3g+2;
    TE `FP8FwdTensors`) and `["scaling_bwd"]` (GRAD_OUTPUT 2g, GRAD_INPUT 2g+1; `FP8BwdTensors`),
    and the recipe in `fp8_meta["recipe"]`. Current TE updates both at the end of the forward
    (`fp8_autocast` exit) and of the backward: between steps the newest amax is in row L-1 and
    `scale` is the next step's. TE fills `fp8_meta` at the module's first FP8 forward, so discover
    after one step. The TE tensors are looked up on every call because TE may replace them (recipe
    change, checkpoint load); each call concatenates two small column slices on the device.

    Usage::

        with te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
            model(x).sum().backward()
        states = find_fp8_modules(model)   # [("layers.0.proj", TransformerEngineFp8State), ...]
    """

    __slots__ = ("module", "gemm", "roles", "margin", "history_len", "amax_compute_algo", "_formats")

    def __init__(self, module: nn.Module, gemm: int = 0) -> None:
        self.module = module
        self.gemm = gemm
        recipe = _fp8_meta(module)["recipe"]
        self.roles: tuple[Role, ...] = ROLES
        self.margin = int(recipe.margin)
        self.history_len = int(recipe.amax_history_len)
        algo = recipe.amax_compute_algo
        # TE also accepts a callable here; its result cannot be reproduced from the name.
        self.amax_compute_algo: str = algo if isinstance(algo, str) else "custom"
        fmt = recipe.fp8_format
        self._formats = _TE_FORMATS[str(getattr(fmt, "name", fmt)).upper()]

    def fmt(self, role: str) -> Fp8Format:
        return self._formats[self.roles.index(role)]

    def amax_history(self) -> torch.Tensor:
        meta = _fp8_meta(self.module)
        g = self.gemm
        fwd = meta["scaling_fwd"].amax_history[:, 3 * g : 3 * g + 2]
        bwd = meta["scaling_bwd"].amax_history[:, 2 * g : 2 * g + 1]
        return torch.cat((fwd, bwd), dim=1)

    def scale(self) -> torch.Tensor:
        meta = _fp8_meta(self.module)
        g = self.gemm
        fwd = meta["scaling_fwd"].scale[3 * g : 3 * g + 2]
        bwd = meta["scaling_bwd"].scale[2 * g : 2 * g + 1]
        return torch.cat((fwd, bwd))

    def newest_row(self) -> int:
        # TE's update (fp8.py `_update_amax_history`, delayed_scaling.cu) rolls the amax just
        # recorded into the last row and clears row 0 for the next one.
        return int(_fp8_meta(self.module)["scaling_fwd"].amax_history.shape[0]) - 1


class TorchaoFp8State:
    """`Fp8State` of a torchao.float8 `Float8Linear` with delayed scaling.

    Targets the attribute names of torchao 0.4 through 0.9 (`fp8_amax_history_<role>` [L] with the
    newest amax at index 0, `fp8_scale_<role>` [1], `config.cast_config_<role>.scaling_type`,
    `config.delayed_scaling_config.history_len / scale_fn_name`, and from the releases that have
    it `cast_config_<role>.target_dtype`). torchao deprecated delayed scaling in 0.9 and deleted it
    in 0.10 (pytorch/ao#1753); newer Float8Linears have no such state and are not returned.
    Only the roles configured as delayed are reported. torchao rolls a step's amax into the history
    and recomputes the scale in `sync_float8_amax_and_scale_history(model)`; read after it. The
    history is returned flipped (oldest first, newest in row L-1) so every adapter shares one row
    order; torchao has no margin (0) and only the 'max' algorithm.

    Usage::

        model = convert_to_float8_training(model, config=Float8LinearConfig(
            cast_config_input=CastConfig(scaling_type=ScalingType.DELAYED)))
        ...; loss.backward(); sync_float8_amax_and_scale_history(model); optimizer.step()
        states = find_fp8_modules(model)
    """

    __slots__ = ("module", "roles", "margin", "history_len", "amax_compute_algo", "_formats")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        config = cast(Any, module.config)
        self.roles: tuple[Role, ...] = tuple(
            r for r in ROLES if _torchao_delayed(getattr(config, f"cast_config_{r}", None))
        )
        self.margin = 0
        delayed = config.delayed_scaling_config
        self.history_len = int(delayed.history_len)
        self.amax_compute_algo: str = str(delayed.scale_fn_name)
        # Before target_dtype existed torchao cast input and weight to e4m3 and grad_output to e5m2:
        # the usual hybrid recipe, DEFAULT_FORMATS.
        self._formats: dict[str, Fp8Format] = {}
        for role in self.roles:
            dtype = getattr(getattr(config, f"cast_config_{role}"), "target_dtype", None)
            if dtype is None:
                self._formats[role] = DEFAULT_FORMATS[role]
            elif dtype in _DTYPE_FORMATS:
                self._formats[role] = _DTYPE_FORMATS[dtype]
            else:  # e.g. the fnuz dtypes of ROCm, whose max values differ
                raise ValueError(f"unsupported float8 dtype {dtype} for {role}")

    def fmt(self, role: str) -> Fp8Format:
        return self._formats[role]

    def amax_history(self) -> torch.Tensor:
        m = self.module
        return torch.stack([getattr(m, f"fp8_amax_history_{r}") for r in self.roles], dim=1).flip(0)

    def scale(self) -> torch.Tensor:
        m = self.module
        return torch.cat([getattr(m, f"fp8_scale_{r}").reshape(1) for r in self.roles])

    def newest_row(self) -> int:
        return int(getattr(self.module, f"fp8_amax_history_{self.roles[0]}").shape[0]) - 1


def _fp8_meta(module: nn.Module) -> dict[str, Any]:
    return cast("dict[str, Any]", module.fp8_meta)


def _torchao_delayed(cast_config: Any) -> bool:
    # torchao ScalingType.DELAYED == "delayed"; compared by value so torchao need not be imported.
    scaling_type = getattr(cast_config, "scaling_type", None)
    return str(getattr(scaling_type, "value", scaling_type)).lower() == "delayed"


def _te_delayed_meta(meta: dict[str, Any]) -> bool:
    if "recipe" not in meta:
        return False  # TE fills fp8_meta at the module's first FP8 forward
    fwd, bwd = meta.get("scaling_fwd"), meta.get("scaling_bwd")
    if not (hasattr(fwd, "amax_history") and hasattr(bwd, "amax_history")):
        return False  # a recipe without history (current scaling, MXFP8, block scaling)
    delayed = getattr(meta["recipe"], "delayed", None)  # TE >= 2 names the recipe kind
    return not callable(delayed) or bool(delayed())


def find_fp8_modules(model: nn.Module) -> list[tuple[str, Fp8State]]:
    """(fqn, state) for every module of `model` that trains through an FP8 delayed-scaling recipe.

    A Transformer Engine module with several GEMMs (`LayerNormMLP`: fc1, fc2) yields one entry per
    GEMM named `<fqn>.gemm<i>`. A module exposing TE's or torchao's state is read through that
    adapter even if it also derives from `Fp8Linear`. Call once at attach time (TE: after the
    first FP8 step, when its `fp8_meta` exists); the states stay valid while the model lives.

    Usage::

        states = find_fp8_modules(model)   # [("fc1", EmulatedFp8State), ("fc2", ...)]
    """
    found: list[tuple[str, Fp8State]] = []
    for fqn, module in model.named_modules():
        meta = getattr(module, "fp8_meta", None)
        if isinstance(meta, dict):
            # A TE module: read through TE's state or not at all, never as something else.
            if _te_delayed_meta(meta):
                n = int(meta.get("num_gemms") or meta["scaling_fwd"].amax_history.shape[1] // 3)
                for g in range(n):
                    name = fqn if n == 1 else f"{fqn}.gemm{g}"
                    found.append((name, TransformerEngineFp8State(module, g)))
        elif hasattr(module, "fp8_amax_history_input") and hasattr(module, "config"):
            try:
                state = TorchaoFp8State(module)
            except (AttributeError, ValueError):
                continue  # a layout this adapter does not know: skip rather than guess
            if state.roles:
                found.append((fqn, state))
        elif isinstance(module, Fp8Linear):
            found.append((fqn, EmulatedFp8State(module)))
    return found
