"""Gradient sums of squares per parameter group, on device, with no collective.

Each rank reports, per group, `local_sq` (every gradient element it holds) and `owned_sq` (only
the elements this rank is responsible for, so that summing owned_sq over all ranks counts every
element of the global gradient exactly once: shards summed once, replicas counted once). The
collector takes sqrt(sum over ranks of owned_sq); replicas' local_sq must agree, which makes
silent corruption of one replica visible.

Ownership, per parameter, decided once:
- DTensor gradients (FSDP2 `fully_shard`, TP): Shard dims are distinct data, so they count; along
  every Replicate mesh dim only coordinate 0 counts.
- Plain tensors under DDP: replicated over the DDP process group, so only its rank 0 counts.
- FSDP1 flat parameters: every rank holds a distinct shard.
- Single process: everything counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from trainvitals.wire import GLOBAL_GROUP, clean_name, grad_record, layer_of
from trainvitals.wire.builders import JsonObject


def _local(t: torch.Tensor) -> torch.Tensor:
    # DTensor.to_local() is a view of this rank's shard; calling norm on the DTensor itself would
    # launch a collective, which the agent must never do.
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _owned(param: torch.Tensor, model: nn.Module, mode: str) -> bool:
    if mode == "sharded":
        return True
    placements = getattr(param, "placements", None)
    if placements is not None and mode == "auto":
        coord = param.device_mesh.get_coordinate()  # type: ignore[attr-defined]
        if coord is None:  # this rank is not in the mesh
            return False
        return all(c == 0 for c, p in zip(coord, placements, strict=True) if p.is_replicate())
    if not (dist.is_available() and dist.is_initialized()):
        return True
    if mode == "auto":
        fsdp1 = getattr(getattr(dist, "fsdp", None), "FullyShardedDataParallel", None)
        if fsdp1 is not None and isinstance(model, fsdp1):
            return True
        group = getattr(model, "process_group", None)  # DDP keeps its group here
        return dist.get_rank(group) == 0
    return dist.get_rank() == 0  # 'replicated': over the whole world


class GradNormTracker:
    """Computes a flat device vector [local_sq per group, owned_sq per group, nonfinite per group]
    plus the three global totals, from the gradients present at optimizer.step time.

    Usage::

        tracker = GradNormTracker(model, groups="block", ownership="auto")
        vec = tracker.compute()          # device tensor or None; no sync, no collective
        records = tracker.records(step, vec.tolist())
    """

    def __init__(self, model: nn.Module, *, groups: str = "block", ownership: str = "auto") -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._params = [p for _, p in named]
        if groups == "param":
            names = [clean_name(n) for n, _ in named]
        elif groups == "block":
            names = [layer_of(n) for n, _ in named]  # 'layers.3': the wire's per-layer label
        else:
            names = [GLOBAL_GROUP for _ in named]
        self.group_names: list[str] = list(dict.fromkeys(names))
        index = {g: i for i, g in enumerate(self.group_names)}
        self._group_of = torch.tensor([index[n] for n in names], dtype=torch.long)
        self._owned = torch.tensor([_owned(p, model, ownership) for p in self._params], dtype=torch.float32)
        self._cache: dict[tuple[torch.device, tuple[int, ...]], _Reduction] = {}
        self._clip_key: tuple[int, ...] = ()
        self._clip_ok = False

    @property
    def width(self) -> int:
        return 3 * len(self.group_names) + 3

    def compute(self) -> torch.Tensor | None:
        out = self._compute()
        return None if out is None else out[0]

    def compute_with_total(self, params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The group vector plus the total L2 norm of `params`' gradients, from one pass.

        The total is what torch.nn.utils.clip_grad_norm_(params) computes (the same per-parameter
        norms, stacked, and torch's own vector_norm of them), so a job clipping through
        Agent.clip_grad_norm_ pays one norm pass for both. None when that identity does not hold:
        not the tracker's parameters, or sharded (DTensor) gradients, whose total needs the job's
        own collective.
        """
        key = tuple(map(id, params))
        if key != self._clip_key:  # decided once per parameter list (the same list every step)
            plain = all(getattr(p, "placements", None) is None for p in params)
            trainable = {id(p) for p in params if p.requires_grad}
            self._clip_ok = plain and trainable == {id(p) for p in self._params}
            self._clip_key = key
        if not self._clip_ok:
            return None
        out = self._compute()
        if out is None:
            return None
        vec, norms = out
        return vec, torch.linalg.vector_norm(norms, 2.0)

    def _compute(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(group vector, the stacked per-parameter norms in the gradients' dtype)."""
        present: list[int] = []
        grads: list[torch.Tensor] = []
        for i, p in enumerate(self._params):
            g = p.grad
            if g is not None:
                present.append(i)
                grads.append(_local(g))
        if not present:
            return None
        norms: tuple[torch.Tensor, ...] | list[torch.Tensor] = torch._foreach_norm(grads, 2.0)
        device = norms[0].device
        if any(n.device != device for n in norms):  # e.g. CPU-offloaded parameters
            norms = [n.to(device, non_blocking=True) for n in norms]
        stacked = torch.stack(norms)
        r = self._reduction(device, tuple(present))
        # Rows local_sq, owned_sq, nonfinite per parameter, written in place into a reused buffer and
        # reduced into groups and totals by two index_add: each op costs a few microseconds of
        # dispatch, 10-30 us with the caches cold after backward, far more than its arithmetic on a
        # few hundred values, so the number of ops (and of distinct ops) is what matters here. Hence
        # mul throughout (x * x is what square computes) and nonfinite as "sq * 0 is NaN" (exactly
        # for inf and NaN): two ops where isfinite alone is four. owned_sq and sq * 0 come from one
        # broadcast mul by the [owned; 0] rows.
        norms32 = stacked if stacked.dtype == torch.float32 else stacked.float()
        torch.mul(norms32, norms32, out=r.sq)
        torch.mul(r.sq, r.owned_zero, out=r.tail)
        torch.ne(r.nonfinite, r.nonfinite, out=r.nonfinite)
        out = r.zeros.index_add(0, r.to_group, r.rows)  # [local_sq | owned_sq | nonfinite] per group
        out.index_add_(0, r.to_total, r.rows)  # the three totals, at the end
        return out, stacked

    def _reduction(self, device: torch.device, present: tuple[int, ...]) -> _Reduction:
        key = (device, present)
        cached = self._cache.get(key)
        if cached is None:
            sel = torch.tensor(present, dtype=torch.long)
            cached = _Reduction(self._group_of[sel], self._owned[sel], len(self.group_names), device)
            self._cache = {key: cached}  # the set of present grads is stable after step 1
        return cached

    def records(self, step: int, values: Sequence[float]) -> list[JsonObject]:
        """Wire-format grad records from a copied-back vector (runs off the training thread)."""
        n = len(self.group_names)
        out: list[JsonObject] = []
        single = n == 1 and self.group_names[0] == GLOBAL_GROUP
        if not single:
            for i, name in enumerate(self.group_names):
                out.append(
                    grad_record(
                        step=step,
                        group=name,
                        owned_sq=values[n + i],
                        local_sq=values[i],
                        nonfinite=int(values[2 * n + i]),
                    )
                )
        out.append(
            grad_record(
                step=step,
                group=GLOBAL_GROUP,
                owned_sq=values[3 * n + 1],
                local_sq=values[3 * n],
                nonfinite=int(values[3 * n + 2]),
            )
        )
        return out


class _Reduction:
    """Per-parameter rows and the index maps that reduce them into the tracker's vector, built once
    per (device, set of parameters with a gradient). The rows buffer is reused every step (stream
    order keeps that safe on accelerators); the output vector is fresh, it travels to the exporter."""

    def __init__(self, group_of: torch.Tensor, owned: torch.Tensor, n_groups: int, device: torch.device) -> None:
        n = group_of.numel()
        self.rows = torch.zeros(3 * n, dtype=torch.float32, device=device)
        self.sq, self.owned_sq, self.nonfinite = self.rows.view(3, n).unbind(0)
        self.tail = self.rows.view(3, n)[1:]  # owned_sq and nonfinite, written by one mul
        self.owned_zero = torch.stack([owned, torch.zeros(n)]).to(device)  # [owned; 0] per parameter
        self.zeros = torch.zeros(3 * n_groups + 3, dtype=torch.float32, device=device)  # never written
        row = torch.arange(3).repeat_interleave(n)  # which row each element of `rows` belongs to
        self.to_group = (row * n_groups + group_of.repeat(3)).to(device)
        self.to_total = (3 * n_groups + row).to(device)
