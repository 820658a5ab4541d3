"""Per-tensor FP8 numerics (definitions: shared/reference/fp8.md), computed on the tensor's device.

Monitored tensors are (module fqn, role) for role in input, weight, grad_output of Linear-like
modules. Two modes, chosen per module:

- recipe: the module trains through a real FP8 recipe (our emulated Fp8Linear, Transformer
  Engine, torchao); the amax history and scale are the recipe's own, read at step end (tier 0).
- shadow: a bf16/fp32 module; hooks take the exact amax (tier 1) and the monitor keeps the
  delayed-scaling history a recipe with the configured L / margin / algorithm would keep, so a
  run can be checked before it switches to FP8.

Hot-path cost per hooked tensor on a sampled step: one `aminmax` pass (max |x| = max(max x,
-min x) without materialising |x|; on CPU a hook finds activations out of cache, where one pass
beats `amax` + `amin`, and `vector_norm(ord=inf)` is ~7x slower; docs/performance-agent.md), its
extremes written straight into preallocated 0-dim slots on the step's first call. One forward
hook per module reads input and weight after the forward and puts a pre-hook on the output's
autograd node for grad_output, only on sampled steps: a full backward hook would wrap every
forward call in autograd machinery on every step, sampled or not. The forward hooks are
registered only for the steps they measure (shadow modules: sampled steps; recipe modules:
expensive steps) and removed after them: a module with any hook takes the slow path of
`nn.Module.__call__` on every call, even when the hook returns at once.
At step end everything is vectorised over all tensors (a handful of kernels, whatever the
tensor count) and appended to the step's single device-to-host copy. Expensive statistics
(saturation, underflow, crest, non-finite) run only on a subset of the sampled steps.

Sampling (`every` > 1, the agent's `fp8_every_steps`): the hooks measure only the steps the
agent samples, and the shadow history keeps ceil(L / every) samples so that it spans the
recipe's L steps; staleness is reported in steps.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainvitals.agent._guard import ErrorBudget
from trainvitals.wire import DEFAULT_FORMATS, FP8_MAX, ROLES, clean_name, tensor_record
from trainvitals.wire.builders import JsonObject
from trainvitals.wire.conventions import Fp8Format, Role

# fp8.md "Formats": smallest subnormal per format (the maxima, FP8_MAX, are a wire convention).
FP8_MIN_SUBNORMAL = {"e4m3": 2.0**-9, "e5m2": 2.0**-16}
_CREST_SAMPLE = 4096  # elements sampled (strided) for the median in crest_bits: +-0.05 bits
# Elements sampled (strided) for underflow_frac: exact up to this size; above it a binomial
# estimate, standard error <= 0.003 and ~18% at the detector's 5e-4 floor (fp8.md).
_SAMPLE = 1 << 15
_UNSEEN_SETS_KEPT = 8  # distinct sets of modules that missed a sampled step, kept as index tensors
_F32_MAX = torch.finfo(torch.float32).max
_F32_SUBNORMAL_MIN = float.fromhex("0x1p-149")  # the smallest positive float32

ModuleFilter = Callable[[str, nn.Module], bool]


def default_module_filter(name: str, module: nn.Module) -> bool:
    """Linear-like modules, except the output head (usually kept in high precision by recipes)."""
    return isinstance(module, nn.Linear) and not clean_name(name).endswith(("lm_head", "output"))


@dataclass(frozen=True, slots=True)
class MonitoredTensor:
    fqn: str
    role: Role
    fmt: Fp8Format
    recipe: bool


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor: this rank's shard, never a collective
    return to_local() if to_local is not None else t


class Fp8Monitor:
    """Hooks + vectorised headroom math. `end_step()` returns one flat device vector per step.

    Layout of the vector (n = number of monitored tensors): amax[n], headroom_bits[n],
    lag_bits[n], staleness_steps[n], then on expensive steps sat_frac[n], underflow_frac[n],
    crest_bits[n], nonfinite[n]. `records()` turns it into wire-format tensor records.

    Usage::

        mon = Fp8Monitor(model, history_len=1024, margin=0, amax_algo="max")
        ...forward/backward...
        vec = mon.end_step(step)     # device tensor or None; no sync
        records = mon.records(step, vec.tolist(), expensive)
        mon.close()                  # removes every hook
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        history_len: int = 1024,
        margin: int = 0,
        amax_algo: str = "max",
        formats: dict[str, Fp8Format] | None = None,
        module_filter: ModuleFilter | None = None,
        expensive_every: int = 50,
        mode: str = "auto",
        skip_modules: frozenset[int] = frozenset(),
        errors: ErrorBudget | None = None,
    ) -> None:
        if amax_algo not in ("max", "most_recent"):
            raise ValueError("amax_algo must be 'max' or 'most_recent'")
        self.history_len = history_len
        self.margin = margin
        self.amax_algo = amax_algo
        self.expensive_every = expensive_every
        self._errors = errors or ErrorBudget()
        formats = {**DEFAULT_FORMATS, **(formats or {})}
        module_filter = module_filter or default_module_filter

        recipe_states: dict[int, list[tuple[str, Any]]] = {}
        if mode in ("auto", "recipe"):
            from trainvitals.agent.fp8_recipes import find_fp8_modules

            for name, state, m in _with_modules(model, find_fp8_modules):
                recipe_states.setdefault(id(m), []).append((name, state))
        self.recipe_modules = frozenset(recipe_states)  # ids of the modules read through their recipe
        self.tensors: list[MonitoredTensor] = []
        self._recipe: list[tuple[int, Any]] = []  # (first tensor index, Fp8State)
        # Forward hooks per kind, registered only while needed (_sync_hooks): shadow modules while
        # observing, recipe modules (expensive tier only) while observing an expensive step.
        self._shadow_hooks = _HookSet()
        self._recipe_hooks = _HookSet()
        shadow_modules: list[tuple[str, nn.Module, int]] = []
        recipe_modules: list[tuple[str, nn.Module, int, tuple[str, ...]]] = []
        for name, module in model.named_modules():
            # The root module's name is empty, and the wire refuses a nameless tensor (the whole
            # batch would be a 422): a bare nn.Linear handed to attach() is "model".
            fqn = clean_name(name) or "model"
            if id(module) in recipe_states:
                for state_name, state in recipe_states[id(module)]:  # several GEMMs: '<fqn>.gemm<i>'
                    self._recipe.append((len(self.tensors), state))
                    recipe_modules.append((fqn, module, len(self.tensors), state.roles))
                    for role in state.roles:
                        self.tensors.append(
                            MonitoredTensor(clean_name(state_name), role, state.fmt(role), True)
                        )
            elif mode in ("auto", "shadow") and id(module) not in skip_modules and module_filter(name, module):
                shadow_modules.append((fqn, module, len(self.tensors)))
                for role in ROLES:
                    self.tensors.append(MonitoredTensor(fqn, role, formats[role], False))
        n = len(self.tensors)
        # Shadow tensors get hooks, extremes and a shadow scale; a recipe-only monitor skips that math.
        self._has_shadow = any(not t.recipe for t in self.tensors)
        # lag and staleness of a recipe tensor follow the recipe's own L and algorithm (Megatron's
        # L = 1, 'most_recent' is not TE's 1024, 'max'): a recipe-only monitor whose recipes agree
        # keeps its history like them. Where the history cannot (shadow tensors beside, recipes that
        # differ, a custom algorithm) those recipe tensors' lag and staleness are unknown (NaN).
        own = {(state.history_len, state.amax_compute_algo) for _, state in self._recipe}
        if not self._has_shadow and len(own) == 1:
            ((own_len, own_algo),) = own
            if own_algo in ("max", "most_recent"):
                self.history_len, self.amax_algo = own_len, own_algo
                history_len = own_len
        unlike = [
            i for f, state in self._recipe for i in range(f, f + len(state.roles))
            if (state.history_len, state.amax_compute_algo) != (self.history_len, self.amax_algo)
        ]  # fmt: skip
        self._unlike_idx = torch.tensor(unlike, dtype=torch.long) if unlike else None
        self._fmax = torch.tensor([FP8_MAX[t.fmt] for t in self.tensors], dtype=torch.float32)
        self._min_sub = torch.tensor([FP8_MIN_SUBNORMAL[t.fmt] for t in self.tensors], dtype=torch.float32)
        self._device: torch.device | None = None
        self._amax = torch.zeros(n)  # this step's amax per tensor (recipe: read; shadow: max(hi, -lo))
        # Hooks keep max(0, max x) and min(0, min x) per tensor over the step's calls; the zero start
        # is harmless because amax = max(hi, -lo) >= 0. Rows hi and lo of one tensor: one zero_().
        self._extremes = torch.zeros(2, n)
        self._hi, self._lo = self._extremes.unbind(0)
        self._hi_slots: list[torch.Tensor] = []
        self._lo_slots: list[torch.Tensor] = []
        self.every = 1  # cheap-tier cadence in steps (set_every)
        self.spent = 0.0
        """Seconds of the training thread in this monitor's hooks and end_step() (the cadence's input)."""
        self._observing = True  # hooks measure the current step (the agent clears it off-cadence)
        self._history = _History(history_len, n)  # in samples
        self._scale = torch.zeros(n)  # shadow: the scale a recipe would use this step (0 = none yet)
        self._scale_slots: list[torch.Tensor] = []
        # The expensive tier's sums over the step's calls of each tensor (micro-batches, recompute,
        # shared modules), rows _SAT.._M; end_step() turns them into fractions.
        self._expensive_reset = _expensive_start(n)
        self._expensive = self._expensive_reset.clone()
        self._expensive_slots: list[list[torch.Tensor]] = []  # [row][tensor] 0-dim views (accelerators)
        # CPU: the same sums as Python floats (its scalars are read anyway), one tensor at step end
        # instead of indexed writes per tensor.
        self._expensive_host = self._expensive.tolist()
        self._expensive_host_start = self._expensive.tolist()
        self._fmax_host = self._fmax.tolist()
        self._min_sub_host = self._min_sub.tolist()
        # Per tensor: no call yet this step (its first call writes the extremes' slots directly).
        self._fresh = bytearray(b"\x01" * n)
        self._all_fresh = bytes(self._fresh)
        # Shadow tensors, as indices and as a bit mask over `_fresh`'s bytes: those still fresh at
        # step end were not run this step (a MoE expert no token reached, nn.MultiheadAttention's
        # out_proj, whose weight it uses without calling the module).
        self._shadow_idx = [i for i, t in enumerate(self.tensors) if not t.recipe]
        self._unseen_idx: dict[tuple[int, ...], torch.Tensor] = {}  # _unseen()'s index tensors
        self._shadow_bits = int.from_bytes(bytes(0 if t.recipe else 1 for t in self.tensors), "little")
        self._scratch = torch.empty(0)  # CPU only: |x| of the expensive tier, reused (_abs_f32)
        self._flags = torch.empty(0)  # CPU only: comparison results of the expensive tier (_count)
        self._sample_buf = torch.empty(0)  # CPU only: the expensive tier's |x| sample (_abs_sample)
        self._expensive_now = False
        self._step_counter = 0
        self._stamp = 0  # steps covered by the samples so far (the history's stamps)
        # Recipe tensors: the scale the recipe holds for the next step, and the one it used this
        # step (0: not known yet), read into these in place; per-module views built once.
        self._recipe_idx = torch.tensor([i for i, t in enumerate(self.tensors) if t.recipe], dtype=torch.long)
        self._scale_next = torch.zeros(n)
        self._scale_used = torch.zeros(n)
        self._recipe_views: list[tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for _fqn, module, first in shadow_modules:
            self._hook_module(module, {role: first + k for k, role in enumerate(ROLES)}, cheap=True)
        for _fqn, module, first, roles in recipe_modules:
            # The recipe already knows the amax: hooks only serve the sampled expensive tier.
            self._hook_module(module, {role: first + k for k, role in enumerate(roles)}, cheap=False)
        self._sync_hooks()

    # ------------------------------------------------------------------ hooks (hot path)

    def _ensure_device(self, device: torch.device) -> None:
        if self._device == device:
            return
        # First hook call: move the buffers next to the activations, once.
        self._device = device
        for attr in (
            "_amax", "_extremes", "_scale", "_expensive", "_expensive_reset", "_fmax", "_min_sub",
            "_recipe_idx", "_scale_next", "_scale_used",
        ):  # fmt: skip
            setattr(self, attr, getattr(self, attr).to(device))
        if self._unlike_idx is not None:
            self._unlike_idx = self._unlike_idx.to(device)
        self._history.to(device)
        self._recipe_views = [
            (state, self._amax[f : f + len(state.roles)], self._scale_next[f : f + len(state.roles)],
             self._fmax[f : f + len(state.roles)])
            for f, state in self._recipe
        ]  # fmt: skip
        # 0-dim views, created once and written in place: no Python objects per tensor per step.
        self._hi, self._lo = self._extremes.unbind(0)
        self._hi_slots = list(self._hi.unbind(0))
        self._lo_slots = list(self._lo.unbind(0))
        self._scale_slots = list(self._scale.unbind(0))
        self._expensive_slots = [list(row.unbind(0)) for row in self._expensive.unbind(0)]

    def set_every(self, every: int) -> None:
        """Measure only every `every`-th step (the agent says which through `observing`).

        The shadow history then holds ceil(L / every) samples, i.e. it still spans the L steps a
        real recipe's history spans (at least one sample, so L < every degrades to 'the last
        sample'). Its newest samples are kept (the agent widens the cadence mid-run: _fp8_cadence).
        """
        if every < 1:
            raise ValueError("every must be >= 1")
        if every == self.every:
            return
        self.every = every
        self._history = self._history.resized(max(1, math.ceil(self.history_len / every)))

    @property
    def observing(self) -> bool:
        """Whether the hooks measure the current step; the agent sets it before each step."""
        return self._observing

    @observing.setter
    def observing(self, value: bool) -> None:
        self._observing = value
        self._sync_hooks()

    def _sync_hooks(self) -> None:
        # Called between steps (the agent sets `observing`, end_step() decides the expensive tier), so
        # no forward is in flight. Registering again appends the hooks after any the job added since.
        self._shadow_hooks.set(self._observing)
        self._recipe_hooks.set(self._observing and self._expensive_now)

    def _hook_module(self, module: nn.Module, index: dict[str, int], *, cheap: bool) -> None:
        i_in, i_w, i_g = index.get("input"), index.get("weight"), index.get("grad_output")

        def grad_output_hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            # Pre-hook of the node that made the output: grads[0] is d loss / d output, the module's
            # grad_output[0]; returns None: the gradient is untouched.
            g = grads[0] if grads else None
            if g is not None:
                self._observe(i_g, _local(g).detach(), cheap)  # type: ignore[arg-type]

        guarded_grad_hook = self._guard(grad_output_hook)  # built once, registered per sampled step

        def forward(mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            # One hook after the forward, not a pre-hook and a post-hook: each hook call is a cold
            # dispatch (~40-70 us on a 2-core Xeon), and a Linear leaves its input and weight as they were.
            if not torch.is_grad_enabled():
                # A validation pass (no_grad, inference_mode) inside a sampled step is not training:
                # its inputs would be the step's amax and it would pay the monitor's cost. Reentrant
                # activation checkpointing's no-grad forward is seen again at its recompute.
                return
            if args and isinstance(args[0], torch.Tensor):
                x = _local(args[0]).detach()
                self._ensure_device(x.device)
                if i_in is not None:
                    self._observe(i_in, x, cheap)
                weight = getattr(mod, "weight", None)
                if i_w is not None and isinstance(weight, torch.Tensor):
                    self._observe(i_w, _local(weight).detach(), cheap)
            out = output[0] if isinstance(output, (tuple, list)) and output else output
            if i_g is not None and isinstance(out, torch.Tensor) and out.requires_grad:
                # No-grad forwards have no backward. A pre-hook on the output's autograd node costs
                # a third of Tensor.register_hook (no Python handle dict); a single-output node
                # (Linear's addmm/view, a recipe's Function) gets d loss / d output as grads[0].
                node = out.grad_fn
                if node is not None and out.output_nr == 0:
                    node.register_prehook(guarded_grad_hook)
                else:
                    out.register_hook(lambda g: guarded_grad_hook((g,)))

        hooks = self._shadow_hooks if cheap else self._recipe_hooks
        hooks.add(module, self._guard(forward))

    def _guard(self, fn: Callable[..., None]) -> Callable[..., None]:
        # Hooks run inside forward and autograd: an exception here would surface in the job.
        def inner(*args: Any) -> None:
            t0 = time.perf_counter()
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001
                self._errors.record("fp8 hook", exc)
            self.spent += time.perf_counter() - t0
            return None

        # torch.compile traces module hooks into the job's graph, and inductor cannot compile these
        # (in-place writes into the monitor's slots: BackendCompilerFailed, raised into the job).
        # Excluded from compilation they run eagerly at a graph break, on measured steps only.
        return torch.compiler.disable(inner)

    def _observe(self, i: int, x: torch.Tensor, cheap: bool) -> None:
        if x.numel() == 0:
            return  # no elements, no amax (and aminmax refuses an empty tensor)
        if x.dtype.itemsize == 1:
            x = x.float()  # float8 has no min/max kernels on CPU (fp8.md); such inputs are rare
        if cheap:
            # One read of x (fp8.md tier 1), the max over calls within a step (micro-batches, shared
            # modules) kept in 0-dim slots, in place: exact, on device, no sync. The step's first
            # call writes its extremes straight into the slots (one aminmax, no other op); later
            # calls combine with maximum / minimum. aminmax's single pass beats amax + amin once
            # the tensor is out of cache, which is where a hook finds it (docs/performance-agent.md).
            hi_slot, lo_slot = self._hi_slots[i], self._lo_slots[i]
            if self._fresh[i] and x.dtype == torch.float32:
                self._fresh[i] = 0
                torch.aminmax(x, out=(lo_slot, hi_slot))
                lo, hi = lo_slot, hi_slot
            else:
                self._fresh[i] = 0
                lo, hi = torch.aminmax(x)
                torch.maximum(hi_slot, hi, out=hi_slot)
                torch.minimum(lo_slot, lo, out=lo_slot)
        else:
            lo, hi = torch.aminmax(x)  # recipe modules, expensive steps only: the amax of this call
        if self._expensive_now:
            self._expensive_stats(i, x, lo, hi)

    def _expensive_stats(self, i: int, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """Saturation, underflow, crest and non-finite of one call (sampled steps only; fp8.md),
        added to the step's sums: a tensor seen by several calls (micro-batches, recompute, a shared
        module) is judged over all of them, counts summed, crest the worst call's.

        Thresholds on |x| instead of a scaled copy: |x| * s > fmax  <=>  |x| > fmax / s for s > 0
        (s = 0, no scale yet: nothing saturates, and underflow is unknown, set at step end). amax is
        max(hi, -lo) of this call's aminmax, so nothing reads x again for it. Saturation and
        non-finite are exact counts; on CPU, where reading a scalar waits for nothing, amax settles
        them without a pass in the usual case (a finite amax: nothing non-finite; at or below the
        threshold: nothing saturates). Underflow and crest come from one strided sample of at most
        _SAMPLE elements (exact below that)."""
        xf = x if x.dtype == torch.float32 else x.float()
        n = xf.numel()
        if xf.device.type != "cpu":
            self._expensive_stats_device(i, xf, lo, hi)
            return
        amax = max(hi.item(), -lo.item())  # NaN if any element is NaN (aminmax propagates it)
        s = self._scale_slots[i].item()
        sat_t = self._fmax_host[i] / s if s > 0 else math.inf
        host = self._expensive_host
        host[_N][i] += n
        finite = math.isfinite(amax)
        if not (finite and amax <= sat_t):  # something saturates or is not finite: count exactly
            xa = self._abs_f32(xf)
            host[_SAT][i] += self._count(torch.gt, xa, sat_t).item()
            if not finite:
                host[_NONFINITE][i] += n - self._count(torch.le, xa, _F32_MAX).item()  # inf, NaN
        sample = self._abs_sample(xf)
        m = sample.numel()
        host[_M][i] += m
        # #{0 < |x| <= t}: histc's single bin counts [smallest subnormal, t], zeros excluded, in one
        # pass over the sample (histc is slow on a whole tensor, ~50x amax: hence the sample).
        under_t = self._min_sub_host[i] / 2 / s if s > 0 else 0.0
        if under_t >= _F32_SUBNORMAL_MIN:
            host[_UNDER][i] += torch.histc(sample, bins=1, min=_F32_SUBNORMAL_MIN, max=min(under_t, _F32_MAX)).item()
        if finite and amax > 0:  # all zeros or non-finite: no crest from this call
            median = sample[:: max(1, m // _CREST_SAMPLE)].median().item()
            # Over half the values zero: the median says nothing of the spread, crest unknown (inf,
            # left out of the record).
            crest = math.log2(amax / median) if median > 0 else math.inf
            if not host[_CREST][i] >= crest:  # the worst call; NaN (no call yet) gives way
                host[_CREST][i] = crest

    def _expensive_stats_device(self, i: int, xf: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        # Accelerators: every count runs and nothing is read (no sync); the same definitions as on
        # CPU, added in place into the step's 0-dim sums.
        n = xf.numel()
        sums = self._expensive_slots
        s = self._scale_slots[i]
        sat_t = self._fmax[i] / s
        under_t = self._min_sub[i] / 2 / s
        amax = torch.maximum(hi, lo.neg())
        xa = xf.abs()
        sums[_SAT][i].add_(torch.count_nonzero(xa > sat_t))
        sums[_NONFINITE][i].add_(n - torch.count_nonzero(xa <= _F32_MAX))
        sums[_N][i].add_(n)
        sample = self._abs_sample(xf)
        m = sample.numel()
        sums[_UNDER][i].add_(torch.count_nonzero((sample > 0) & (sample <= under_t)))
        sums[_M][i].add_(m)
        median = sample[:: max(1, m // _CREST_SAMPLE)].median()
        # As on CPU: all zeros (0/0) or non-finite give NaN, which fmax passes over; a zero median
        # gives inf (unknown, left out of the record).
        torch.fmax(sums[_CREST][i], torch.log2(amax / median), out=sums[_CREST][i])

    def _abs_sample(self, xf: torch.Tensor) -> torch.Tensor:
        """|x| of at most _SAMPLE elements, every k-th of the flat tensor (all of them when it is no
        larger), as one contiguous float32 tensor. k is coprime with the row length so that the
        sample visits every column (an outlier channel is neither missed nor over-counted)."""
        flat = xf.reshape(-1)
        n = flat.numel()
        k = max(1, -(-n // _SAMPLE))
        row = xf.shape[-1] if xf.dim() > 0 else 1
        while k > 1 and math.gcd(k, row) > 1:
            k += 1
        view = flat[::k] if k > 1 else flat
        if xf.device.type != "cpu":
            return view.abs()
        m = view.numel()
        if self._sample_buf.numel() < m:
            self._sample_buf = torch.empty(max(m, _SAMPLE), dtype=torch.float32)
        return torch.abs(view, out=self._sample_buf[:m])

    def _count(self, compare: Callable[..., torch.Tensor], xf: torch.Tensor, threshold: Any) -> torch.Tensor:
        """#{compare(xf, threshold)}, exactly, on CPU. The comparison writes 1.0 / 0.0 into a reused
        float32 buffer that a float sum counts: ~3x faster there than a bool tensor and
        count_nonzero (neither is vectorised well on CPU), and exact: every partial sum is an integer
        <= n, representable in float32 up to 2**24 (float64 accumulation above that)."""
        n = xf.numel()
        if self._flags.numel() < n:
            self._flags = torch.empty(n, dtype=torch.float32)
        flags = compare(xf, threshold, out=self._flags[:n])
        return flags.sum(dtype=torch.float64 if n > 1 << 24 else torch.float32)

    def _abs_f32(self, x: torch.Tensor) -> torch.Tensor:
        """|x| as a flat float32 tensor, on CPU, into a reused scratch buffer: a fresh multi-MB
        allocation there is fresh pages from the OS each time, and those page faults cost several
        times the arithmetic."""
        n = x.numel()
        if self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=torch.float32)
        out = self._scratch[:n]
        if x.dtype == torch.float32:
            torch.abs(x, out=out.view(x.shape))  # one pass; abs cannot write another dtype's out
        else:
            out.view(x.shape).copy_(x)
            out.abs_()
        return out

    # ------------------------------------------------------------------ step end

    @property
    def shadow(self) -> bool:
        """Whether this monitor hooks any tensor itself (the shadow mode's sampled reads)."""
        return self._has_shadow

    @property
    def expensive_next(self) -> bool:
        return self._expensive_now

    def end_step(self) -> tuple[torch.Tensor | None, bool]:
        """Vectorised headroom math over all tensors; returns (device vector, had expensive stats)."""
        t0 = time.perf_counter()
        try:
            return self._end_step()
        finally:
            self.spent += time.perf_counter() - t0

    def _end_step(self) -> tuple[torch.Tensor | None, bool]:
        """end_step() itself.

        Written row by row into the fresh output vector, about 25 small ops whatever the tensor
        count (and half of them only on sampled shadow steps): on CPU each op costs 5-20 us of
        dispatch, far more than its arithmetic on a few hundred values."""
        if self._device is None and self._recipe:
            self._ensure_device(self._recipe[0][1].amax_history().device)
        if not self.tensors or self._device is None:
            return None, False
        # |x| max from the hooks' signed extremes, then the recipe tensors' own amax on top.
        if self._has_shadow:  # the hooks' extremes
            torch.maximum(self._hi, self._lo.neg(), out=self._amax)
        self._read_recipes()
        amax = self._amax
        expensive = self._expensive_now
        n = len(self.tensors)
        out = torch.empty((8 if expensive else 4) * n, device=self._device)
        rows = out.view(-1, n)
        amax_row, headroom, lag, staleness = rows.unbind(0)[:4]
        amax_row.copy_(amax)
        hist = self._history
        if hist.filled:
            # A: the amax the scale in use was built from. Unknown (A == 0, or NaN): NaN.
            a_prev = hist.max if self.amax_algo == "max" else hist.newest()
            torch.div(a_prev, amax, out=headroom)
            torch.div(amax, a_prev, out=lag)
            ratios = rows.narrow(0, 1, 2)
            ratios.log2_()  # headroom = margin + log2(A / amax), lag = log2(amax / A)
            if self.margin:
                headroom.add_(self.margin)
            ratios.masked_fill_(a_prev <= 0, math.nan)
            if self.amax_algo == "max":
                # Steps from the sample that holds the history maximum to the newest one (the stamps
                # count steps, so a cadence changed mid-run keeps them exact).
                torch.sub(hist.newest_stamp(), hist.stamps.index_select(0, hist.argmax), out=staleness)
            else:
                staleness.zero_()
            if self._unlike_idx is not None:  # recipe tensors whose own history this one is not
                rows.narrow(0, 2, 2).index_fill_(1, self._unlike_idx, math.nan)
        else:
            rows.narrow(0, 1, 3).fill_(math.nan)
        if self._recipe:
            self._recipe_headroom(amax, headroom)
        if expensive:
            self._expensive_rows(rows)
        unseen = self._unseen()
        if unseen is not None:
            # No record for them (records() skips the mark), and their history keeps its newest
            # sample: a recipe's history does not move for a module that did not run. Their amax
            # was 0 before: a phantom record each sampled step, and 'most_recent' then had no scale.
            staleness.index_fill_(0, unseen, UNSEEN)
            amax = amax.index_copy(0, unseen, hist.newest().index_select(0, unseen))
        self._push_history(amax)
        if self._has_shadow:
            self._extremes.zero_()
            self._fresh[:] = self._all_fresh
        if expensive:
            if self._device.type == "cpu":
                for row, start in zip(self._expensive_host, self._expensive_host_start, strict=True):
                    row[:] = start
            else:
                self._expensive.copy_(self._expensive_reset)
        self._step_counter += 1
        # expensive_every is in steps; sampled every `every` steps that is every expensive_every //
        # every samples (at least every sample).
        period = max(1, self.expensive_every // self.every)
        self._expensive_now = self.expensive_every > 0 and self._step_counter % period == 0
        self._sync_hooks()
        return out, expensive

    def _expensive_rows(self, rows: torch.Tensor) -> None:
        """Rows 4-7 of the step's vector from the expensive sums: a handful of ops on [n] vectors.
        A tensor no call measured (0 elements) gets NaN fractions and non-finite count: unknown."""
        on_cpu = self._device is None or self._device.type == "cpu"
        sums = torch.tensor(self._expensive_host) if on_cpu else self._expensive
        sat, under, crest, nonfinite = rows.unbind(0)[4:8]
        torch.div(sums[_SAT], sums[_N], out=sat)
        torch.div(sums[_UNDER], sums[_M], out=under)
        # No scale yet (s = 0, the shadow's first step): nothing flushes to zero yet, unknown.
        under.masked_fill_(self._scale <= 0, math.nan)
        crest.copy_(sums[_CREST])
        nonfinite.copy_(sums[_NONFINITE]).masked_fill_(sums[_N] == 0, math.nan)

    def _unseen(self) -> torch.Tensor | None:
        """Indices of the shadow tensors no hook saw this step, or None (the usual case, one
        integer AND)."""
        if not self._has_shadow or not int.from_bytes(self._fresh, "little") & self._shadow_bits:
            return None
        idx = tuple(i for i in self._shadow_idx if self._fresh[i])
        # The same modules miss step after step (nn.MultiheadAttention's out_proj, idle experts):
        # their index tensor is made once. Made on every sampled step, it was a blocking copy to the
        # device: a host sync on the training thread.
        if (cached := self._unseen_idx.get(idx)) is not None:
            return cached
        device = self._device or torch.device("cpu")  # set: a hook saw a tensor this step
        host = torch.tensor(idx, dtype=torch.long, pin_memory=device.type == "cuda")
        on_device = host.to(device, non_blocking=True)
        if len(self._unseen_idx) < _UNSEEN_SETS_KEPT:
            self._unseen_idx[idx] = on_device
        return on_device

    def _push_history(self, amax: torch.Tensor) -> None:
        hist = self._history
        self._stamp += self.every  # in steps: this sample's distance from the one before
        hist.push(amax, self._stamp, with_max=self.amax_algo == "max")
        if self._has_shadow:
            # The shadow recipe's next scale: s = (fp8_max / A) / 2**margin; A == 0 or non-finite
            # (A is >= 0 or NaN, so 0 < A < inf is exactly that) keeps the old one.
            a = hist.max if self.amax_algo == "max" else hist.newest()
            new_scale = self._fmax / a.clamp_min(torch.finfo(torch.float32).tiny)
            if self.margin:
                new_scale.div_(2.0**self.margin)
            torch.where((a > 0) & (a < math.inf), new_scale, self._scale, out=self._scale)
        if self._recipe:  # the expensive tier of recipe tensors uses the recipe's real scale
            if self._has_shadow:
                self._scale.index_copy_(0, self._recipe_idx, self._scale_used.index_select(0, self._recipe_idx))
            else:
                self._scale.copy_(self._scale_used)

    def _read_recipes(self) -> None:
        # Every step for recipe modules: two in-place copies per module into preallocated views,
        # no tensors or lists created per module.
        for state, amax, scale_next, fmax in self._recipe_views:
            scale_next.copy_(state.scale())
            if state.history_len == 1:
                # The update clears the only row (TE, emulation): recover this step's amax from the
                # scale it produced, A = fp8_max / (s_next * 2**margin) ('most_recent' of one entry).
                torch.div(fmax, scale_next, out=amax)
                amax.div_(2.0**state.margin)
            else:
                amax.copy_(state.amax_history()[state.newest_row()])

    def _recipe_headroom(self, amax: torch.Tensor, headroom: torch.Tensor) -> None:
        """Writes H = log2(fp8_max / (amax_t * s_t)) of the recipe tensors into `headroom`, with the
        scale the recipe USED this step: at step end a recipe already holds the next step's scale
        (TE, torchao, the emulation), so s_t is the one read at the previous step end (NaN on the
        first step: not known)."""
        used = self._scale_used
        if self._has_shadow:  # mixed monitor: the recipe tensors' entries only
            idx = self._recipe_idx
            used = used.index_select(0, idx)
            values = torch.log2(self._fmax.index_select(0, idx) / (amax.index_select(0, idx) * used))
            headroom.index_copy_(0, idx, values.masked_fill_(used <= 0, math.nan))
        else:  # every tensor is a recipe tensor: in place, no index ops
            torch.mul(amax, used, out=headroom)
            torch.div(self._fmax, headroom, out=headroom)
            headroom.log2_().masked_fill_(used <= 0, math.nan)
        self._scale_used.copy_(self._scale_next)  # this step's next scale is the next step's used one

    # ------------------------------------------------------------------ off the training thread

    def records(self, step: int, values: list[float], expensive: bool) -> list[JsonObject]:
        n = len(self.tensors)
        out: list[JsonObject] = []
        for i, t in enumerate(self.tensors):
            if values[3 * n + i] == UNSEEN:
                continue  # its module did not run this step: nothing was measured
            # NaN (not known yet: no history, no scale) is left out rather than sent.
            crest = values[6 * n + i] if expensive else math.nan
            rec = tensor_record(
                step=step,
                tensor=t.fqn,
                role=t.role,
                format=t.fmt,
                amax=values[i],
                headroom_bits=_finite(values[n + i]),
                lag_bits=_finite(values[2 * n + i]),
                staleness_steps=_int_or_none(values[3 * n + i]),
                sat_frac=_fraction(values[4 * n + i]) if expensive else None,
                underflow_frac=_fraction(values[5 * n + i]) if expensive else None,
                crest_bits=_finite(crest),
                nonfinite=_int_or_none(values[7 * n + i]) if expensive else None,
                shadow=not t.recipe,
            )
            out.append(rec)
        return out

    def close(self) -> None:
        self._shadow_hooks.close()
        self._recipe_hooks.close()

    @property
    def hooks(self) -> int:
        """Module hooks registered right now (they come and go with the sampled steps; 0 after close)."""
        return self._shadow_hooks.registered + self._recipe_hooks.registered


UNSEEN = -1.0
"""The staleness a tensor gets in end_step()'s vector when its module did not run that step
(staleness is otherwise >= 0 or NaN): records() leaves it out."""


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _int_or_none(v: float) -> int | None:
    return int(v) if math.isfinite(v) else None


def _fraction(v: float) -> float | None:
    return min(1.0, max(0.0, v)) if math.isfinite(v) else None


# Rows of the expensive tier's per-step sums (Fp8Monitor._expensive): saturated elements,
# underflowing sample elements, crest bits (max over calls, NaN before any), non-finite elements,
# elements, sample elements.
_SAT, _UNDER, _CREST, _NONFINITE, _N, _M = range(6)


def _expensive_start(n: int) -> torch.Tensor:
    start = torch.zeros(6, n)
    start[_CREST] = math.nan
    return start


class _HookSet:
    """Forward hooks of a group of modules, registered and removed together."""

    def __init__(self) -> None:
        self._specs: list[tuple[nn.Module, Callable[..., None]]] = []
        self._handles: list[Any] = []
        self._on = False

    def add(self, module: nn.Module, hook: Callable[..., None]) -> None:
        self._specs.append((module, hook))

    def set(self, on: bool) -> None:
        if on == self._on:
            return
        self._on = on
        if not on:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            return
        for module, hook in self._specs:
            self._handles.append(module.register_forward_hook(hook))

    def close(self) -> None:
        self.set(False)
        self._specs.clear()  # closed for good: set(True) registers nothing

    @property
    def registered(self) -> int:
        return len(self._handles)


def _with_modules(
    model: nn.Module, finder: Callable[[nn.Module], list[tuple[str, Any]]]
) -> list[tuple[str, Any, nn.Module]]:
    """(state name, state, owning module); multi-GEMM modules report '<fqn>.gemm<i>' names."""
    modules = dict(model.named_modules())
    out = []
    for name, state in finder(model):
        owner = name if name in modules else re.sub(r"\.gemm\d+$", "", name)
        if owner in modules:
            out.append((name, state, modules[owner]))
    return out


class _History:
    """Ring buffer of per-tensor amax samples (the shadow recipe's amax history), with the
    per-tensor maximum and the row it sits in, both from one reduction per push (argmax beside
    amax was 5x the time of max(dim=0) on CPU, which returns both), and each row's step stamp."""

    buf: torch.Tensor  # [rows, n], set by to()
    stamps: torch.Tensor  # [rows]: the step count at each row's sample (float32: exact to 2**24)

    def __init__(self, rows: int, n: int, device: torch.device | None = None) -> None:
        self.rows = rows
        self.pos = 0  # the row the next sample goes to
        self.filled = 0
        self.to(device, torch.zeros(rows, n), torch.zeros(rows))

    def to(
        self, device: torch.device | None, buf: torch.Tensor | None = None, stamps: torch.Tensor | None = None
    ) -> None:
        buf = self.buf if buf is None else buf
        stamps = self.stamps if stamps is None else stamps
        self.buf = buf if device is None else buf.to(device)
        self.stamps = stamps if device is None else stamps.to(device)
        self._row_views = self.buf.unbind(0)  # written in place: no indexing per push
        self._stamp_views = self.stamps.unbind(0)
        self.max = torch.zeros(self.buf.shape[1], device=self.buf.device)
        self.argmax = torch.zeros(self.buf.shape[1], dtype=torch.long, device=self.buf.device)
        if self.filled:
            torch.max(self.buf, dim=0, out=(self.max, self.argmax))

    def push(self, sample: torch.Tensor, stamp: int, *, with_max: bool) -> None:
        self._row_views[self.pos].copy_(sample)
        self._stamp_views[self.pos].fill_(stamp)
        self.pos = (self.pos + 1) % self.rows
        self.filled = min(self.rows, self.filled + 1)
        if with_max:
            torch.max(self.buf, dim=0, out=(self.max, self.argmax))

    def newest(self) -> torch.Tensor:
        return self._row_views[(self.pos - 1) % self.rows]

    def newest_stamp(self) -> torch.Tensor:
        return self._stamp_views[(self.pos - 1) % self.rows]

    def resized(self, rows: int) -> _History:
        """A history of `rows` rows holding this one's newest samples, oldest first."""
        out = _History(rows, self.buf.shape[1], self.buf.device)
        keep = min(self.filled, rows)
        order = [(self.pos - keep + k) % self.rows for k in range(keep)]
        if keep:
            index = torch.tensor(order, device=self.buf.device)
            out.buf[:keep] = self.buf.index_select(0, index)
            out.stamps[:keep] = self.stamps.index_select(0, index)
        out.pos, out.filled = keep % rows, keep
        out.to(None)  # the maximum over the kept rows
        return out
