"""The agent object a training script holds: `attach()` builds it, `step()` is called once per
optimizer step, `close()` (or interpreter exit) flushes and removes every hook."""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from typing import Any

import torch
from torch import nn
from trainvitals.agent._config import AgentConfig, disabled_by_env
from trainvitals.agent._dist import RankInfo, default_run_id, rank_info
from trainvitals.agent._exporter import Exporter, Transport
from trainvitals.agent._grad_norms import GradNormTracker
from trainvitals.agent._guard import ErrorBudget, guarded, logger


class _StepSample:
    """One step's scalars, still possibly in flight from the device.

    The training thread only stacks device scalars into one tensor and starts one non-blocking
    device-to-host copy; the exporter thread waits for the copy (never the training thread) and
    expands the vector into wire records. This keeps the hot path free of syncs and of Python
    objects per parameter group.
    """

    __slots__ = ("step_fields", "values", "event", "scalar_fields", "grads", "grad_at")

    def __init__(
        self,
        step_fields: dict[str, Any],
        values: torch.Tensor | None,
        event: Any,
        scalar_fields: tuple[str, ...],
        grads: GradNormTracker | None,
        grad_at: int | None,
    ) -> None:
        self.step_fields = step_fields
        self.values = values
        self.event = event
        self.scalar_fields = scalar_fields  # step fields stored at values[0], values[1], ...
        self.grads = grads
        self.grad_at = grad_at

    def records(self) -> list[dict[str, Any]]:
        step = self.step_fields
        if self.values is None:
            return [step]
        if self.event is not None:
            self.event.synchronize()  # waits in the exporter thread, not in training
        vals = self.values.tolist()
        for i, name in enumerate(self.scalar_fields):
            step[name] = vals[i]
        out = [step]
        if self.grads is not None and self.grad_at is not None:
            out.extend(self.grads.records(step["step"], vals[self.grad_at :]))
        return out


class Agent:
    """Per-rank training-health agent.

    Usage::

        agent = trainvitals.agent.attach(model, optimizer, run="gpt-7b-0412")
        for batch in loader:
            loss = model(batch).loss
            loss.backward(); optimizer.step(); optimizer.zero_grad()
            agent.step(loss=loss, tokens=batch.numel())
        agent.close()   # also runs at interpreter exit
    """

    def __init__(
        self,
        *,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        run: str,
        registration: dict[str, Any],
        config: AgentConfig,
        info: RankInfo,
        transport: Transport | None = None,
    ) -> None:
        self.config = config
        self.run = run
        self.rank = info.rank
        self.info = info
        # Milliseconds since the epoch: unique per restart of this rank even when a job is relaunched
        # by hand (torchrun's restart count starts at 0 again), and ordered so "newest wins" works.
        self.incarnation = int(time.time() * 1000)
        self._errors = ErrorBudget(config.log_every_s)
        self._exporter = Exporter(
            config=config,
            run=run,
            rank=info.rank,
            incarnation=self.incarnation,
            registration=registration,
            transport=transport,
            errors=self._errors,
        )
        self._grads = (
            GradNormTracker(model, groups=config.grad_groups, ownership=config.grad_ownership)
            if model is not None and optimizer is not None
            else None
        )
        self._pending_grads: torch.Tensor | None = None
        self._hooks: list[Any] = []
        if optimizer is not None and self._grads is not None:
            self._hooks.append(optimizer.register_step_pre_hook(self._before_optimizer_step))
        self._step = 0
        self._last_step_end = time.perf_counter()
        self._closed = False
        self._exporter.start()
        self.event("start", detail=f"host={info.hostname} restart_count={info.restart_count}")
        ref = weakref.ref(self)
        atexit.register(lambda: (a := ref()) is not None and a.close())

    # ------------------------------------------------------------------ hot path

    @guarded()
    def _before_optimizer_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        # Gradients are final here (DDP/FSDP reductions done) and not yet zeroed.
        assert self._grads is not None
        self._pending_grads = self._grads.compute()

    @guarded()
    def step(
        self,
        loss: torch.Tensor | float | None = None,
        *,
        tokens: int | None = None,
        flops: float | None = None,
        lr: float | None = None,
        grad_norm: torch.Tensor | float | None = None,
        step: int | None = None,
    ) -> None:
        """Mark the end of one optimizer step. Never syncs the device, never raises, never blocks.

        loss: the step's loss (tensor or float); a tensor is copied back asynchronously.
        grad_norm: the total norm the job computed itself (e.g. clip_grad_norm_'s result), if any.
        tokens / flops: processed by this rank this step. step: set the step number explicitly
        (e.g. after a resume); by default steps count up from 0.
        """
        if self._closed:
            return
        now = time.perf_counter()
        if step is not None:
            if step < self._step:
                self.event("resume", step=step, detail=f"step counter went from {self._step} down to {step}")
            self._step = step
        fields: dict[str, Any] = {
            "kind": "step",
            "step": self._step,
            "ts": time.time(),
            "step_seconds": now - self._last_step_end,
        }
        self._last_step_end = now
        for key, value in (("tokens", tokens), ("flops", flops), ("lr", lr)):
            if value is not None:
                fields[key] = value
        parts: list[torch.Tensor] = []
        scalar_fields: list[str] = []
        grad_at = None
        for key, scalar in (("loss", loss), ("grad_norm", grad_norm)):
            if isinstance(scalar, torch.Tensor):
                scalar_fields.append(key)
                t = scalar.detach().reshape(-1)[:1].float()
                parts.append(t.to(parts[0].device) if parts else t)
            elif scalar is not None:
                fields[key] = float(scalar)
        grads, self._pending_grads = self._pending_grads, None
        if grads is not None:
            grad_at = len(parts)
            parts.append(grads.to(parts[0].device) if parts else grads)
        values = event = None
        if parts:
            # One small device tensor, one non-blocking copy to the host. Sync point: none here;
            # the exporter thread waits on the event.
            stacked = torch.cat(parts) if len(parts) > 1 else parts[0]
            if stacked.device.type == "cuda":
                values = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
                values.copy_(stacked, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            else:
                values = stacked if stacked.device.type == "cpu" else stacked.to("cpu")
        self._exporter.emit(
            _StepSample(
                fields,
                values,
                event,
                tuple(scalar_fields),
                self._grads if grad_at is not None else None,
                grad_at,
            )
        )
        self._step += 1

    # ------------------------------------------------------------------ events and lifecycle

    @guarded()
    def event(
        self,
        kind: str,
        *,
        detail: str | None = None,
        step: int | None = None,
        domains: dict[str, str] | None = None,
    ) -> None:
        """Record a run event: failure, restart, resume, phase_change, rollback, note ..."""
        record: dict[str, Any] = {
            "kind": "event",
            "event": kind,
            "ts": time.time(),
            "step": self._step if step is None else step,
        }
        if detail is not None:
            record["detail"] = detail
        if domains:
            record["domains"] = dict(domains)
        self._exporter.emit(record)

    def flush(self, timeout: float = 10.0) -> bool:
        """Deliver everything recorded so far; True when nothing is left undelivered."""
        try:
            return self._exporter.flush(timeout)
        except Exception as exc:  # noqa: BLE001
            self._errors.record("flush", exc)
            return False

    def close(self, timeout: float | None = None) -> None:
        """Remove hooks, record the stop, deliver within `timeout` (default config.flush_timeout_s).
        Idempotent; whatever cannot be delivered in time stays in the spool for the next start."""
        if self._closed:
            return
        self.event("stop", detail=f"after {self._step} steps")
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        try:
            self._exporter.shutdown(timeout)
        except Exception as exc:  # noqa: BLE001
            self._errors.record("close", exc)

    def stats(self) -> dict[str, int]:
        s = self._exporter.stats
        return {
            "errors": self._errors.errors,
            "steps": self._step,
            "emitted_records": s.emitted_records,
            "dropped_records": s.dropped_records,
            "delivered_batches": s.delivered_batches,
            "failed_attempts": s.failed_attempts,
            "rejected_batches": s.rejected_batches,
            "spool_dropped_batches": s.spool_dropped_batches,
        }

    @property
    def hooks(self) -> int:
        return len(self._hooks)

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NoopAgent:
    """What attach() returns when disabled: same methods, does nothing, costs nothing."""

    hooks = 0

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def event(self, *args: Any, **kwargs: Any) -> None:
        return None

    def flush(self, timeout: float = 10.0) -> bool:
        return True

    def close(self, timeout: float | None = None) -> None:
        return None

    def stats(self) -> dict[str, int]:
        return {}

    def __enter__(self) -> NoopAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def attach(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    run: str | None = None,
    project: str = "default",
    collector: str | None = None,
    config: AgentConfig | None = None,
    registration: dict[str, Any] | None = None,
    transport: Transport | None = None,
) -> Agent | NoopAgent:
    """Attach the agent to this rank. Never raises: on a bad setup it logs and returns a NoopAgent.

    registration: optional parts of the wire-format run registration (keys model, parallelism,
    hardware, fp8, checkpoint, flops_convention, tags); world size is filled in automatically.
    """
    if disabled_by_env():
        return NoopAgent()
    try:
        from trainvitals.wire import RunRegistration

        config = config or AgentConfig(collector=collector)
        if collector is not None:
            config.collector = collector
        info = rank_info()
        run_id = run or default_run_id()
        body: dict[str, Any] = dict(registration or {})
        body.setdefault("parallelism", {})
        body["parallelism"] = {"world_size": info.world_size, **body["parallelism"]}
        body["tags"] = {**config.tags, **body.get("tags", {})}
        reg = RunRegistration(run=run_id, project=project, started_at=time.time(), **body)
        return Agent(
            model=model,
            optimizer=optimizer,
            run=run_id,
            registration=reg.model_dump(mode="json"),
            config=config,
            info=info,
            transport=transport,
        )
    except Exception as exc:  # noqa: BLE001 - a monitoring problem must not stop training
        logging.getLogger("trainvitals.agent").error("trainvitals agent disabled: %s", exc)
        return NoopAgent()


__all__ = ["Agent", "NoopAgent", "attach", "logger"]
