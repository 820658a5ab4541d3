"""Where a step's time goes on this rank: input wait, compute, collective wait.

- data: from the end of the previous step to the first forward call of the model (a forward
  pre-hook on the root module) -- time the input pipeline held the rank up.
- wait: time blocked on DDP's gradient all-reduce, measured by a comm hook that wraps the default
  all-reduce: the exposed tail is (last bucket done) - (last bucket launched). A slow rank launches
  its last bucket late and finds its peers already there (low wait); its victims launch early and
  wait for it (high wait). Only installed when the DDP model has no comm hook of its own.
- compute: the rest of the step.

Times are host-side (perf_counter). On GPUs without a per-step sync the host runs ahead, so a
single step's split is approximate; over a window the sums are right.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class StepTimer:
    """Usage::

    timer = StepTimer(model, time_collectives=True)
    ...
    data_s, wait_s = timer.end_step()   # at the step boundary
    timer.close()
    """

    def __init__(self, model: nn.Module | None, *, time_collectives: bool) -> None:
        self._hooks: list[Any] = []
        self._step_end = time.perf_counter()
        self._first_forward: float | None = None
        self._launched = 0.0
        self._done = 0.0
        self.measures_wait = False
        if model is None:
            return
        # Not traced by torch.compile: a clock read belongs to the eager step, not to a graph.
        self._hooks.append(model.register_forward_pre_hook(torch.compiler.disable(self._on_forward)))
        if time_collectives:
            try:
                self.measures_wait = self._install_comm_hook(model)
            except Exception as exc:  # noqa: BLE001 - timing split is optional; the agent must attach
                from trainvitals.agent._guard import logger

                logger.warning("trainvitals: collective timing disabled: %r", exc)

    def _on_forward(self, _module: nn.Module, _args: Any) -> None:
        if self._first_forward is None:
            self._first_forward = time.perf_counter()

    def _install_comm_hook(self, model: nn.Module) -> bool:
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel) or getattr(model, "_comm_hooks", None):
            return False  # not DDP, or the job brought its own hook (DDP allows only one)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        # The hook that communicates, and its state: DDP's default all-reduce until the job
        # registers its own (PowerSGD, bf16 compression) after attach(), which then runs, timed.
        # DDP takes one comm hook per model and cannot drop one: the job's registration raised
        # "can only be called once" into the job.
        inner: list[Any] = [allreduce_hook, None]

        # No annotations: DDP validates the hook's signature and accepts only GradBucket or none.
        def timed_allreduce(_state, bucket):
            self._launched = time.perf_counter()
            hook, state = inner
            fut = hook(state, bucket)

            def done(f):
                self._done = time.perf_counter()
                return f.value()

            return fut.then(done)

        def register_comm_hook(state: object, hook: Callable[..., Any]) -> None:
            if inner[0] is not allreduce_hook:
                raise RuntimeError("register_comm_hook can only be called once (DDP allows one comm hook)")
            model._check_comm_hook(hook)  # DDP's own signature check, as its register_comm_hook does
            inner[:] = [hook, state]

        model.register_comm_hook(None, timed_allreduce)
        model.register_comm_hook = register_comm_hook  # type: ignore[method-assign]
        return True

    def end_step(self, now: float) -> tuple[float | None, float | None]:
        """(data seconds, collective wait seconds) of the step ending at `now`."""
        data = None if self._first_forward is None else max(0.0, self._first_forward - self._step_end)
        wait = max(0.0, self._done - self._launched) if self.measures_wait and self._done else None
        self._step_end = now
        self._first_forward = None
        self._done = self._launched = 0.0
        return data, wait

    def close(self) -> None:
        # The DDP comm hook cannot be unregistered; after close it only stores two floats.
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    @property
    def hooks(self) -> int:
        return len(self._hooks)
