"""SIGTERM (how torchrun stops every rank when one fails) ends a training process in order: the
agent's exit pass delivers what was queued, instead of the process dying with it in memory.
A real child process, a real signal, a real collector; the opt-out shows what is lost without it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent.test_spool_faults import _stored

CHILD = """
import sys, time, torch
from torch import nn
import trainvitals.agent as tv

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
config = tv.AgentConfig(collector=sys.argv[1], spill_dir=sys.argv[2], send_interval_s=3600.0,
                        exit_on_sigterm=sys.argv[3] == "1")
agent = tv.attach(model, opt, run="term", config=config)
for _ in range(20):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    agent.step(loss=loss, tokens=32)
print("ready", flush=True)
time.sleep(120)  # the training loop, waiting: SIGTERM arrives here
"""


def _run_and_terminate(url: str, spill: Path, exit_on_sigterm: bool) -> int:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, url, str(spill), "1" if exit_on_sigterm else "0"],
        stdout=subprocess.PIPE, text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGTERM)
    return child.wait(timeout=60)


def test_sigterm_delivers_the_queued_steps_before_the_process_ends(collector, tmp_path: Path) -> None:
    # Nothing is sent during the run (a 1-hour send interval): every step is still queued at SIGTERM.
    status = _run_and_terminate(collector.url, tmp_path / "spool", exit_on_sigterm=True)
    assert status == 128 + signal.SIGTERM  # what a SIGTERM'd process reports to its shell
    steps, _events = _stored(collector.db_url, run="term")
    assert steps == list(range(20))


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_without_it_the_queued_steps_die_with_the_process(collector, tmp_path: Path) -> None:
    status = _run_and_terminate(collector.url, tmp_path / "spool", exit_on_sigterm=False)
    assert status == -signal.SIGTERM
    steps, _events = _stored(collector.db_url, run="term")
    assert steps == []
