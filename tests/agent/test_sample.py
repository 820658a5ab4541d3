"""A step's device values reach the host on the exporter thread, never by a wait in training.

There is no accelerator on the test machines: `_OnAnAccelerator` is a real CPU tensor (a
`torch.Tensor` subclass) that reports itself as on an XPU and notes the thread of every copy to the
host. The torch backend there has no XPU, so its event is refused, as a backend without events.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from trainvitals.agent import _sample
from trainvitals.agent._sample import DeviceStack


class _OnAnAccelerator(torch.Tensor):
    copied_on: list[str] = []  # names of the threads that copied one to the host

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("xpu")

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        _OnAnAccelerator.copied_on.append(threading.current_thread().name)
        return self.as_subclass(torch.Tensor).to(*args, **kwargs)


def _on_an_accelerator(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(_OnAnAccelerator)


def test_another_accelerators_values_are_copied_by_the_exporter_thread() -> None:
    _OnAnAccelerator.copied_on.clear()
    stack = DeviceStack()
    assert stack.add_scalar("loss", _on_an_accelerator(torch.tensor(2.5)))
    stack.add(_on_an_accelerator(torch.tensor([1.0, 4.0])), lambda step, vals: [{"step": step, "vals": vals}])

    sample = stack.sample({"step": 7, "ts": 1.0, "step_seconds": 0.5})

    assert _OnAnAccelerator.copied_on == []  # the training thread did not wait for the device
    assert sample.values is not None and sample.values.device.type == "xpu"
    assert "xpu" in _sample._NO_EVENTS  # this torch has no XPU: the event was refused, and is not tried again

    out: list[Any] = []
    exporter = threading.Thread(target=lambda: out.extend(sample.records()), name="exporter")
    exporter.start()
    exporter.join()

    assert _OnAnAccelerator.copied_on == ["exporter"]
    assert out[0]["step"] == 7 and out[0]["loss"] == 2.5
    assert out[1] == {"step": 7, "vals": [1.0, 4.0]}


def test_cpu_values_are_handed_over_without_a_copy() -> None:
    vector = torch.tensor([3.0, 5.0])
    stack = DeviceStack()
    stack.add(vector, lambda step, vals: [{"step": step, "vals": vals}])

    sample = stack.sample({"step": 1, "ts": 1.0, "step_seconds": 0.5})

    assert sample.values is vector and sample.event is None
    assert sample.records()[1] == {"step": 1, "vals": [3.0, 5.0]}
