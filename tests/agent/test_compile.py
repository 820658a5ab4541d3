"""A job that compiles its model (torch.compile, inductor) trains with the agent attached, and the
FP8 shadow statistics of the compiled modules are still measured.

Inductor cannot compile the monitor's hooks (in-place writes into its slots): traced into the
job's graph they raised BackendCompilerFailed into the training loop. They are excluded from
compilation and run eagerly at a graph break, on measured steps only."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import trainvitals.agent as tv
from trainvitals.agent import AgentConfig

pytestmark = pytest.mark.slow  # inductor compiles C++ on CPU: tens of seconds


def test_compiled_model_trains_and_is_measured(collector, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    record = tmp_path / "record.jsonl"
    cfg = AgentConfig(
        collector=collector.url,
        spill_dir=str(tmp_path / "spool"),
        record_file=str(record),
        fp8_every_steps=4,
        fp8_expensive_every_steps=8,
    )
    agent = tv.attach(model, opt, run="compiled", config=cfg)
    assert isinstance(agent, tv.Agent)
    compiled = torch.compile(model, backend="inductor")
    for _ in range(10):
        loss = compiled(torch.randn(16, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.step(loss=loss)
    agent.close()
    assert agent._errors.errors == 0
    lines = record.read_text().splitlines()[1:]  # the first line is the registration
    records = [r for line in lines for r in json.loads(line)["records"]]
    tensors = [r for r in records if r["kind"] == "tensor"]
    # Sampled steps 0, 4 and 8: input, weight and grad_output of both Linears, measured for real.
    assert sorted({r["step"] for r in tensors}) == [0, 4, 8]
    assert {(r["tensor"], r["role"]) for r in tensors} == {
        (name, role) for name in ("0", "2") for role in ("input", "weight", "grad_output")
    }
    assert all(r["amax"] > 0 for r in tensors)
    assert any(r.get("sat_frac") is not None for r in tensors)  # the expensive tier ran too
    assert len([r for r in records if r["kind"] == "step"]) == 10
