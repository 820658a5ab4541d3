"""The agent object a training script holds: `attach()` builds it, `step()` is called once per
optimizer step, `close()` (or interpreter exit) flushes and removes every hook."""

from __future__ import annotations

import atexit
import functools
import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, cast

import pydantic
import torch
import torch.distributed as dist
from torch import nn

from trainvitals.agent import _attached, _sigterm
from trainvitals.agent._arguments import AttachError, check_arguments, check_run_id, check_token, one_line
from trainvitals.agent._checkpoint_ledger import CheckpointLedger, ledger_path
from trainvitals.agent._checkpoints import CheckpointHandle, CheckpointRecorder, StrPath
from trainvitals.agent._config import AgentConfig, disabled_by_env
from trainvitals.agent._counts import PLAIN, HostCounts, host_counts, not_one_element, step_number
from trainvitals.agent._delivery import spooling_exporter
from trainvitals.agent._dist import RankInfo, RunId, default_run_id, process_group_exists, rank_info
from trainvitals.agent._events import fit_event
from trainvitals.agent._fp8_cadence import Fp8Cadence
from trainvitals.agent._fp8_monitor import Fp8Monitor
from trainvitals.agent._grad_norms import GradNorms, GradNormTracker
from trainvitals.agent._guard import ErrorBudget, guarded, logger, warn_once
from trainvitals.agent._model_facts import BackwardShares, derive_into
from trainvitals.agent._optimizer import hookable_optimizer, unhookable_notice
from trainvitals.agent._position import FLOPS_CONVENTION, Position, flops_per_token, model_parallel_share, position_of
from trainvitals.agent._protocol import TrainingAgent
from trainvitals.agent._refusals import without_absent_later_fields
from trainvitals.agent._sample import DeviceStack
from trainvitals.agent._timing import StepTimer
from trainvitals.agent._transport import Transport
from trainvitals.wire import Fp8Recipe, RunRegistration, event_record
from trainvitals.wire.conventions import EventKind


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
        self._exporter = spooling_exporter(
            config=config,
            run=run,
            rank=info.rank,
            incarnation=self.incarnation,
            registration=registration,
            transport=transport,
            errors=self._errors,
        )
        # Without an optimizer too: agent.clip_grad_norm_() and grads_ready() measure through it
        # (until 2026-11-29 attach(model) alone measured no gradient norm, in silence).
        self._grads = (
            GradNormTracker(model, groups=config.grad_groups, ownership=config.grad_ownership)
            if model is not None
            else None
        )
        self._pending_grads: GradNorms | None = None
        self._said: set[tuple[str, str]] = set()  # step() arguments of a kind it left out, said once
        self._hooks: list[Any] = []
        # Whether the optimizer stepped since the last step(): a loss scaler (torch.amp.GradScaler)
        # skips optimizer.step() on inf/NaN gradients, and such a step is reported as skipped, not
        # as a divergence. None: no optimizer watched, nothing is said.
        self._optimizer_stepped: bool | None = None
        hooked = hookable_optimizer(optimizer)  # under accelerate's or DeepSpeed's wrapper, too
        if model is not None and hooked is None:
            logger.warning("trainvitals agent: %s", unhookable_notice(optimizer))
        if hooked is not None and self._grads is not None:
            self._hooks.append(hooked.register_step_pre_hook(self._before_optimizer_step))
            self._optimizer_stepped = False
        parallelism = registration.get("parallelism", {})
        self.position: Position = position_of(info.rank, parallelism)
        # Frozen parameters cost no weight gradients: FLOPs per token follow what trains
        # (agent/_position.py), counted again when the set of gradients changes (an unfreeze).
        self._model_dims: dict[str, Any] = registration.get("model", {})
        self._flops_share = model_parallel_share(parallelism)  # this rank's part of the batch's FLOPs
        self._flops_per_token = flops_per_token(self._model_dims, share=self._flops_share)
        self._backward = BackwardShares(model, parallelism)
        self._shares = (1.0, 1.0)
        self._counted_grads: tuple[int, ...] | None = None
        self._timer = StepTimer(model, time_collectives=config.time_collectives)
        self._fp8 = self._make_fp8_monitors(model, registration.get("fp8", {}))
        # The shadow monitor (hooks on sampled steps only) and how often it samples.
        self._fp8_shadow = next((m for m in self._fp8 if m.shadow), None)
        cadence = Fp8Cadence(self._fp8_shadow.every, config.fp8_cost_budget) if self._fp8_shadow is not None else None
        self._fp8_cadence = cadence if cadence is not None and not cadence.decided else None  # None once decided
        self._checkpoints = CheckpointRecorder(
            self._exporter.emit,
            checksum=config.checksum,
            on_error=self._errors.record,
            said=self._said,
            watch_files=info.rank == 0,  # deleted generations: rank 0 checks (agent/_checkpoints.py)
            incarnation=self.incarnation,
            ledger=CheckpointLedger(ledger_path(str(config.spill_dir), run)),
        )
        self._step = 0
        self._last_step_end = time.perf_counter()
        self._closed = False
        # What step() says once when called after close(): a later attach() closes this agent too.
        self._after_close = "step() after close(): not recorded; attach() again"
        # attach() before init_process_group read the rank from the environment, or took 0 of 1 where
        # the launcher sets none (mp.spawn): the first step() (or close()) holds it against the process
        # group. A rank taken that way delivers nothing until then, as no rank is known yet.
        self._rank_unconfirmed = info.source != "process group"
        if info.source == "assumed":
            self._exporter.hold()
        self._exporter.start()
        self.event(
            "start",
            detail=f"host={info.hostname} restart_count={info.restart_count}",
            domains={"host": info.hostname},  # the collector labels the slowest ranks with it
        )
        self._count_flops()
        # atexit holds the agent until close(): a job attaches inside main() and most leave it by
        # a return, sys.exit or SIGTERM's SystemExit, which drop its last reference before atexit
        # runs; a weak reference there lost every record of the last send interval.
        self._held_for_exit: list[Agent] = [self]
        held = self._held_for_exit

        def close_at_exit() -> None:
            if held:
                # A SIGTERM held through this exit pass is raised at its end as SystemExit: here
                # the process is ending already, with its own status, and atexit would only print
                # that SystemExit as an ignored exception in every rank's log.
                with suppress(SystemExit):
                    held[0].close()

        atexit.register(close_at_exit)
        if config.exit_on_sigterm:
            _sigterm.install()

    def _make_fp8_monitors(self, model: nn.Module | None, recipe: dict[str, Any]) -> list[Fp8Monitor]:
        """Up to two monitors, each with its own cadence: modules that train through an FP8 recipe
        are read from the recipe every step (the recipe computed the amax already: a few small
        reads), bf16/fp32 modules get shadow hooks every `fp8_every_steps` steps (an amax pass
        over every input, weight and grad_output: the one FP8 cost that scales with activations)."""
        cfg = self.config
        if model is None or cfg.fp8 == "off":
            return []
        if cfg.fp8_ranks == "dp0" and (self.position.dp_rank or 0) != 0:
            return []  # replica 0 holds every shard once; the others would repeat it
        if cfg.fp8_ranks == "dp0" and self.position.dp_rank is None and self.rank != 0:
            return []  # layout unknown: plain data parallelism is the safe assumption
        # The registration's recipe, its defaults the wire's (one place for L, margin, formats).
        fp8 = Fp8Recipe.model_validate(recipe)
        make = functools.partial(
            Fp8Monitor,
            model,
            history_len=fp8.history_len,
            margin=fp8.margin,
            amax_algo=fp8.amax_algo,
            formats={"input": fp8.input_format, "weight": fp8.weight_format, "grad_output": fp8.grad_format},
            module_filter=cfg.fp8_module_filter,
            expensive_every=cfg.fp8_expensive_every_steps,
            errors=self._errors,
        )
        monitors: list[Fp8Monitor] = []
        try:
            skip: frozenset[int] = frozenset()
            if cfg.fp8 in ("auto", "recipe"):
                reader = make(mode="recipe")
                skip = reader.recipe_modules
                monitors.append(reader)  # every step: set_every(1) is the monitor's default
            if cfg.fp8 in ("auto", "shadow"):
                shadow = make(mode="shadow", skip_modules=skip)
                shadow.set_every(cfg.fp8_every_steps)
                monitors.append(shadow)
        except Exception as exc:  # noqa: BLE001 - FP8 monitoring off, everything else keeps working
            self._errors.record("fp8 setup", exc)
            for m in monitors:
                m.close()
            return []
        kept = [m for m in monitors if m.tensors]
        for m in monitors:
            if not m.tensors:
                m.close()
        return kept

    # ------------------------------------------------------------------ hot path

    @guarded()
    def _before_optimizer_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._optimizer_stepped = True
        # Gradients are final here (DDP/FSDP reductions done) and not yet zeroed -- unless the
        # loop computes them inside optimizer.step(closure); then grads_ready() has run already.
        if self._pending_grads is None and self._grads is not None:
            self._pending_grads = self._grads.compute()

    @guarded()
    def grads_ready(self, *, loss_scale: torch.Tensor | None = None) -> None:
        """Measure gradient norms now. Call it where gradients are final when that is not at
        optimizer.step() entry: closure-based optimizers (LBFGS, Lightning), or before clipping to
        report pre-clip group norms. The optimizer hook then does not measure again this step.

        loss_scale: the gradients still hold a loss scaler's factor (fp16 with an optimizer that
        unscales inside its own step, e.g. a fused Adam): the scaler's scale tensor
        (`GradScaler._scale`). The norms are divided by it on the device: no sync."""
        if self._grads is None:
            return
        grads = self._grads.compute()
        if grads is not None and loss_scale is not None:
            # float32 first: a scaled fp16 norm may already be past fp16's range.
            grads = GradNorms(grads.norms.float() / loss_scale.to(grads.norms.device), grads.decode)
        self._pending_grads = grads

    def clip_grad_norm_(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_`, same arguments and result, that also measures this
        step's (pre-clip) group norms from the same per-parameter norms: one pass over the
        gradients instead of two. Exactly torch's total norm and clipping; where the shared pass
        cannot give torch's answer (another norm type, DTensor gradients whose total needs the
        job's collective, parameters other than the monitored ones) it measures as grads_ready()
        does and clips with torch's own function. An agent error falls back the same way: the
        job's clipping always happens, and only torch's own errors reach the job.
        """
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        total: torch.Tensor | None = None
        if norm_type == 2.0 and self._grads is not None and not self._closed:
            try:
                shared = self._grads.compute_with_total(params)
                if shared is not None:
                    self._pending_grads, total = shared
            except Exception as exc:  # noqa: BLE001 - fall back to torch's clipping below
                self._errors.record("clip_grad_norm_", exc)
        # A non-finite total the job asked to be told about: torch's own clip raises torch's error
        # (the check is a device sync, in torch as here).
        if total is None or (error_if_nonfinite and not torch.isfinite(total)):
            if total is None:
                self.grads_ready()
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
        return total

    @guarded()
    def step(
        self,
        loss: torch.Tensor | float | None = None,
        *,
        tokens: int | torch.Tensor | None = None,
        flops: float | torch.Tensor | None = None,
        lr: float | torch.Tensor | None = None,
        grad_norm: torch.Tensor | float | None = None,
        step: int | None = None,
        skipped: bool | None = None,
    ) -> None:
        """Mark the end of one optimizer step. Never syncs the device, never raises, never blocks.

        loss: the step's loss (tensor or float); a tensor is copied back asynchronously.
        grad_norm: the total norm the job computed itself (e.g. clip_grad_norm_'s result), if any.
        tokens / flops: processed by this rank this step. step: set the step number explicitly
        (e.g. after a resume); by default steps count up from 0. loss, grad_norm, tokens, flops
        and lr may each be a number or a one-element tensor (tokens=attention_mask.sum()); a list
        (lr=scheduler.get_last_lr(), one per parameter group) counts as its first entry; a tensor of
        another size (a per-sample loss, the mask itself) is left out, and said once.
        skipped: the optimizer did not apply this step's update (the job's own skip, or a loss
        scaler's the agent cannot see); None: skipped when the watched optimizer did not step.
        """
        if self._closed:
            # A step after close() was dropped in silence: a loop that closed the agent per epoch,
            # or before a last phase, lost the rest of the run's records.
            warn_once(self._said, ("step", "after close"), self._after_close)
            return
        if self._rank_unconfirmed and self._stop_if_wrong_rank():
            return
        now = time.perf_counter()
        if step is not None:
            self._jump_to(self._number("step(step=...)", step, self._step, "the agent's own count goes on"))
        if self._grads is not None and self._grads.present is not self._counted_grads:
            self._counted_grads = self._grads.present  # a new set of gradients: an unfreeze?
            if self._grads.relisted and ("grads", "relisted") not in self._said:
                self._said.add(("grads", "relisted"))
                logger.info(
                    "trainvitals agent: the model's parameters were replaced after attach() (FSDP2's"
                    " fully_shard?); gradient norms and FLOPs per token follow the new ones"
                )
            self._count_flops()
        # A tensor count (tokens=attention_mask.sum()) is read back with the loss, never synced here;
        # a list or a numpy scalar becomes a number (agent/_counts.py). That conversion runs only
        # when a value is not a plain number: run on every step, it added ~6 us to agent.step() (~37).
        host_tokens, host_flops, host_lr, tensors = (
            cast(HostCounts, (tokens, flops, lr, None))  # int, float or None each: the test below
            if type(tokens) in PLAIN and type(flops) in PLAIN and type(lr) in PLAIN
            else host_counts(tokens, flops, lr, flops_per_token=self._flops_per_token, said=self._said)
        )
        fields = self._step_fields(now, tokens=host_tokens, flops=host_flops, lr=host_lr, skipped=skipped)
        stack = DeviceStack()
        for name, value in (("loss", loss), ("grad_norm", grad_norm)):
            if isinstance(value, torch.Tensor):
                # read back by the exporter thread, no sync here
                if not stack.add_scalar(name, value):
                    not_one_element(name, value, self._said)
            elif value is not None:
                fields[name] = float(value)
        if tensors:
            for name, tensor in tensors.items():
                stack.add_scalar(name, tensor)  # one element each: host_counts() left out the others
        self._stack_monitors(stack)
        self._exporter.emit(stack.sample(fields))
        self._step += 1
        if self._fp8_cadence is not None:
            self._decide_fp8_cadence(fields["step_seconds"])
        for fp8 in self._fp8:
            # Registers the monitor's module hooks for a sampled step, removes them for the others:
            # off-cadence steps cost the FP8 monitor nothing, not even hook dispatch.
            fp8.observing = self._step % fp8.every == 0

    def _decide_fp8_cadence(self, step_seconds: float) -> None:
        shadow, cadence = self._fp8_shadow, self._fp8_cadence
        assert shadow is not None and cadence is not None
        base = shadow.every
        every = cadence.note(step_seconds, shadow.observing, shadow.spent)
        shadow.spent = 0.0
        if every is not None:
            shadow.set_every(every)
            logger.warning("trainvitals agent: %s", cadence.notice(base))
        if cadence.decided:
            self._fp8_cadence = None  # the ordinary step tests one attribute from here on

    def _stop_if_wrong_rank(self) -> bool:
        """Stop the agent, say why and return True when the process group puts this process at another
        rank or world size than attach() assumed: its records would mix with another rank's (every
        mp.spawn process took itself for rank 0 of 1), so none of them is delivered. Else the
        rank holds (or no process group came: one process) and delivery goes ahead."""
        self._rank_unconfirmed = False
        if not process_group_exists():
            self._exporter.release()
            return False
        rank, world = dist.get_rank(), dist.get_world_size()
        if (rank, world) == (self.rank, self.info.world_size):
            self._exporter.release()
            return False
        logger.error(
            "trainvitals agent disabled on rank %d of %d: attach() ran before "
            "torch.distributed.init_process_group and took this process for rank %d of %d; "
            "call attach() after init_process_group",
            rank,
            world,
            self.rank,
            self.info.world_size,
        )
        self._said.add(("step", "after close"))  # the line above says why steps go unrecorded
        self._release()
        self._exporter.abandon()
        return True

    def _number(self, where: str, value: Any, default: int, instead: str) -> int:
        """A step or generation number the job passed (`step_number`), else `default`: silently
        for None, said once with `instead` for a value that is no step number."""
        if value is None:
            return default
        if type(value) is int and value >= 0:
            return value
        number = step_number(where, value, instead, self._said)
        return default if number is None else number

    def _count_flops(self) -> None:
        """FLOPs per token for the parameters that train now. A change is said as a note event by
        rank 0 (every rank counts the same), so that a step in the run's MFU has its reason beside it."""
        shares = self._backward.read() or (1.0, 1.0)
        if shares == self._shares:
            return
        self._shares = shares
        self._flops_per_token = flops_per_token(
            self._model_dims, trained=shares[0], reach=shares[1], share=self._flops_share
        )
        full = flops_per_token(self._model_dims, share=self._flops_share)
        if self._flops_per_token is not None and full and self.rank == 0:
            self.event(
                "note",
                detail=f"FLOPs per token {self._flops_per_token:.4g}, {self._flops_per_token / full:.0%} of full"
                f" training's 6N+12LHQT: {shares[0]:.2%} of the non-embedding parameters trained, backward"
                f" through {shares[1]:.1%} of them",
            )

    def _jump_to(self, step: int) -> None:
        if step < self._step:
            self.event("resume", step=step, detail=f"step counter went from {self._step} down to {step}")
        self._step = step

    def _step_fields(
        self, now: float, *, tokens: float | None, flops: float | None, lr: float | None, skipped: bool | None
    ) -> dict[str, Any]:
        """The step record's host-side fields (step_record() arguments): the step's time and where
        it went, the work done, the rank's place in the layout. Plain floats, no device values."""
        data_s, wait_s = self._timer.end_step(now)
        step_s = now - self._last_step_end
        self._last_step_end = now
        fields: dict[str, Any] = {"step": self._step, "ts": time.time(), "step_seconds": step_s}
        if self._optimizer_stepped is not None:
            if skipped is None:
                skipped = not self._optimizer_stepped
            self._optimizer_stepped = False
        if skipped:
            fields["skipped"] = True
        if data_s is not None:
            fields["data_seconds"] = data_s
        if wait_s is not None:
            fields["wait_seconds"] = min(wait_s, step_s)
        if data_s is not None or wait_s is not None:
            fields["compute_seconds"] = max(0.0, step_s - (data_s or 0.0) - (wait_s or 0.0))
        if flops is None and tokens is not None and self._flops_per_token is not None:
            flops = tokens * self._flops_per_token
        pos = self.position
        for key, value in (
            ("tokens", tokens),
            ("flops", flops),
            ("lr", lr),
            ("pp_stage", pos.pp_stage),
            ("tp_rank", pos.tp_rank),
            ("dp_rank", pos.dp_rank),
        ):
            if value is not None:
                fields[key] = value
        return fields

    def _stack_monitors(self, stack: DeviceStack) -> None:
        """This step's gradient and FP8 vectors (device tensors, no sync) into the step's stack."""
        grads, self._pending_grads = self._pending_grads, None
        if grads is not None:
            stack.add(grads.norms, grads.decode)
        for fp8 in self._fp8:
            # `observing` was decided at the end of the previous step() from the predicted step number;
            # if the job jumped (step=, loaded()), what the hooks measured is still this step's.
            if fp8.observing:
                fp8_vec, expensive = fp8.end_step()
                if fp8_vec is not None:
                    stack.add(fp8_vec, functools.partial(fp8.records, expensive=expensive))

    # ------------------------------------------------------------------ events and lifecycle

    @guarded()
    def event(
        self,
        kind: EventKind,
        *,
        detail: str | None = None,
        step: int | None = None,
        domains: dict[str, str] | None = None,
    ) -> None:
        """Record a run event: failure, restart, resume, phase_change, rollback, note ... Another
        kind is sent as a note, a detail past 4,096 characters keeps its end (agent/_events.py)."""
        kind, detail, domains = fit_event(kind, detail, domains, self._said)
        self._exporter.emit(
            event_record(
                ts=time.time(),
                event=kind,
                step=self._number("event(step=...)", step, self._step, "the event takes the agent's step"),
                detail=detail,
                domains=domains,
            )
        )

    @contextmanager
    def checkpoint(
        self, *, step: int | None = None, path: StrPath | None = None, generation: int | None = None
    ) -> Iterator[CheckpointHandle]:
        """Record one checkpoint save around the job's own save code::

            with agent.checkpoint(step=step, path=ckpt_dir):
                torch.save(state, ckpt_dir)          # or dcp.save(...)

        An async save: ``with agent.checkpoint(step=s, path=p) as ck: ck.track(dcp.async_save(...))``;
        the stall is the time inside the block, persistence ends when the future completes. The
        job's own exception propagates (recorded as a failed generation); the agent's never does.
        Step defaults to the last one step() was called for (the update the saved state holds,
        what `loaded(step=...)` takes back); generation to the step.
        """
        step, gen = self._generation_numbers("checkpoint", step, generation)
        if self._closed:
            yield CheckpointHandle()
            return
        with self._checkpoints.saving(step=step, generation=gen, path=path) as handle:
            yield handle

    def save(self, obj: Any, path: StrPath, *, step: int | None = None, **kwargs: Any) -> None:
        """`torch.save(obj, path)` recorded as a checkpoint generation."""
        with self.checkpoint(step=step, path=path):
            torch.save(obj, path, **kwargs)

    def dcp_save(
        self, state_dict: dict[str, Any], *, checkpoint_id: StrPath, step: int | None = None, **kwargs: Any
    ) -> Any:
        """`torch.distributed.checkpoint.save` recorded as a checkpoint generation."""
        import torch.distributed.checkpoint as dcp

        with self.checkpoint(step=step, path=checkpoint_id):
            return dcp.save(state_dict, checkpoint_id=checkpoint_id, **kwargs)

    def dcp_async_save(
        self, state_dict: dict[str, Any], *, checkpoint_id: StrPath, step: int | None = None, **kwargs: Any
    ) -> Any:
        """`torch.distributed.checkpoint.async_save`, stall and persistence recorded; returns the future."""
        import torch.distributed.checkpoint as dcp

        with self.checkpoint(step=step, path=checkpoint_id) as ck:
            return ck.track(dcp.async_save(state_dict, checkpoint_id=checkpoint_id, **kwargs))

    @guarded()
    def checkpoint_saved(
        self,
        *,
        step: int | None = None,
        path: StrPath | None = None,
        generation: int | None = None,
        stall_seconds: float | None = None,
    ) -> None:
        """Record a save that already happened (framework callbacks see saves after the fact);
        size and checksum are computed on the background thread."""
        step, gen = self._generation_numbers("checkpoint_saved", step, generation)
        self._checkpoints.saved(step=step, generation=gen, path=path, stall=stall_seconds)

    def _generation_numbers(self, where: str, step: Any, generation: Any) -> tuple[int, int]:
        """A save's step (by default `_saved_step()`) and generation (by default its step)."""
        step = self._number(f"{where}(step=...)", step, self._saved_step(), "the save takes the last step's number")
        return step, self._number(f"{where}(generation=...)", generation, step, "the save's step numbers it")

    def _saved_step(self) -> int:
        # The step whose update a save now holds: the last step() (0 before any). It was the next
        # step's number, so a save then loaded(step=...) skipped one: a gap in the resumed run,
        # where the crashed incarnation's record of that step stayed (newest wins only where the
        # new one writes), and a rollback that passed over a clean save made right before an onset.
        return max(self._step - 1, 0)

    @guarded()
    def loaded(self, *, step: int, path: StrPath | None = None, generation: int | None = None) -> None:
        """Record a resume from a checkpoint; the next step() continues from `step` + 1."""
        number = step_number("loaded(step=...)", step, "the resume is not recorded", self._said)
        if number is None:
            return
        gen = self._number("loaded(generation=...)", generation, number, "its step numbers it")
        detail = f"loaded generation {gen}" + (f" from {path}" if path else "")
        self.event("resume", step=number, detail=detail)
        self._step = number + 1

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
        if self._closed or (self._rank_unconfirmed and self._stop_if_wrong_rank()):
            return
        with _sigterm.exit_pass():  # a SIGTERM from here on waits for the delivery (agent/_sigterm.py)
            self.event("stop", detail=f"after {self._step} steps")
            self._release()
            timeout = self.config.flush_timeout_s if timeout is None else timeout
            try:
                self._checkpoints.close(timeout / 2)
                self._exporter.shutdown(timeout)
            except Exception as exc:  # noqa: BLE001
                self._errors.record("close", exc)

    def _replaced(self) -> None:
        """Closed by a later attach() of the same model or run: a step() on this agent then names
        the agent to use, not "attach() again" (which is what the job just did)."""
        self._after_close = "this agent was replaced by a later attach(); use the agent it returned"
        self.close()

    def _release(self) -> None:
        """Closed: every hook removed, nothing left for atexit (the agent can be collected)."""
        self._closed = True
        self._held_for_exit.clear()
        _attached.forget(self)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._timer.close()
        for fp8 in self._fp8:
            fp8.close()

    def stats(self) -> dict[str, int]:
        """Counters: agent errors, steps, records emitted / delivered (acknowledged by the
        collector) / dropped (lost for good: in all, and `dropped_<reason>` by reason), batches
        delivered / rejected (set aside), failed delivery attempts; the shadow FP8 cadence in steps."""
        s = self._exporter.stats
        return {
            "errors": self._errors.errors,
            "steps": self._step,
            "emitted_records": s.emitted_records,
            "dropped_records": s.dropped_records,
            **{f"dropped_{reason}": n for reason, n in s.dropped.items()},
            "delivered_batches": s.delivered_batches,
            "delivered_records": s.delivered_records,
            "failed_attempts": s.failed_attempts,
            "rejected_batches": s.rejected_batches,
            **({"fp8_every_steps": self._fp8_shadow.every} if self._fp8_shadow is not None else {}),
        }

    @property
    def hooks(self) -> int:
        """Hooks this agent has installed and not yet removed (0 after close)."""
        return len(self._hooks) + self._timer.hooks + sum(m.hooks for m in self._fp8)

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NoopAgent:
    """What attach() returns when disabled: the same methods, doing nothing, costing nothing (the
    save helpers still save: they are the job's own saves).

    Usage::

        agent = NoopAgent()
        agent.step(loss=loss)    # returns at once
    """

    hooks = 0

    def step(
        self,
        loss: torch.Tensor | float | None = None,
        *,
        tokens: int | torch.Tensor | None = None,
        flops: float | torch.Tensor | None = None,
        lr: float | torch.Tensor | None = None,
        grad_norm: torch.Tensor | float | None = None,
        step: int | None = None,
        skipped: bool | None = None,
    ) -> None:
        return None

    def event(
        self,
        kind: EventKind,
        *,
        detail: str | None = None,
        step: int | None = None,
        domains: dict[str, str] | None = None,
    ) -> None:
        return None

    def grads_ready(self, *, loss_scale: torch.Tensor | None = None) -> None:
        return None

    def clip_grad_norm_(
        self,
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)

    @contextmanager
    def checkpoint(
        self, *, step: int | None = None, path: StrPath | None = None, generation: int | None = None
    ) -> Iterator[CheckpointHandle]:
        yield CheckpointHandle()

    def save(self, obj: Any, path: StrPath, *, step: int | None = None, **kwargs: Any) -> None:
        torch.save(obj, path, **kwargs)

    def dcp_save(
        self, state_dict: dict[str, Any], *, checkpoint_id: StrPath, step: int | None = None, **kwargs: Any
    ) -> Any:
        import torch.distributed.checkpoint as dcp

        return dcp.save(state_dict, checkpoint_id=checkpoint_id, **kwargs)

    def dcp_async_save(
        self, state_dict: dict[str, Any], *, checkpoint_id: StrPath, step: int | None = None, **kwargs: Any
    ) -> Any:
        import torch.distributed.checkpoint as dcp

        return dcp.async_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)

    def checkpoint_saved(
        self,
        *,
        step: int | None = None,
        path: StrPath | None = None,
        generation: int | None = None,
        stall_seconds: float | None = None,
    ) -> None:
        return None

    def loaded(self, *, step: int, path: StrPath | None = None, generation: int | None = None) -> None:
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
    run: str | None = None,
    *,
    project: str | None = None,
    collector: str | None = None,
    config: AgentConfig | None = None,
    registration: dict[str, Any] | None = None,
    transport: Transport | None = None,
) -> TrainingAgent:
    """Attach the agent to this rank. Never raises: on a bad setup it logs and returns a NoopAgent.

    optimizer: the one that steps; a wrapper (accelerate's, DeepSpeed's) is seen through to the
    torch optimizer it holds (agent/_optimizer.py).
    run: the run id, also the third positional argument (`attach(model, opt, "run-1")`, which was
    a TypeError while it was keyword-only); None: derived (agent/_dist.py), and rank 0 says how.
    project: None takes config.project ($TRAINVITALS_PROJECT), else names none: the collector
    registers the run under the token's project ('default' with auth off).
    registration: optional parts of the wire-format run registration (keys model, parallelism,
    hardware, fp8, checkpoint, flops_convention, tags, resume, ...); world size is filled in
    automatically, and so are the model's dims and parameter counts and the GPU's type and peak
    where the model and device tell them (agent/_model_facts.py); what is passed here wins.
    """
    if disabled_by_env():
        return NoopAgent()
    try:
        check_arguments(model, optimizer)
        config = config or AgentConfig(collector=collector)
        if collector is not None:
            config.collector = collector
        check_token(config.token)
        info = rank_info()
        chosen = RunId(run, None) if run else default_run_id(info.world_size)
        run_id = chosen.value
        check_run_id(run_id, "attach(run=...)" if run else "$TRAINVITALS_RUN or torchrun's --rdzv-id")
        body: dict[str, Any] = dict(registration or {})
        body.setdefault("parallelism", {})
        body["parallelism"] = {"world_size": info.world_size, **body["parallelism"]}
        body["tags"] = {**config.tags, **body.get("tags", {})}
        derive_into(body, model)  # what MFU needs, from the model and the device, under what body says
        body.setdefault("flops_convention", FLOPS_CONVENTION)
        if info.restart_count > 0:
            # torchrun relaunched the workers: the same job by construction, perhaps on another world
            # size (an elastic resize), which the collector would otherwise refuse as another job.
            body.setdefault("resume", True)
        project = project or body.pop("project", None) or config.project
        if project:
            body["project"] = project
        try:
            reg = RunRegistration(run=run_id, started_at=time.time(), **body).model_dump(mode="json")
            without_absent_later_fields(reg)
        except pydantic.ValidationError as exc:
            raise AttachError(one_line(exc, "registration")) from None
        if not project:
            del reg["project"]  # none named: the token's, filled in by the collector (docs/agent.md)
        for earlier in _attached.earlier_agents(run_id, info.rank, model):
            logger.warning("trainvitals agent: %s", _attached.superseded_notice(earlier))
            earlier._replaced()
        agent = Agent(
            model=model,
            optimizer=optimizer,
            run=run_id,
            registration=reg,
            config=config,
            info=info,
            transport=transport,
        )
        _attached.register(agent, model)
        if chosen.derived and info.rank == 0:
            logger.warning(
                "trainvitals agent: no run id given: this job reports as run %r, %s; name each run: "
                "attach(run=...) or TRAINVITALS_RUN",
                run_id,
                chosen.derived,
            )
        return agent
    except Exception as exc:  # noqa: BLE001 - a monitoring problem must not stop training
        logging.getLogger("trainvitals.agent").error("trainvitals agent disabled: %s", exc)
        return NoopAgent()


__all__ = ["Agent", "NoopAgent", "attach", "logger"]
