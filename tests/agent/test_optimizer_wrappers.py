"""attach() with the optimizer a training library hands back.

accelerate's `accelerator.prepare` returns an `AcceleratedOptimizer`: an Optimizer subclass that
never ran `Optimizer.__init__`, so registering a step hook on it raised, and attach() returned a
NoopAgent: a job written the accelerate way was not monitored at all. The agent now hooks the
torch optimizer the wrapper holds. An optimizer that takes no hooks and wraps none (a hand-written
one) keeps the agent running and costs one warning line that says what is lost and the fix.

Real parts: accelerate's Accelerator on CPU, the agent, a real collector (each backend).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from torch import nn

import trainvitals.agent as tv
from trainvitals.service.store import queries
from trainvitals.wire import Batch


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _attach(model: nn.Module, opt: object, run: str, collector_url: str, tmp_path: Path) -> tv.TrainingAgent:
    config = tv.AgentConfig(
        collector=collector_url, spill_dir=str(tmp_path / "spool"), record_file=str(tmp_path / "rec-{rank}.jsonl")
    )
    return tv.attach(model, opt, run=run, config=config)  # type: ignore[arg-type]


def _sent(tmp_path: Path) -> list:
    lines = (tmp_path / "rec-0.jsonl").read_bytes().splitlines()
    return [r for line in lines[1:] for r in Batch.model_validate_json(line).records]


def test_an_accelerate_prepared_optimizer_is_measured_through_its_wrapper(collector, tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(*_model())
    assert type(opt).__name__ == "AcceleratedOptimizer"
    agent = _attach(model, opt, "accelerate", collector.url, tmp_path)
    assert isinstance(agent, tv.Agent)  # was a NoopAgent: nothing monitored
    for _ in range(6):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        agent.step(loss=loss)
    agent.close()
    records = _sent(tmp_path)
    steps = [r for r in records if r.kind == "step"]
    assert [s.step for s in steps] == list(range(6)) and not any(s.skipped for s in steps)
    grads = [r for r in records if r.kind == "grad" and r.group == "__global__"]
    assert [g.step for g in grads] == list(range(6)) and all(g.owned_sq > 0 for g in grads)
    with collector.app.state.sessionmaker() as session:
        assert queries.count_step_rows(session, run_id="accelerate") == 6


def test_with_accelerate_accumulating_the_micro_steps_are_sent_as_skipped(collector, tmp_path: Path) -> None:
    """`accelerator.accumulate` makes optimizer.step() a no-op until the gradients sync: a job that
    calls agent.step() per micro-batch sends those as skipped (no update applied), and measures the
    gradients the optimizer applies."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, opt = accelerator.prepare(*_model())
    agent = _attach(model, opt, "accumulating", collector.url, tmp_path)
    synced = []
    for _ in range(6):
        with accelerator.accumulate(model):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        synced.append(accelerator.sync_gradients)
        agent.step(loss=loss)
    agent.close()
    assert synced == [False, True] * 3
    records = _sent(tmp_path)
    assert [s.skipped for s in records if s.kind == "step"] == [not s for s in synced]
    grads = [r.step for r in records if r.kind == "grad" and r.group == "__global__"]
    assert grads == [step for step, s in enumerate(synced) if s]


class HandWrittenSGD:
    """An optimizer that is not a torch.optim.Optimizer: no step hooks, nothing under it."""

    def __init__(self, params: list[nn.Parameter], lr: float) -> None:
        self.params, self.lr = params, lr

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            p -= self.lr * p.grad

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


@pytest.mark.parametrize("passed", ["hand-written", "none"])
def test_an_optimizer_without_step_hooks_keeps_the_agent_and_says_what_is_lost(
    passed: str, collector, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """attach(model) with no optimizer at all measured no gradient norm, clip_grad_norm_() through
    the agent included, and said nothing (until 2026-11-29); now as a hand-written optimizer."""
    model, _ = _model()
    opt = HandWrittenSGD(list(model.parameters()), lr=0.01)
    with caplog.at_level(logging.WARNING, logger="trainvitals.agent"):
        agent = _attach(model, opt if passed == "hand-written" else None, passed, collector.url, tmp_path)
    assert isinstance(agent, tv.Agent)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "trainvitals.agent"]
    assert ("HandWrittenSGD" if passed == "hand-written" else "attach() got no optimizer") in line
    assert "agent.clip_grad_norm_()" in line
    assert "pass the torch.optim.Optimizer that steps: attach(model, optimizer)" in line
    for _ in range(4):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        total = agent.clip_grad_norm_(model.parameters(), 1.0)  # measured here, as the line says
        opt.step()
        opt.zero_grad()
        agent.step(loss=loss, grad_norm=total)
    agent.close()
    records = _sent(tmp_path)
    assert not any(s.skipped for s in records if s.kind == "step")  # unknown, so not said
    grads = [r for r in records if r.kind == "grad" and r.group == "__global__"]
    assert [g.step for g in grads] == [0, 1, 2, 3]
