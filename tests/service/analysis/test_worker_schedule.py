"""The analysis worker starts its cycles one interval apart (not an interval after each cycle
ends), so a step is reduced within the send interval plus one analysis cycle; after a long cycle it
still rests half an interval. Driven on a fake clock: the loop's own waits are recorded."""

from __future__ import annotations

from trainvitals.service.analysis import worker as worker_module
from trainvitals.service.analysis.worker import AnalysisWorker, pause_after_cycle
from trainvitals.service.settings import Settings


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t


class _Stop:
    """threading.Event's wait as the loop uses it: advances the fake clock, stops after `cycles`."""

    def __init__(self, clock: _Clock, cycles: int) -> None:
        self.clock, self.left, self.waits = clock, cycles, []

    def wait(self, seconds: float) -> bool:
        self.waits.append(round(seconds, 6))
        self.clock.t += seconds
        self.left -= 1
        return self.left < 0

    def set(self) -> None:
        self.left = -1


def test_cycles_start_one_interval_apart_and_rest_half_an_interval_after_long_ones(monkeypatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(worker_module.time, "monotonic", clock.monotonic)
    durations = iter([0.3, 0.3, 1.5, 0.1])

    def run_once(self: AnalysisWorker) -> int:
        clock.t += next(durations)
        return 0

    monkeypatch.setattr(AnalysisWorker, "run_once", run_once)
    worker = AnalysisWorker(lambda: None, Settings(analysis_interval_seconds=2.0))  # type: ignore[arg-type,return-value]
    stop = _Stop(clock, cycles=4)
    worker._stop = stop  # type: ignore[assignment]
    worker._loop()
    assert stop.waits == [2.0, 1.7, 1.7, 1.0, 1.9]


def test_pause_after_cycle() -> None:
    assert pause_after_cycle(2.0, 0.0) == 2.0
    assert pause_after_cycle(2.0, 0.5) == 1.5
    assert pause_after_cycle(2.0, 1.0) == 1.0
    assert pause_after_cycle(2.0, 7.0) == 1.0  # a 16,384-rank cycle: half an interval's rest
