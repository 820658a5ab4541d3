"""The synthetic run generator and its wire-format v1 conversion."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import numpy as np
import pytest

from trainvitals.service.detectors.series import CheckpointEvent
from trainvitals.testing.scenarios import (
    FAULT_FAMILIES,
    HEALTHY_FAMILIES,
    make_scenario,
    prefix,
    to_wire_lines,
)
from trainvitals.wire.v1 import Batch, RunRegistration


@pytest.mark.parametrize("family", HEALTHY_FAMILIES + FAULT_FAMILIES)
def test_seeded_and_well_formed(family: str) -> None:
    a, b = make_scenario(family, 5), make_scenario(family, 5)
    assert np.array_equal(a.series.steps.grad_norm, b.series.steps.grad_norm, equal_nan=True)
    assert not np.array_equal(a.series.steps.loss, make_scenario(family, 6).series.steps.loss, equal_nan=True)
    s = a.series
    assert np.all(np.diff(s.steps.steps) == 1) and np.all(np.diff(s.steps.ts) > 0)
    assert s.ranks is not None and s.ranks.compute_seconds.shape == (len(s.steps.steps), a.layout.world)
    assert a.healthy == family.startswith("healthy")
    if not a.healthy:
        assert a.injected_step is not None and a.expect_kinds
        if a.loss_move_step is not None:
            assert a.loss_move_step > a.injected_step


def test_unknown_family() -> None:
    with pytest.raises(ValueError):
        make_scenario("nope", 0)


def test_wire_lines_validate_and_carry_the_series() -> None:
    sc = make_scenario("healthy_resume", 2)
    cut = prefix(sc.series, 260)
    cut.groups.norms[250, 3] = np.nan  # a non-finite gradient in one group
    cut.steps.grad_norm[250] = np.nan
    cut.checkpoints.append(CheckpointEvent(generation=1, step=200, status="persisted",
                                           ts=float(cut.steps.ts[201])))
    short = dataclasses.replace(sc, series=cut, incarnation_from={220: 1})
    lines = list(to_wire_lines(short, steps_per_batch=25))
    reg = RunRegistration.model_validate_json(lines[0])
    assert reg.run == sc.series.run and reg.parallelism.world_size == sc.layout.world
    batches = [Batch.model_validate_json(line) for line in lines[1:]]
    seqs: dict[tuple[int, int], list[int]] = defaultdict(list)
    owned: dict[int, float] = defaultdict(float)
    loss: dict[int, list[float]] = defaultdict(list)
    tensors: dict[int, int] = defaultdict(int)
    for b in batches:
        seqs[(b.rank, b.incarnation)].append(b.seq)
        for r in b.records:
            if r.kind == "grad" and r.group == "__global__":
                owned[r.step] += r.owned_sq
            elif r.kind == "step" and r.loss is not None:
                loss[r.step].append(r.loss)
            elif r.kind == "tensor":
                tensors[r.step] += 1
    assert all(v == list(range(len(v))) for v in seqs.values())  # per (rank, incarnation) from 0, no gaps
    assert {inc for _, inc in seqs} == {0, 1}  # the resume starts a new incarnation
    s = short.series.steps
    for i in (0, 100, 249):
        assert math.sqrt(owned[i]) == pytest.approx(s.grad_norm[i], rel=1e-9)  # rank 0 owns the global norm
        assert np.mean(loss[i]) == pytest.approx(s.loss[i])  # the last pipeline stage reports the loss
        assert tensors[i] == len(short.series.tensors)  # one data-parallel replica sends every tensor
    assert not math.isfinite(owned[250])  # a non-finite gradient travels as NaN, not as an error
    kinds = {r.kind for b in batches for r in b.records}
    assert kinds == {"step", "grad", "tensor", "checkpoint", "event"}
