"""The shadow FP8 cadence: widened once, early, when a sample costs more than fp8_cost_budget of the
step on this machine; exact staleness and an intact history across the change."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainvitals.agent as tv
from trainvitals.agent._fp8_cadence import WARMUP_SAMPLES, Fp8Cadence
from trainvitals.agent._fp8_monitor import Fp8Monitor


def test_the_smallest_cadence_that_fits_the_budget_is_chosen() -> None:
    # 0.25% of a 100 ms step is 0.25 ms a step: a 4 ms sample fits at every 16+ steps.
    assert Fp8Cadence(20, 0.0025).choose(4e-3, 0.1) == 20  # 0.2%
    assert Fp8Cadence(20, 0.0025).choose(8.7e-3, 0.1127) == 40  # this session's Xeon: 0.39% at 20
    assert Fp8Cadence(20, 0.0025).choose(12e-3, 0.1) == 80  # 0.6% at 20, 0.3% at 40
    assert Fp8Cadence(20, 0.0025).choose(1.0, 0.1) == 80  # never rarer than 4x


def test_the_decision_waits_for_the_warmup_and_leaves_out_the_first_sample() -> None:
    cadence = Fp8Cadence(20, 0.0025)
    decided = []
    for k in range(WARMUP_SAMPLES):
        # The first sample (allocations, first touch) costs 100x; the others 4 ms against 100 ms steps.
        decided.append(cadence.note(0.1, True, 0.4 if k == 0 else 4e-3))
        for _ in range(19):
            decided.append(cadence.note(0.1, False, 0.0))
    assert decided == [None] * len(decided) and cadence.decided and cadence.every == 20
    assert cadence.note(0.1, True, 1.0) is None  # decided once: later samples change nothing


def test_a_zero_budget_never_changes_the_cadence() -> None:
    cadence = Fp8Cadence(20, 0.0)
    assert cadence.decided and all(cadence.note(0.1, True, 1.0) is None for _ in range(10))


def _small_linears() -> nn.Module:
    # Sixteen 8x8 Linears: a step of a few hundred us, against ~32 hook calls on a sampled step.
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(16)])


def _train(tmp_path: Path, steps: int, **config: Any) -> tuple[list[dict[str, Any]], dict[str, int]]:
    model = _small_linears()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    record = tmp_path / "rec.jsonl"
    agent = tv.attach(
        model, opt, run="cadence",
        config=tv.AgentConfig(collector="", spill_dir=str(tmp_path), record_file=str(record), **config),
    )  # fmt: skip
    try:
        for _ in range(steps):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            agent.step(loss=0.0)
    finally:
        agent.close()
    records = [r for line in record.read_text().splitlines() for r in json.loads(line).get("records", [])]
    return [r for r in records if r["kind"] == "tensor"], agent.stats()


def test_samples_that_cost_more_than_the_budget_widen_the_cadence_once(tmp_path: Path, caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="trainvitals"):
        tensors, stats = _train(tmp_path, 70, fp8_every_steps=4)
    sampled = sorted({r["step"] for r in tensors if r["tensor"] == "0.0" and r["role"] == "input"})
    # Five samples at every 4 (steps 0-16), then every 16: a sample here costs far more than
    # 0.25% of 4 steps.
    assert sampled == [0, 4, 8, 12, 16, 32, 48, 64] and stats["fp8_every_steps"] == 16
    said = [r.getMessage() for r in caplog.records if "FP8 shadow sampling" in r.getMessage()]
    assert len(said) == 1
    assert said[0].startswith("trainvitals agent: FP8 shadow sampling every 16 steps instead of every 4")
    assert said[0].endswith("AgentConfig(fp8_cost_budget=0) keeps every 4")
    # Staleness stays in steps across the change: the history maximum's sample, counted in steps.
    stale = {r["step"]: r.get("staleness_steps") for r in tensors if r["tensor"] == "0.0" and r["role"] == "weight"}
    assert all(v % 4 == 0 and v <= step for step, v in stale.items() if v is not None)


def test_a_zero_budget_keeps_the_configured_cadence(tmp_path: Path, caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="trainvitals"):
        tensors, stats = _train(tmp_path, 30, fp8_every_steps=4, fp8_cost_budget=0)
    sampled = sorted({r["step"] for r in tensors if r["tensor"] == "0.0" and r["role"] == "input"})
    assert sampled == list(range(0, 30, 4)) and stats["fp8_every_steps"] == 4
    assert not [r for r in caplog.records if "FP8 shadow sampling" in r.getMessage()]


def test_a_budget_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="fp8_cost_budget must be a share of the step time"):
        tv.AgentConfig(collector="", fp8_cost_budget=2.5)


def test_a_wider_cadence_keeps_the_history_and_counts_staleness_in_steps() -> None:
    """The spike sampled before the change stays the history maximum after it (as a recipe's
    history would hold it for L steps), and its staleness counts the steps at each cadence."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8))
    mon = Fp8Monitor(
        model, history_len=64, mode="shadow", module_filter=lambda n, m: isinstance(m, nn.Linear), expensive_every=0
    )
    mon.set_every(4)

    def sample(scale: float) -> dict[str, Any]:
        model(torch.full((4, 8), scale)).sum().backward()
        vec, expensive = mon.end_step()
        assert vec is not None
        return {r["role"]: r for r in mon.records(0, vec.tolist(), expensive)}

    sample(1.0)
    sample(8.0)  # the spike, one sample (4 steps) later
    assert sample(1.0)["input"]["staleness_steps"] == 0  # the spike is the newest sample
    mon.set_every(16)  # 16 rows -> 4 rows: the 3 samples are kept
    after = sample(1.0)["input"]
    assert after["headroom_bits"] == pytest.approx(3.0)  # still scaled for the spike
    assert after["staleness_steps"] == 4  # one sample at every 4
    assert sample(1.0)["input"]["staleness_steps"] == 4 + 16
    assert sample(1.0)["input"]["staleness_steps"] == 4 + 32  # 4 rows: the spike is the oldest
    gone = sample(1.0)["input"]  # pushed out of the 4-row history
    assert gone["headroom_bits"] == pytest.approx(0.0) and gone["staleness_steps"] in (0, 16, 32, 48)
    mon.close()
