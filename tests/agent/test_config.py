"""AgentConfig: where the spool goes by default, how often a rank sends, and what overrides them."""

import getpass
import tempfile
import threading
from collections import Counter
from pathlib import Path

import pytest

from trainvitals.agent import AgentConfig
from trainvitals.agent._config import send_phase
from trainvitals.agent._delivery import spooling_exporter
from trainvitals.wire import RunRegistration


def test_default_spool_is_node_local_and_per_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAINVITALS_SPILL_DIR", raising=False)
    spill = Path(str(AgentConfig(collector="").spill_dir))
    assert spill.parent == Path(tempfile.gettempdir())  # TMPDIR when set, else /tmp: not the cwd
    assert spill.name == f"trainvitals-spool-{getpass.getuser()}"


def test_environment_and_field_override_the_spool_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRAINVITALS_SPILL_DIR", str(tmp_path / "env"))
    assert AgentConfig(collector="").spill_dir == str(tmp_path / "env")
    assert AgentConfig(collector="", spill_dir=str(tmp_path / "field")).spill_dir == str(tmp_path / "field")


@pytest.mark.parametrize(
    ("env", "argument", "registered"),
    [
        (None, None, None),  # none named: the collector takes the token's project
        ("llm", None, "llm"),  # TRAINVITALS_PROJECT
        ("llm", "vision", "vision"),  # attach(project=...) wins
    ],
)
def test_the_registrations_project(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: str | None, argument: str | None, registered: str | None
) -> None:
    import json

    import trainvitals.agent as tv

    if env is None:
        monkeypatch.delenv("TRAINVITALS_PROJECT", raising=False)
    else:
        monkeypatch.setenv("TRAINVITALS_PROJECT", env)
    record = tmp_path / "record.jsonl"
    config = AgentConfig(collector="", spill_dir=str(tmp_path), record_file=str(record))
    agent = tv.attach(run="r1", project=argument, config=config)
    agent.close()
    assert json.loads(record.read_bytes().splitlines()[0]).get("project") == registered


@pytest.mark.parametrize(
    ("world_size", "explicit", "interval"),
    [
        (1, None, 2.0),
        (1024, None, 2.0),  # the largest job at the fixed 2 s: 512 batches/s
        (4096, None, 8.0),
        (16384, None, 32.0),  # still 512 batches/s for the whole job
        (16384, 5.0, 5.0),  # an explicit interval wins
        (1, 0.25, 0.25),
    ],
)
def test_the_send_interval_grows_with_the_job(world_size: int, explicit: float | None, interval: float) -> None:
    assert AgentConfig(collector="", send_interval_s=explicit).send_interval_for(world_size) == interval


@pytest.mark.parametrize("world_size", [1024, 3000, 16384, 100_000])
def test_a_large_job_sends_512_batches_per_second_in_all(world_size: int) -> None:
    assert world_size / AgentConfig(collector="").send_interval_for(world_size) == pytest.approx(512)


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_a_send_interval_must_be_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="send_interval_s"):
        AgentConfig(collector="", send_interval_s=bad)


def test_a_jobs_ranks_spread_their_sends_evenly_over_the_interval() -> None:
    """16,384 ranks at 32 s: about 512 first sends in each second of the interval, not one burst."""
    per_second = Counter(int(32 * send_phase(rank)) for rank in range(16384))
    assert sorted(per_second) == list(range(32))
    assert 511 <= min(per_second.values()) <= max(per_second.values()) <= 513


class _RecordingEvent(threading.Event):
    """The worker's wake-up event, noting how long each wait was asked to last; it waits for a
    set() (the shutdown's) rather than the timeout, so the test takes no wall time."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        self.waiting.set()
        return super().wait()


@pytest.mark.parametrize(
    ("world_size", "explicit", "interval"), [(16384, None, 32.0), (16384, 0.5, 0.5), (8, None, 2.0)]
)
@pytest.mark.parametrize("rank", [0, 1])
def test_the_exporter_thread_waits_the_jobs_interval(
    tmp_path: Path, world_size: int, explicit: float | None, interval: float, rank: int
) -> None:
    """The world size reaches the exporter from the registration (what attach() sends); the first
    pass comes at the rank's phase of the interval, the next ones an interval apart."""
    config = AgentConfig(collector="", spill_dir=str(tmp_path), send_interval_s=explicit)
    registration = RunRegistration(run="r1", parallelism={"world_size": world_size}).model_dump(mode="json")
    exporter = spooling_exporter(config=config, run="r1", rank=rank, incarnation=1, registration=registration)
    wake = _RecordingEvent()
    exporter._wake = wake  # before the thread starts: the only reader of it
    exporter.start()
    try:
        assert wake.waiting.wait(10)
        wake.waiting.clear()
        wake.set()  # end the first wait: the next pass waits a whole interval
        assert wake.waiting.wait(10)
    finally:
        exporter.shutdown()
    assert wake.timeouts[:2] == [pytest.approx(interval * (1 - send_phase(rank))), interval]
