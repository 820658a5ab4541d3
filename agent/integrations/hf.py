"""Hugging Face `transformers` Trainer integration: one callback, no changes to the training script.

Importing this module imports transformers; `trainvitals.agent` itself never does.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import re
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import transformers
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trainvitals.agent._agent import attach
from trainvitals.agent._config import AgentConfig
from trainvitals.agent._guard import ErrorBudget, guarded
from trainvitals.agent._optimizer import hookable_optimizer
from trainvitals.agent._protocol import TrainingAgent

if TYPE_CHECKING:
    from transformers import Trainer


def _current_lr(optimizer: torch.optim.Optimizer | None) -> float | None:
    if optimizer is None or not optimizer.param_groups:
        return None
    lr = optimizer.param_groups[0].get("lr")
    if isinstance(lr, torch.Tensor):
        # A tensor lr on an accelerator would need a sync to read; skip it rather than stall the step.
        return float(lr) if lr.device.type == "cpu" else None
    return float(lr) if lr is not None else None


def _calling_trainer() -> Trainer | None:
    """The Trainer whose callback handler is calling this callback, found on the call stack (a few
    frames up: Trainer, CallbackHandler.call_event, the guard): HF passes callbacks no trainer."""
    frame = inspect.currentframe()
    try:
        for _ in range(16):
            if frame is None:
                return None
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, transformers.Trainer):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame reference would keep every local of the stack alive


def _accepts(fn: Any, *names: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return all(n in params for n in names)


def _merge(auto: dict[str, Any], user: dict[str, Any] | None) -> dict[str, Any]:
    """User registration wins; nested sections (model, parallelism, tags ...) merge one level deep."""
    out = dict(auto)
    for key, value in (user or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _auto_registration(args: TrainingArguments) -> dict[str, Any]:
    """What the Trainer already knows: the batch layout. The model's dims (its HF config) and
    parameter counts attach() derives itself (agent/_model_facts.py)."""
    reg: dict[str, Any] = {
        "tags": {"framework": "transformers", "framework_version": transformers.__version__},
        "parallelism": {
            "micro_batch": args.per_device_train_batch_size,
            "global_batch": args.per_device_train_batch_size
            * args.gradient_accumulation_steps
            * max(args.world_size, 1),
        },
    }
    return reg


class TrainvitalsCallback(TrainerCallback):
    """Attaches the trainvitals agent to a `transformers.Trainer` run.

    Usage::

        from trainvitals.agent.integrations.hf import TrainvitalsCallback

        trainer = Trainer(model=model, args=args, train_dataset=ds,
                          callbacks=[TrainvitalsCallback(run="gpt2-ft-0412")])
        trainer.train()

    What it records, per optimizer step (step number = `state.global_step`, as in HF's own logs):
    lr (the one this step used), tokens (when `include_num_input_tokens_seen` is on; HF counts them
    over all ranks, so the per-rank figure is that count / world size), loss and grad_norm.

    Gradient norms, pre-clip at every step: grad_norm is the total HF's clip returns (the norm HF
    logs, taken every step as the device tensor it is, not only at logging steps), and the
    per-group norms are measured right after accelerate unscales the gradients for that clip,
    before it clips them (`Accelerator.unscale_gradients`, which accelerate calls only there; both
    wrapped on the Trainer's accelerator while attached, HF's behaviour unchanged). Until
    2026-12-04 the group norms were taken at optimizer.step, after the clip (never above
    max_grad_norm), while grad_norm came from HF's logs at logging steps only: the collector's
    series, which prefers the job's own norm, jumped from ~max_grad_norm to the pre-clip norm at
    each logged step. Where HF clips without accelerate's clip (DTensor gradients on several
    meshes, SageMaker MP) or no Trainer is found, records carry no grad_norm and the group norms
    are the optimizer step's (post-clip).

    Loss: every step's, at any logging interval: the per-step difference of the trainer's
    on-device loss accumulator (a tensor, no sync; the agent copies it asynchronously). HF hands
    callbacks the model and optimizer but not the trainer, so the callback finds the Trainer whose
    handler calls its on_train_begin (`trainer=` names it outright). Without a trainer it falls
    back to HF's logs, whose loss is the mean over the logging window: the step's loss only when
    the window is one step (`logging_steps=1`); at HF's default of 500 no step had a loss before
    2026-11-29. Both paths see what HF sees, including its `logging_nan_inf_filter` (on by
    default), which replaces non-finite losses before logging.

    Also: a `resume` event when training starts from a checkpoint, a checkpoint generation per
    `checkpoint-N` directory the Trainer saves (its stall: from the Trainer's last callback before
    the save, an evaluation excluded, to on_save; recorded deleted once `save_total_limit` removes
    it; a search trial's at its own `run-N` directory; a `checkpoint-N` the Trainer writes without
    on_save, enable_jit_checkpoint's on SIGTERM, at the end of train(), without a stall), and
    close() (flush, hooks removed) at the end of training. HF calls no callback when
    train() raises; a process that ends while train() runs (an uncaught exception, SystemExit,
    SIGTERM) records the pending step and a `failure` event at interpreter exit, before the agent's
    own exit pass delivers them.
    """

    def __init__(
        self,
        *,
        run: str | None = None,
        project: str | None = None,
        collector: str | None = None,
        config: AgentConfig | None = None,
        registration: dict[str, Any] | None = None,
        trainer: Trainer | None = None,
    ) -> None:
        self.run = run
        self.project = project
        self.collector = collector
        self.config = config
        self.registration = registration
        self.agent: TrainingAgent | None = None
        """The agent of the current (or last) train() call; kept after close for stats()."""
        self._bound = trainer
        self._trainer = trainer  # the bound one, else the one found at on_train_begin
        self._errors = ErrorBudget()
        self._attached = False
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending: dict[str, Any] | None = None
        self._lr: float | None = None
        self._tokens_seen = 0
        self._last_logged_step = 0
        self._loss_mark: torch.Tensor | None = None
        # When the Trainer's last callback before a save ended (on_step_end, on_log, on_evaluate):
        # on_save comes right after the save, so the difference is the save's stall.
        self._before_save: float | None = None
        self._job_norm: Any = None  # this step's total as HF's clip returned it (a device tensor)
        self._measured = False  # the group norms of this step were measured (pre-clip)
        self._wrapped: list[tuple[Any, str, Callable[..., Any]]] = []  # (accelerator, name, wrapper)
        self._recorded: set[str] = set()  # checkpoint directories recorded in this train(), absolute
        self._began_at = 0.0  # time.time() at on_train_begin
        self._first_step = 0  # state.global_step at on_train_begin

    # ------------------------------------------------------------------ attach / close

    def _attach(self, args: TrainingArguments, state: TrainerState, optimizer: Any) -> None:
        inner = hookable_optimizer(optimizer)  # the torch optimizer under accelerate's wrapper
        if inner is None:
            return  # created lazily by this Trainer setup: retried at the next on_step_begin
        self._optimizer = inner
        self.agent = attach(
            self._model,
            inner,
            run=self.run,
            project=self.project,
            collector=self.collector,
            config=self.config,
            registration=_merge(_auto_registration(args), self.registration),
        )
        self._attached = True
        atexit.register(self._at_exit)  # after attach()'s own: runs before the agent's exit pass
        self._wrap_clipping()
        if state.global_step > 0:
            # The Trainer restored its state from a checkpoint. Prefer the agent's own resume API
            # when this agent version has it (same `resume` event, and it knows the step counter).
            loaded = getattr(self.agent, "loaded", None)
            if loaded is not None and _accepts(loaded, "step"):
                loaded(step=state.global_step)
            else:
                self.agent.event(
                    "resume",
                    step=state.global_step,
                    detail=f"transformers Trainer resumed from a checkpoint at step {state.global_step}",
                )

    def _close(self) -> None:
        if self._attached and self.agent is not None:
            self._emit()
            self.agent.close()
        self._attached = False
        atexit.unregister(self._at_exit)
        for accelerator, name, wrapper in self._wrapped:
            if vars(accelerator).get(name) is wrapper:
                delattr(accelerator, name)  # the class's method again
        self._wrapped = []

    @guarded()
    def _at_exit(self) -> None:
        """Interpreter exit while train() runs (it raised, or SystemExit/SIGTERM ended it): HF calls
        no callback then. The pending step and a failure event go to the agent before its exit pass."""
        if self._attached and self.agent is not None:
            self._emit()
            exc = getattr(sys, "last_value", None)  # set by Python for an uncaught exception
            detail = (
                f"{type(exc).__name__}: {exc}"[:4096]
                if exc is not None
                else "the process ended during transformers Trainer.train() (no exception reached the top)"
            )
            self.agent.event("failure", detail=detail)
        self._close()

    # ------------------------------------------------------------------ gradient norms, pre-clip

    def _wrap_clipping(self) -> None:
        """Wrap the Trainer's accelerator's `unscale_gradients` (measure after it) and
        `clip_grad_norm_` (keep its result) on the instance; `_close` removes both."""
        accelerator = getattr(self._trainer, "accelerator", None)
        if accelerator is None:
            return
        for name, wrap in (("unscale_gradients", self._measuring), ("clip_grad_norm_", self._keeping)):
            original = getattr(accelerator, name, None)
            if callable(original):
                wrapper = wrap(original)
                setattr(accelerator, name, wrapper)
                self._wrapped.append((accelerator, name, wrapper))

    def _measuring(self, unscale: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(unscale)
        def unscale_gradients(*args: Any, **kwargs: Any) -> Any:
            result = unscale(*args, **kwargs)  # HF's and accelerate's errors stay theirs
            self._grads_unscaled()
            return result

        return unscale_gradients

    def _keeping(self, clip: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(clip)
        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            total = clip(*args, **kwargs)
            self._job_norm = total  # the pre-clip total, a device tensor: read back by the agent, no sync
            return total

        return clip_grad_norm_

    @guarded()
    def _grads_unscaled(self) -> None:
        # The first unscale of the step is the clip's: the gradients are final and not yet clipped.
        if self._attached and self.agent is not None and not self._measured:
            self._measured = True
            self.agent.grads_ready()  # one _foreach_norm, as the optimizer hook would have run: no sync

    # ------------------------------------------------------------------ step records

    def _emit(self) -> None:
        """Hand the pending step to the agent (called before anything that would reorder it)."""
        pending, self._pending = self._pending, None
        if pending is not None and self._attached and self.agent is not None:
            self.agent.step(**pending)

    def _tracked_loss(self) -> torch.Tensor | None:
        # The Trainer sums each step's loss into one device tensor and zeroes it in place when it
        # logs; the difference since our last snapshot is this step's loss. Two scalar device ops,
        # no sync. `_tr_loss` is private to the Trainer (transformers >= 5): absent means unsupported.
        tracked = getattr(self._trainer, "_tr_loss", None)
        if not isinstance(tracked, torch.Tensor):
            return None
        now = tracked.detach().clone()  # a copy: the accumulator keeps changing in place
        loss = now if self._loss_mark is None else now - self._loss_mark
        self._loss_mark = now
        return loss

    # ------------------------------------------------------------------ TrainerCallback hooks

    @guarded()
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # A second train() on the same Trainer (auto_find_batch_size retries, a new fit) builds a
        # new optimizer: close the old agent so its hook goes away, then attach afresh.
        self._close()
        self._trainer = self._bound or _calling_trainer()
        self._pending = None
        self._model = kwargs.get("model")
        self._tokens_seen = state.num_input_tokens_seen
        self._last_logged_step = state.global_step
        self._loss_mark = None
        self._recorded, self._began_at, self._first_step = set(), time.time(), state.global_step
        self._attach(args, state, kwargs.get("optimizer"))

    @guarded()
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._emit()
        self._job_norm, self._measured = None, False
        if not self._attached:
            self._attach(args, state, kwargs.get("optimizer"))
        # The scheduler stepped at the end of the previous step, so this is the lr this step uses
        # (the value HF logs as learning_rate for it).
        self._lr = _current_lr(self._optimizer)

    @guarded()
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not self._attached:
            return
        pending: dict[str, Any] = {"step": state.global_step, "lr": self._lr}
        seen = state.num_input_tokens_seen
        if seen > self._tokens_seen:  # stays 0 unless include_num_input_tokens_seen is on
            pending["tokens"] = round((seen - self._tokens_seen) / max(args.world_size, 1))
        self._tokens_seen = seen
        loss = self._tracked_loss()
        if loss is not None:
            pending["loss"] = loss
        if self._job_norm is not None:
            pending["grad_norm"] = self._job_norm
        self._job_norm = None
        self._pending = pending
        # DefaultFlowCallback ran before us and decided whether HF logs this step; if it does, the
        # log (loss) follows right away in on_log, before any eval or save.
        if not control.should_log:
            self._emit()
        self._before_save = time.perf_counter()

    @guarded()
    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        logs = logs or {}
        pending = self._pending
        if pending is not None and pending["step"] == state.global_step and "loss" in logs:
            if "loss" not in pending and state.global_step - self._last_logged_step == 1:
                pending["loss"] = logs["loss"]  # a one-step window: the mean is this step's loss
            # Not the logged grad_norm: every step has HF's clip's own (above), or none at all. Taken
            # at logging steps only, it mixed with the agent's post-clip norms (false spikes).
        if "loss" in logs:
            # HF zeroed its loss accumulator for this log: our snapshot restarts from zero too.
            self._last_logged_step = state.global_step
            self._loss_mark = None
        self._emit()
        self._before_save = time.perf_counter()

    @guarded()
    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._before_save = time.perf_counter()  # an evaluation before the save is not its stall

    @guarded()
    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._emit()  # the step record goes first, then the save that followed it
        if not self._attached or self.agent is None:
            return
        path = os.path.join(self._output_dir(args), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        stall = None if self._before_save is None else time.perf_counter() - self._before_save
        self._before_save = None
        self._record_save(path, state.global_step, stall)

    def _output_dir(self, args: TrainingArguments) -> str:
        """Where the Trainer saves: a hyperparameter search trial's own directory (`run-N` under
        output_dir: until 2026-12-04 its saves were recorded at output_dir/checkpoint-N, a path that
        never existed), else output_dir."""
        get = getattr(self._trainer, "_get_output_dir", None)
        if get is not None:
            try:
                return str(get(getattr(self._trainer, "_trial", None)))
            except Exception:  # noqa: BLE001 - a search backend's lookup failing: output_dir is the fallback
                pass
        return args.output_dir or "."

    def _record_save(self, path: str, step: int, stall: float | None) -> None:
        assert self.agent is not None
        self._recorded.add(os.path.abspath(path))
        record = getattr(self.agent, "checkpoint_saved", None)
        if record is not None and _accepts(record, "path", "step", "stall_seconds"):
            # The stall lets the cadence advisor weigh this run's saves (until 2026-11-29 it had none).
            record(path=path, step=step, stall_seconds=stall)
        elif record is not None and _accepts(record, "path", "step"):
            record(path=path, step=step)
        else:
            self.agent.event("note", step=step, detail=f"checkpoint saved: {path}")

    def _record_unannounced_saves(self, args: TrainingArguments, state: TrainerState) -> None:
        """Checkpoints the Trainer wrote in this train() without on_save: `enable_jit_checkpoint`'s,
        saved when SIGTERM arrives (to output_dir even in a search trial). A `checkpoint-N` with N
        in this train()'s steps, written since it began, complete (no JIT sentinel), not recorded."""
        for directory in dict.fromkeys((self._output_dir(args), args.output_dir or ".")):
            try:
                names = sorted(os.listdir(directory))
            except OSError:
                continue
            for name in names:
                match = re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", name)
                path = os.path.join(directory, name)
                if (
                    match is None
                    or not self._first_step < int(match.group(1)) <= state.global_step
                    or os.path.abspath(path) in self._recorded
                    or os.path.exists(os.path.join(path, "checkpoint-is-incomplete.txt"))
                    or os.path.getmtime(path) < self._began_at - 1.0  # file times lag the clock a little
                ):
                    continue
                self._record_save(path, int(match.group(1)), None)  # no stall: the save was not seen

    @guarded()
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        try:
            self._emit()
            if self._attached and self.agent is not None:
                self._record_unannounced_saves(args, state)
        finally:
            self._close()
