"""Gradient sums of squares per parameter group, on device, with no collective.

Each rank reports, per group, `local_sq` (every gradient element it holds) and `owned_sq` (only
the elements this rank is responsible for, so that summing owned_sq over all ranks counts every
element of the global gradient exactly once: shards summed once, replicas counted once). The
collector takes sqrt(sum over ranks of owned_sq); replicas' local_sq must agree, which makes
silent corruption of one replica visible.

Every parameter of the model is watched, frozen ones too: a job that unfreezes layers as it
trains (a frozen backbone, Lightning's BaseFinetuning) has their gradients counted from the first
step they hold one. A group is reported at a step only when one of its parameters has a gradient
there: "no gradient" is not a norm of 0.

Ownership, per parameter, decided once the process group exists (at attach, or at the first step
with gradients when attach() ran before init_process_group: until then every parameter looked
owned, and each DDP replica would have counted the whole gradient):
- DTensor gradients (FSDP2 `fully_shard`, TP): Shard dims are distinct data, so they count; along
  every Replicate mesh dim only coordinate 0 counts.
- Plain tensors under DDP: replicated over the DDP process group, so only its rank 0 counts.
- FSDP1 flat parameters: every rank holds a distinct shard.
- Single process: everything counts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from trainvitals.agent._dist import process_group_exists
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
    if not process_group_exists():
        return True
    if mode == "auto":
        fsdp1 = getattr(getattr(dist, "fsdp", None), "FullyShardedDataParallel", None)
        if fsdp1 is not None and isinstance(model, fsdp1):
            return True
        group = getattr(model, "process_group", None)  # DDP keeps its group here
        return dist.get_rank(group) == 0
    return dist.get_rank() == 0  # 'replicated': over the whole world


_F32_MAX = torch.finfo(torch.float32).max

Decoder = Callable[[int, list[float]], list[JsonObject]]


class GradNorms(NamedTuple):
    """One step's per-parameter gradient norms (a fresh device vector, no sync) and the decoder
    that turns their host values into grad records (`GradNormTracker.records`)."""

    norms: torch.Tensor
    decode: Decoder


class GradNormTracker:
    """Per parameter group, local_sq, owned_sq and nonfinite, plus the three global totals, from
    the gradients present at optimizer.step time.

    The training thread computes only the per-parameter norms (one `_foreach_norm`, which torch's
    own clip_grad_norm_ computes too); the exporter thread sums their squares into groups from the
    copied-back values. Each op on the training thread costs 10-30 us with the caches cold after
    backward: the five ops of a device-side group sum were 25-60 us per step there.

    Usage::

        tracker = GradNormTracker(model, groups="block", ownership="auto")
        grads = tracker.compute()        # GradNorms or None; no sync, no collective
        records = grads.decode(step, grads.norms.tolist())    # on the exporter thread
    """

    def __init__(self, model: nn.Module, *, groups: str = "block", ownership: str = "auto") -> None:
        self._model, self._groups, self._ownership = model, groups, ownership
        self.relisted = 0  # times the model's parameters were found replaced (FSDP2 after attach)
        self._watch()

    def _watch(self) -> None:
        """List the model's parameters, their groups and ownership."""
        model, groups = self._model, self._groups
        # Frozen parameters too (their grad is None, skipped per step): until 2026-11-29 only those
        # trainable at attach were watched, and layers unfrozen later were left out of every norm.
        named = list(model.named_parameters())
        self._params = [p for _, p in named]
        if groups == "param":
            names = [clean_name(n) for n, _ in named]
        elif groups == "block":
            names = [layer_of(n) for n, _ in named]  # 'layers.3': the wire's per-layer label
        else:
            names = [GLOBAL_GROUP for _ in named]
        self.group_names: list[str] = list(dict.fromkeys(names))
        index = {g: i for i, g in enumerate(self.group_names)}
        self._owned = [_owned(p, model, self._ownership) for p in self._params]
        self._owned_without_group = not process_group_exists()  # decided again once the group exists
        self._group_index = [index[n] for n in names]
        self._decoders: dict[tuple[int, ...], Decoder] = {}
        # The parameters with a gradient (their indices), a new tuple only when that set changes.
        self.present: tuple[int, ...] = ()
        self._clip_key: tuple[int, ...] = ()
        self._clip_ok = False
        self._not_clipped: list[torch.Tensor] = []  # the tracker's parameters outside the clipped list
        self._sparse = False  # the model has sparse gradients: _norms() takes them apart

    def compute_with_total(self, params: list[torch.Tensor]) -> tuple[GradNorms, torch.Tensor] | None:
        """This step's norms (as compute()) plus the total L2 norm of `params`' gradients, from one pass.

        The total is what torch.nn.utils.clip_grad_norm_(params) computes (the same per-parameter
        norms, stacked, and torch's own vector_norm of them), so a job clipping through
        Agent.clip_grad_norm_ pays one norm pass for both. None when that identity does not hold:
        not the tracker's parameters, parameters left out of `params` that have a gradient (a layer
        unfrozen after the job built its list), or sharded (DTensor) gradients, whose total needs
        the job's own collective.
        """
        key = tuple(map(id, params))
        if key != self._clip_key:  # decided once per parameter list (the same list every step)
            plain = all(getattr(p, "placements", None) is None for p in params)
            clipped = set(key)
            self._clip_ok = plain and clipped <= {id(p) for p in self._params}
            self._not_clipped = [p for p in self._params if id(p) not in clipped]
            self._clip_key = key
        # A list of the parameters trainable when it was built (filter(requires_grad)) holds the same
        # gradients as long as the ones it leaves out have none: not after they are unfrozen.
        if not self._clip_ok or (self._not_clipped and any(p.grad is not None for p in self._not_clipped)):
            return None
        grads = self.compute()
        if grads is None:
            return None
        return grads, torch.linalg.vector_norm(grads.norms, 2.0)

    def compute(self) -> GradNorms | None:
        """This step's per-parameter norms (stacked, in the gradients' dtype) and the decoder of this
        set of parameters with a gradient; None when no parameter has a gradient."""
        present: list[int] = []
        grads: list[torch.Tensor] = []
        for i, p in enumerate(self._params):
            g = p.grad
            if g is not None:
                present.append(i)
                grads.append(_local(g))
        if not present:
            if self._params and next(self._model.parameters(), None) is not self._params[0]:
                # Replaced since they were listed: FSDP2's fully_shard after attach() swaps every
                # parameter for a sharded one, whose gradients the old list never saw (until
                # 2026-12-03: no gradient norm at all, and nothing said).
                self.relisted += 1
                self._watch()
                return self.compute()
            return None
        norms = self._norms(grads)
        device = norms[0].device
        if any(n.device != device for n in norms):  # e.g. CPU-offloaded parameters
            norms = [n.to(device, non_blocking=True) for n in norms]
        if self._owned_without_group and process_group_exists():
            self._owned_without_group = False
            self._owned = [_owned(p, self._model, self._ownership) for p in self._params]
            self._decoders = {}
        key = tuple(present)
        decode = self._decoders.get(key)
        if decode is None:  # the set of parameters with a gradient is stable after the first step
            decode = functools.partial(self.records, [self._group_index[i] for i in present],
                                       [1.0 if self._owned[i] else 0.0 for i in present])  # fmt: skip
            self._decoders = {key: decode}
            self.present = key
        # A fresh tensor (torch.stack), never written again: it travels to the exporter as it is.
        return GradNorms(torch.stack(norms), decode)

    def _norms(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, ...] | list[torch.Tensor]:
        """The L2 norm of each gradient, as device scalars: one `_foreach_norm`, unless the model
        has sparse gradients (nn.Embedding(sparse=True) under SparseAdam), which no norm kernel
        takes: then each sparse one is the norm of its coalesced values (an index's duplicates
        summed first, as the dense gradient holds them). Known after the first step that meets one."""
        if not self._sparse:
            try:
                return torch._foreach_norm(grads, 2.0)
            except (NotImplementedError, RuntimeError):
                if not any(g.is_sparse for g in grads):
                    raise
                self._sparse = True
        plain = [g for g in grads if not g.is_sparse]
        dense = iter(torch._foreach_norm(plain, 2.0) if plain else ())
        return [torch.linalg.vector_norm(g.coalesce().values(), 2.0) if g.is_sparse else next(dense) for g in grads]

    def records(self, groups: list[int], owned: list[float], step: int, norms: Sequence[float]) -> list[JsonObject]:
        """Wire-format grad records from one step's copied-back per-parameter norms (the exporter
        thread; `compute()` binds groups and owned, per parameter with a gradient). A group none of
        whose parameters has a gradient (frozen, or unused this step) gets no record.

        Python floats, within float32's range as the device's float32 sums were: a square or sum
        past it is inf, so a parameter whose squared norm overflows counts as non-finite. As before,
        a non-owned parameter's inf makes owned_sq NaN (inf * 0)."""
        n = len(self.group_names)
        local, owned_sq, nonfinite = [0.0] * (n + 1), [0.0] * (n + 1), [0] * (n + 1)  # [n]: the totals
        for norm, g, own in zip(norms, groups, owned, strict=True):
            sq = _f32(norm * norm)
            bad = not math.isfinite(sq)
            for k in (g, n):
                local[k] += sq
                owned_sq[k] += sq * own
                nonfinite[k] += bad
        single = n == 1 and self.group_names[0] == GLOBAL_GROUP
        shown = [] if single else sorted(set(groups))  # groups with no gradient this step are not a 0
        names = [*(self.group_names[k] for k in shown), GLOBAL_GROUP]
        return [
            grad_record(step=step, group=name, owned_sq=_f32(owned_sq[k]), local_sq=_f32(local[k]),
                        nonfinite=nonfinite[k])  # fmt: skip
            for k, name in zip([*shown, n], names, strict=True)
        ]


def _f32(x: float) -> float:
    """x as float32 arithmetic leaves it past its range: +-inf (NaN stays NaN)."""
    return math.copysign(math.inf, x) if abs(x) > _F32_MAX else x
