"""A job with a loss scaler (torch.amp.GradScaler, as fp16 training uses it): the steps it skips on
inf/NaN gradients reach the collector as skipped, and are not paged as non-finite gradients.

Real parts: a torch job with torch's GradScaler on CPU, the agent attached as docs/agent.md says,
a real collector on each backend, and the analysis pipeline's reduction and detectors. The scaler
starts near float32's top so that its first steps overflow, as fp16's first steps do with the
default 2**16, and grows again every few steps, as a long fp16 job overflows once in a while.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from torch import nn

import trainvitals.agent as tv
from trainvitals.service.analysis import pipeline
from trainvitals.service.store import queries
from trainvitals.service.store.models import StepSummary


def _train_with_scaler(run: str, collector_url: str, tmp_path: Path, steps: int, *,
                       poison_grads: bool = False) -> list[bool]:
    """The loop of docs/agent.md with a GradScaler; which steps the scaler skipped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    config = tv.AgentConfig(collector=collector_url, spill_dir=str(tmp_path / "spool"))
    agent = tv.attach(model, opt, run=run, config=config)
    if poison_grads:  # a NaN from backward on every step: no scale can make these finite
        model[0].weight.register_hook(lambda g: g * math.nan)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**126, growth_interval=8)
    skipped = []
    for _ in range(steps):
        loss = (model(torch.randn(8, 16)) - 1).pow(2).mean() * 100
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        total = agent.clip_grad_norm_(model.parameters(), 1.0)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        opt.zero_grad()
        agent.step(loss=loss, grad_norm=total)
    agent.close()
    return skipped


def _analyse(collector: object, run: str) -> tuple[list[int], list[dict]]:
    """Reduce and detect the stored run; its steps' skipped_ranks and its findings."""
    with collector.app.state.sessionmaker() as session:  # type: ignore[attr-defined]
        pipeline.process_run(session, queries.get_run(session, run_id=run), now=time.time() + 3600)
        skipped = session.query(StepSummary.skipped_ranks).filter_by(run_id=run).order_by(StepSummary.step)
        return [n for (n,) in skipped], queries.findings(session, run_id=run)


def test_steps_a_loss_scaler_skipped_arrive_as_skipped_and_page_nobody(collector, tmp_path: Path) -> None:
    skipped = _train_with_scaler("fp16-like", collector.url, tmp_path, 120)
    assert 3 <= sum(skipped[:10]) and sum(skipped[10:]) >= 3  # overflowed while calibrating, and later
    ranks_skipped, found = _analyse(collector, "fp16-like")
    assert ranks_skipped == [int(s) for s in skipped]  # exactly the scaler's skips, one rank each
    assert [f for f in found if f["severity"] in ("page", "ticket")] == []  # grad_nonfinite paged at step 0 before


def test_a_scaler_that_skips_every_step_pages(collector, tmp_path: Path) -> None:
    """NaN gradients on every step: the scaler skips them all and the scale collapses. Paged as
    non-finite gradients from the first skipped step; nothing was learned since."""
    skipped = _train_with_scaler("collapsed", collector.url, tmp_path, 40, poison_grads=True)
    assert all(skipped)
    _, found = _analyse(collector, "collapsed")
    (page,) = [f for f in found if f["kind"] == "grad_nonfinite"]
    assert page["severity"] == "page" and page["onset_step"] == 0 and page["active"]
    assert "loss scale is collapsing" in page["summary"]
