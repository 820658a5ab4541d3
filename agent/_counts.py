"""step()'s tokens, flops and lr as the step record takes them: numbers, or tensors read back with
the loss (never synced on the training thread); and the step numbers the job passes (`step=`).

A value of another kind once cost far more than itself: `lr=scheduler.get_last_lr()` (a list, one
learning rate per parameter group) made the collector refuse every batch of the run (422,
"step.lr: Input should be a valid number"), and a numpy count (`tokens=np.int64(...)`) could not be
encoded, which lost each step record it was in. The ordinary step (ints, floats, None) costs three
type tests here.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from trainvitals.agent._guard import warn_once
from trainvitals.wire.v1 import MAX_STEP

PLAIN = frozenset({int, float, type(None)})
"""Types step() passes through as they are; anything else goes through `host_counts`."""

HostCounts = tuple[float | None, float | None, float | None, dict[str, torch.Tensor] | None]
"""tokens, flops and lr as numbers (tokens an int, or a float rounded when encoded), and those
that were tensors by step-record field."""


def _as_count(name: str, value: Any, said: set[tuple[str, str]]) -> int | float | torch.Tensor | None:
    """`value` as a number or a tensor: a numpy scalar as the Python number, a list or tuple (a
    scheduler's get_last_lr(), one entry per parameter group) as its first entry. Anything else,
    a tensor of another size than one element too, is left out of the step record, with one
    warning per field and type (kept in `said`, the agent's) that names the fix."""
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        not_one_element(name, value, said)
        return None
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    kind = type(value).__name__
    hint = " (a scheduler's: scheduler.get_last_lr()[0])" if name == "lr" else ""
    warn_once(said, (name, kind), f"step({name}=...) got a {kind}, not a number: left out of the step records; "
              f"pass a number or a one-element tensor{hint}")  # fmt: skip
    return None


_ONE_ELEMENT_FIX = {
    "loss": "the step's loss as one number (loss.mean() of a per-sample loss)",
    "grad_norm": "the total norm (clip_grad_norm_'s result)",
    "tokens": "a count (attention_mask.sum() or input_ids.numel())",
    "flops": "a count",
    "lr": "one learning rate (scheduler.get_last_lr()[0])",
}


def not_one_element(name: str, value: torch.Tensor, said: set[tuple[str, str]]) -> None:
    """Say once per field that a tensor of another size than one element was left out: its first
    element, taken until 2026-11-29, made a mask's count 1 token and a per-sample loss one sample's."""
    warn_once(said, (name, "tensor size"), f"step({name}=...) got a tensor of {value.numel()} elements, not one: "
              f"left out of the step records; pass {_ONE_ELEMENT_FIX[name]}")  # fmt: skip


def _split_tensors(
    tokens: int | float | torch.Tensor | None,
    flops: int | float | torch.Tensor | None,
    lr: int | float | torch.Tensor | None,
    flops_per_token: float | None,
) -> HostCounts:
    """step()'s counts that are numbers, and those that are tensors (by step-record field); FLOPs
    from tensor tokens are multiplied on the device, as the host multiplies a number of tokens."""
    tensors = {n: v for n, v in (("tokens", tokens), ("flops", flops), ("lr", lr)) if isinstance(v, torch.Tensor)}
    if "tokens" in tensors and flops is None and flops_per_token:
        tensors["flops"] = tensors["tokens"].detach() * flops_per_token
    return (
        None if isinstance(tokens, torch.Tensor) else tokens,
        None if isinstance(flops, torch.Tensor) else flops,
        None if isinstance(lr, torch.Tensor) else lr,
        tensors,
    )


def host_counts(
    tokens: Any, flops: Any, lr: Any, *, flops_per_token: float | None, said: set[tuple[str, str]]
) -> HostCounts:
    """step()'s tokens, flops and lr when one is not a plain number: each as a number (`_as_count`),
    and the tensors among them to be read back with the loss (`_split_tensors`)."""
    return _split_tensors(
        _as_count("tokens", tokens, said), _as_count("flops", flops, said), _as_count("lr", lr, said), flops_per_token
    )


def step_number(where: str, value: Any, instead: str, said: set[tuple[str, str]]) -> int | None:
    """A step (or generation) number the job passed, as the int the records take: an int, a numpy
    integer, or a float or a one-element CPU tensor holding a whole number (an optimizer's
    state['step'] is one). None for anything else, said once per entry point with `instead` (what
    the agent does without it): a tensor or a numpy step once reached the JSON encoder and cost
    every record of its send interval, a negative one made the collector refuse the batch. A device
    tensor is not read: that read would wait for the device."""
    number: Any = value
    if isinstance(value, torch.Tensor):
        readable = value.numel() == 1 and value.device.type == "cpu" and getattr(value, "to_local", None) is None
        number = value.item() if readable else None
        size = "" if value.numel() == 1 else f" of {value.numel()} elements"
        what = f"a tensor holding {number!r}" if readable else f"a {value.device.type} tensor{size}"
    else:
        what = repr(value)[:40]
    if isinstance(number, numbers.Real) and not isinstance(number, bool):
        real = float(number)
        if real.is_integer() and 0 <= real <= MAX_STEP:
            return int(real)
    warn_once(said, (where, "step number"), f"{where} got {what}, not a step number: {instead}; "
              "pass a non-negative int (a CPU tensor or numpy integer is read as one)")  # fmt: skip
    return None
