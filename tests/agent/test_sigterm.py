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


# The job ends on its own (torchrun's other ranks: the collective's error), and SIGTERM arrives
# while the agent's exit pass is delivering: raised from the transport's first request, so that it
# lands in that pass every time, then the request goes on 0.5 s later.
ENDING = """
import os, signal, sys, time, torch
from torch import nn
import trainvitals.agent as tv
from trainvitals.agent import _transport

model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
config = tv.AgentConfig(collector=sys.argv[1], spill_dir=sys.argv[2], send_interval_s=3600.0)
agent = tv.attach(model, opt, run="ending", config=config)
for _ in range(20):
    model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
    agent.step(loss=1.0)
post = _transport.HttpTransport.post

def post_after_sigterm(self, path, body, timeout):
    if not getattr(post_after_sigterm, "sent", False):
        post_after_sigterm.sent = True
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # the main thread, waiting in close(), runs the signal's handler meanwhile
    return post(self, path, body, timeout)

_transport.HttpTransport.post = post_after_sigterm
print("ending", flush=True)
"""


def test_a_sigterm_during_the_exit_pass_waits_for_its_delivery(collector, tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c", ENDING, collector.url, str(tmp_path / "spool")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert child.stdout.strip() == "ending", child.stderr
    # The process was ending with status 0 and keeps it; no "Exception ignored in atexit" traceback.
    assert child.returncode == 0 and "Traceback" not in child.stderr, child.stderr[-2000:]
    steps, _events = _stored(collector.db_url, run="ending")
    assert steps == list(range(20)), child.stderr[-2000:]
    assert not list((tmp_path / "spool").glob("*.jsonl")), "delivered, so nothing is left spooled"


# How most jobs are written: the agent is a local of main(). SIGTERM's SystemExit (and a plain
# return without close()) drops the last reference to it before atexit runs; the atexit close must
# still find it. With a weak reference there, every record of the last send interval was lost (seen
# in the crash-and-relaunch e2e test: the surviving ranks delivered nothing, exit status 143).
IN_MAIN = """
import sys, time, torch
from torch import nn
import trainvitals.agent as tv

def main(url, spill, ending):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    config = tv.AgentConfig(collector=url, spill_dir=spill, send_interval_s=3600.0)
    agent = tv.attach(model, opt, run="in-main-" + ending, config=config)
    for _ in range(20):
        model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
        agent.step(loss=1.0)
    if ending == "return":
        return 0  # the two-line integration: no close()
    print("ready", flush=True)
    time.sleep(120)  # SIGTERM arrives here

sys.exit(main(*sys.argv[1:]))
"""


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("ending", ["sigterm", "return"])
def test_an_agent_attached_inside_main_delivers_when_main_is_left(collector, tmp_path: Path, ending: str) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", IN_MAIN, collector.url, str(tmp_path / "spool"), ending],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    if ending == "sigterm":
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)
    _out, err = child.communicate(timeout=60)
    assert child.returncode == (128 + signal.SIGTERM if ending == "sigterm" else 0), err[-2000:]
    steps, _events = _stored(collector.db_url, run="in-main-" + ending)
    assert steps == list(range(20)), err[-2000:]
    assert not list((tmp_path / "spool").glob("*.jsonl")), "delivered, so nothing is left spooled"
