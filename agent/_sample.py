"""One step's values on their way from the device to the exporter thread, with no device sync.

The training thread puts the step's device scalars (loss, the job's grad norm) and the monitors'
device vectors (gradient sums of squares, FP8 statistics) into one `DeviceStack`; `sample()`
concatenates them into one small tensor and starts one non-blocking device-to-host copy (CUDA;
on another accelerator it marks the step's work with an event, and the exporter thread copies). The
exporter thread waits for that copy (never the training thread) and expands the vector into wire
records through each section's decoder. This keeps the hot path free of syncs and of Python
objects per tensor or parameter group: a few objects per step, whatever the model.

On CPU there is nothing to wait for: a one-element scalar is read as a float at once (`item()`,
one op, where the view and the concatenation are three that each cost 10-30 us cold) and a single
vector is handed over as it is (monitors return a fresh one every step), so an ordinary step
there runs no torch op in `sample()`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from trainvitals.wire import step_record
from trainvitals.wire.builders import JsonObject

Decoder = Callable[[int, list[float]], list[JsonObject]]
"""(step, the section's values) -> wire records; runs on the exporter thread."""


class StepSample:
    """One step: its host-side step fields and its device values, possibly still in flight.

    Built by `DeviceStack.sample()` on the training thread; `records()` runs on the exporter thread.
    """

    __slots__ = ("step_fields", "values", "event", "scalars", "sections")

    def __init__(
        self,
        step_fields: dict[str, Any],
        values: torch.Tensor | None,
        event: Any,
        scalars: list[str],
        sections: list[tuple[int, int, Decoder]],
    ) -> None:
        self.step_fields = step_fields  # step_record() arguments known on the host
        self.values = values
        self.event = event  # recorded after the copy (CUDA) or the step's work (another accelerator), or None
        self.scalars = scalars  # step_record() arguments at values[0], values[1], ...
        self.sections = sections  # (start, end, decoder) of the monitors' vectors

    def records(self) -> list[JsonObject]:
        fields = self.step_fields
        if self.values is None:
            return [step_record(**_counts_as_int(fields))]
        if self.event is not None:
            self.event.synchronize()  # waits in the exporter thread, not in training
        values = self.values if self.values.device.type == "cpu" else self.values.to("cpu")
        vals = values.tolist()
        for i, name in enumerate(self.scalars):
            fields[name] = vals[i]
        out = [step_record(**_counts_as_int(fields))]
        for start, end, decode in self.sections:
            out.extend(decode(fields["step"], vals[start:end]))
        return out


def _counts_as_int(fields: dict[str, Any]) -> dict[str, Any]:
    """`tokens` read back from a tensor is a float (the stack is float32; a float mask's sum is one
    on the host too): the wire's count is an integer. A non-finite count is not one: left out."""
    tokens = fields.get("tokens")
    if isinstance(tokens, float):
        if math.isfinite(tokens):
            fields["tokens"] = round(tokens)
        else:
            del fields["tokens"]
    return fields


class DeviceStack:
    """The device values of one step, gathered for a single copy to the host.

    Usage (on the training thread, once per step)::

        stack = DeviceStack()
        stack.add_scalar("loss", loss)                 # a tensor: read back by the exporter
        stack.add(grad_vector, tracker.records)        # a vector and its decoder
        exporter.emit(stack.sample(step_fields))       # one cat, one non-blocking copy
    """

    __slots__ = ("_names", "_scalars", "_host", "_vectors", "_decoders")

    def __init__(self) -> None:
        self._names: list[str] = []
        self._scalars: list[torch.Tensor] = []
        self._host: dict[str, float] = {}  # CPU scalars, read at once
        self._vectors: list[torch.Tensor] = []
        self._decoders: list[Decoder] = []

    def add_scalar(self, name: str, value: torch.Tensor) -> bool:
        """A step field that is a one-element tensor; False, and nothing added, for any other size
        (a per-sample loss, an attention mask: no element of it is the step's value)."""
        if value.numel() != 1:
            return False
        if value.device.type == "cpu" and getattr(value, "to_local", None) is None:
            self._host[name] = value.item()  # a read that waits for nothing on CPU (a DTensor's could)
            return True
        if value.requires_grad:
            value = value.detach()
        # A one-element view: sample() concatenates it with the vectors, no stack of the scalars.
        value = value.reshape(1)
        if self._scalars and value.device != self._scalars[0].device:
            value = value.to(self._scalars[0].device, non_blocking=True)
        self._names.append(name)
        self._scalars.append(value)
        return True

    def add(self, vector: torch.Tensor, decode: Decoder) -> None:
        """A monitor's flat vector (another dtype than float32 is converted by sample()) and the
        decoder that turns its host values into records."""
        self._vectors.append(vector)
        self._decoders.append(decode)

    def sample(self, step_fields: dict[str, Any]) -> StepSample:
        """The step's sample, its device values copied to the host without waiting for them."""
        # Every torch op here runs with cold caches (the optimizer has just streamed through the
        # parameters): ~5-20 us each on CPU, so as few as possible: one cat for everything (the
        # scalars are one-element views; cat promotes mixed dtypes), one copy.
        step_fields.update(self._host)
        parts: list[torch.Tensor] = list(self._scalars)
        sections: list[tuple[int, int, Decoder]] = []
        offset = len(self._scalars)
        for vector, decode in zip(self._vectors, self._decoders, strict=True):
            if parts and vector.device != parts[0].device:
                vector = vector.to(parts[0].device, non_blocking=True)
            parts.append(vector)
            sections.append((offset, offset + vector.numel(), decode))
            offset += vector.numel()
        if not parts:
            return StepSample(step_fields, None, None, [], [])
        # One small device tensor, one non-blocking copy to the host. Sync point: none here; the
        # exporter thread waits on the event.
        # A copy whenever a scalar is in it: the job may reuse its loss tensor in place.
        stacked = torch.cat(parts) if len(parts) > 1 or self._scalars else parts[0]
        if stacked.dtype != torch.float32:  # e.g. a bf16 or float64 loss: the wire's values are float32
            stacked = stacked.float()
        event = None
        kind = stacked.device.type
        if kind == "cuda":
            values = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            values.copy_(stacked, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        elif kind == "cpu":
            values = stacked
        else:
            # Another accelerator (XPU, HPU, MPS, ...): a copy to the host here would wait for the
            # device on the training thread. The values stay on the device (a fresh tensor: cat,
            # or a monitor's vector made this step); the exporter thread waits for the point marked
            # on the job's current stream, then copies.
            values, event = stacked, _marked(stacked.device)
        return StepSample(step_fields, values, event, self._names, sections)


_NO_EVENTS: set[str] = set()  # device types whose backend refused an event: not tried again


def _marked(device: torch.device) -> Any:
    """An event recorded on the device's current stream, or None where the backend has no events
    (then the exporter's copy waits for the device's default stream alone)."""
    if device.type in _NO_EVENTS:
        return None
    try:
        event = torch.Event(device=device)
        event.record(torch.accelerator.current_stream(device))
    except Exception:  # noqa: BLE001 - any backend's refusal: the exporter's copy still waits
        _NO_EVENTS.add(device.type)
        return None
    return event
